"""Model identity: everything that changes the bytes of a cached state.

The identity hashes the model config, parameter dtypes, the cache layout, the
page size, the store format version, an optional salt, a fingerprint of the
weights, and every byte of the model's LoRA / DoRA adapters if it has some
(segcache.lora). The fingerprint reads each parameter's name, shape and dtype plus a
fixed strided sample of its elements (a few hundred per tensor, gathered by
MLX), so it costs milliseconds for a multi-GB model. It tells apart models
whose weights differ broadly (other checkpoints, other seeds); two models that
differ only in elements the sample misses would share an identity; pass a salt
for such cases. One rank of a sharded model (tensor or pipeline parallel) adds
its `Shard`: the world size, its rank, the kind of parallelism and the layers it
runs, so no rank ever hits another rank's or a single process's records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import lora
from ..ranks import shard_of
from .codec import FORMAT_VERSION

SAMPLES_PER_TENSOR = 256
_PERSON = b"segcache.id.1"


def _plain(x: Any) -> Any:
    """Config values as JSON-able plain data, deterministically."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


def model_config(model) -> Any:
    """The model's config: ``model.args`` (a dataclass in mlx-lm), else ``model.config``."""
    args = getattr(model, "args", None)
    if args is None:
        args = getattr(model, "config", None)
    return _plain(args)


def cache_layout(model) -> list:
    """Per-layer cache type and its shape parameters (window size, keep)."""
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
        return [[type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None)] for c in caches]
    return [["KVCache", None, None]] * len(getattr(model, "layers", []))


def weights_fingerprint(model, samples: int = SAMPLES_PER_TENSOR) -> bytes:
    """Hash names, shapes, dtypes and a strided sample of every parameter (no full read)."""
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    picks = []
    for name, p in params:
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype};".encode())
        n = p.size
        if n == 0:
            continue
        k = min(samples, n)
        # k evenly spaced indices from the first element to the last
        idx = (mx.arange(k, dtype=mx.int64) * (n - 1)) // max(k - 1, 1)
        pick = mx.take(p.reshape(-1), idx)
        picks.append(pick.astype(mx.uint8) if p.dtype == mx.bool_ else pick.view(mx.uint8))
    if picks:
        sample = mx.concatenate(picks)
        mx.eval(sample)
        h.update(memoryview(sample))
    return h.digest()


def model_identity(model, *, page_tokens: int = 256, salt: bytes | str | None = None) -> bytes:
    """32-byte identity of (config, dtypes, cache layout, page size, format, salt, weights, adapters),
    and for one rank of a sharded model its `Shard` (segcache.ranks.shard_of).

    Args:
        model: An mlx-lm model (``nn.Module`` with ``args`` or ``config``).
        page_tokens: Tokens per KV page of the store.
        salt: Optional bytes/str; different salts never share keys.
    """
    params = tree_flatten(model.parameters())
    desc = {
        "format": FORMAT_VERSION,
        "config": model_config(model),
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "dtypes": sorted({str(p.dtype) for _, p in params}),
        "cache": cache_layout(model),
        "page_tokens": int(page_tokens),
    }
    shard = shard_of(model)
    if shard is not None:  # a rank's slice: world size, rank, kind of parallelism, its layers
        desc["shard"] = shard.describe()
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    h.update(json.dumps(desc, sort_keys=True, separators=(",", ":")).encode())
    salt_b = salt.encode() if isinstance(salt, str) else (salt or b"")
    h.update(len(salt_b).to_bytes(4, "little") + salt_b)
    h.update(weights_fingerprint(model))
    adapter = lora.fingerprint(model)  # LoRA / DoRA modules hashed whole (segcache.lora)
    if adapter is not None:  # absent: identities of models without adapters stay as they were
        h.update(b"adapter" + adapter)
    return h.digest()
