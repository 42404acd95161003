"""Prompt cache files (mlx-lm's `save_prompt_cache`, `mlx_lm.cache_prompt`) as segcache Runtimes.

A file holds one cache per decoder layer, of mlx-lm's own classes (KVCache,
RotatingKVCache, QuantizedKVCache, ArraysCache, CacheList) when mlx-lm made
it, or of segcache's layers when `save_prompt_cache(path, rt.cache)` did.
`runtime_from` turns either into a Runtime holding that state, which forks,
commits and drafts like any other (its token ids are unknown, so prompt lookup
drafts only from what follows, and the prefix store does not publish it).

mlx-lm's `ArraysCache` does not record how many tokens it summarizes; the
count is read from the file's attention layers (all layers of one prompt hold
the same count), so a file of a model with recurrent layers only is refused.
"""

from __future__ import annotations

from pathlib import Path

from mlx_lm.models.cache import (ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache,
                                load_prompt_cache)

from .layers.composite import CompositeLayer
from .layers.quantized import QuantizedKVLayer
from .runtime import Runtime


def load(path: str):
    """(caches, metadata) of a prompt cache file, read by mlx-lm's `load_prompt_cache`.

    Raises:
        ValueError: the file is missing or is not a prompt cache file.
    """
    if not Path(path).is_file():
        raise ValueError(f"no prompt cache file at {path!r}")
    try:
        return load_prompt_cache(str(path), return_metadata=True)
    except Exception as exc:  # a foreign safetensors file, an unknown class name, a bad state
        raise ValueError(f"{path!r} is not a prompt cache file mlx-lm can read ({type(exc).__name__}: {exc})") from None


def _count(cache) -> int | None:
    """Tokens an mlx-lm cache holds, if it says (recurrent caches do not)."""
    if isinstance(cache, CacheList):
        counts = {c for c in map(_count, cache.caches) if c is not None}
        return counts.pop() if len(counts) == 1 else None
    if isinstance(cache, (KVCache, RotatingKVCache, QuantizedKVCache)) or hasattr(cache, "committed_offset"):
        return int(cache.offset)
    return None


def _convert(native, own, tokens: int):
    """The segcache layer of `own`'s kind holding what the mlx-lm cache `native` holds.

    mlx-lm's KV, window and quantized states are the segcache kinds' own
    (same tuples); an `ArraysCache` gives its slots, to which the segcache
    kind adds the token count and its settings (its `state` is slots,
    count, settings).
    """
    if hasattr(native, "committed_offset"):  # a segcache layer already (a file saved from rt.cache)
        return native
    if isinstance(native, CacheList):
        if not isinstance(own, CompositeLayer) or len(own.caches) != len(native.caches):
            raise ValueError(f"a CacheList of {len(native.caches)} caches where this model has {type(own).__name__}")
        return CompositeLayer(*(_convert(n, o, tokens) for n, o in zip(native.caches, own.caches)))
    if isinstance(native, QuantizedKVCache):
        return QuantizedKVLayer.from_state(native.state)
    if isinstance(native, ArraysCache):
        slots = list(native.cache)
        template = own.state
        if not isinstance(template, tuple) or len(template) <= len(slots):
            raise ValueError(f"an ArraysCache of {len(slots)} slots where this model has {type(own).__name__}")
        return type(own).from_state((*slots, tokens, *template[len(slots) + 1 :]))
    if isinstance(native, (KVCache, RotatingKVCache)):
        return type(own).from_state(native.state)
    raise ValueError(f"a {type(native).__name__}, which segcache does not know how to resume")


def runtime_from(model, caches, **options) -> Runtime:
    """A Runtime of `model` holding the state of `caches` (mlx-lm's or segcache's layer caches).

    Args:
        model: the model the caches were computed with.
        caches: one cache per decoder layer, as `load_prompt_cache` returns them.
        **options: as for `Runtime(model, ...)`.

    Raises:
        ValueError: the caches do not fit the model's layers, hold different token
            counts, or do not say how many tokens they hold.
    """
    rt = Runtime(model, **options)
    caches = list(caches)
    if len(caches) != len(rt.cache):
        raise ValueError(f"the prompt cache holds {len(caches)} layer caches; this model has {len(rt.cache)} layers")
    counts = {n for n in map(_count, caches) if n is not None}
    if len(counts) != 1:
        raise ValueError(
            "the prompt cache's layers hold different token counts" if counts else
            "the prompt cache holds recurrent states only, which do not say how many tokens they summarize"
        )
    tokens = counts.pop()
    try:
        layers = [_convert(native, own, tokens) for native, own in zip(caches, rt.cache)]
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"the prompt cache does not fit this model: {exc}") from None
    return Runtime.from_prompt_cache(model, layers, **options)
