"""A runtime's layout as the prefix cache sees it: identity, how each layer resumes, array specs.

Computed once per model object and store setting: the identity samples the
weights (~10-20 ms, as much as a warm prefill) and the probe runs one forward.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import weakref
from dataclasses import dataclass, field

from ..layers.protocol import CHECKPOINT, PAGES
from ..spec import spec_of
from .identity import model_identity

APC_VERSION = 2  # record schema of the prefix cache; part of the identity, so a change is a miss
DEFAULT_SPT = 1e-3  # seconds per token assumed before any prefill was timed
SPT_SAMPLES = 8  # prefills whose median rate prices the records (Layout.learn)


@dataclass
class Layout:
    """What the cache knows of a model's runtime layout under one store setting.

    Attributes:
        identity: 32 bytes: model identity + layer layouts + record schema.
        page_tokens: tokens per page.
        resumes: per layer, PAGES or CHECKPOINT.
        probe: per layer, the spec of what it exported after one token.
        logits: the spec entry of one position's logits.
        spt: seconds per prompt token: the median of the first `SPT_SAMPLES` prefills that
            computed some after the first (`learn`), then fixed. A record's cost decides its eviction against
            its neighbours', by buckets of powers of two: a rate that followed every prefill
            (MLX's first call, a loaded machine) would put records of the same worth in
            different buckets, and a newer one would go before an older one.
    """

    identity: bytes
    page_tokens: int
    resumes: tuple[str, ...]
    probe: tuple[dict, ...]
    logits: tuple[str, tuple]
    spt: float = DEFAULT_SPT
    samples: list = field(default_factory=list, compare=False, repr=False)  # the first SPT_SAMPLES rates

    def learn(self, seconds: float, tokens: int) -> None:
        """Count a prefill that computed `tokens` tokens in `seconds`."""
        if tokens <= 0 or not seconds > 0 or len(self.samples) > SPT_SAMPLES:
            return
        self.samples.append(seconds / tokens)
        warm = self.samples[1:] or self.samples  # the first prefill also pays MLX's first calls
        self.spt = statistics.median(warm)

    @property
    def stateful(self) -> bool:
        """True if some layer resumes only from a checkpoint."""
        return CHECKPOINT in self.resumes

    @property
    def paged(self) -> bool:
        """True if some layer keeps per-token rows in pages."""
        return PAGES in self.resumes

    def layers(self, kind: str) -> list[int]:
        return [i for i, r in enumerate(self.resumes) if r == kind]


# model -> {(page_tokens, salt, layer layouts): Layout}, shared by every Runtime on
# one model object. Call `forget(model)` after changing a model's weights in place.
_LAYOUTS: dict[int, tuple[weakref.ref, dict]] = {}  # id(model) -> (weak ref to it, layouts); modules are unhashable


def forget(model) -> None:
    """Drop what the cache computed about `model` (after loading other weights into it)."""
    _LAYOUTS.pop(id(model), None)


def _per_model(model) -> dict:
    entry = _LAYOUTS.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = _LAYOUTS[id(model)] = (weakref.ref(model, lambda _, k=id(model): _LAYOUTS.pop(k, None)), {})
    return entry[1]


def _probe(rt) -> tuple[tuple[dict, ...], tuple[str, tuple]]:
    """Specs of every layer's exports after one token, on a fresh runtime of the same kind."""
    fresh = type(rt)(rt.model, recurrent_strategy=rt.recurrent_strategy)
    logits = fresh.forward([0])[:, -1, :]
    fresh.quantize_like(rt)  # KV layers that kv_bits quantized export quantized rows
    specs = []
    for layer in fresh.cache:
        if layer.resumes_from == PAGES:
            specs.append(spec_of(layer.export_rows(0, 1)))
        else:
            specs.append(spec_of(layer.export_state()[0]))
    return tuple(specs), next(iter(spec_of({"x": logits}).values()))


def layout_of(rt) -> Layout:
    """The runtime's layout under its store's settings (computed once per model object)."""
    store = rt.store
    layers = [layer.layout() for layer in rt.cache]
    key = (store.page_tokens, store.salt, json.dumps(layers))
    per_model = _per_model(rt.model)
    if key not in per_model:
        base = model_identity(rt.model, page_tokens=store.page_tokens, salt=store.salt)
        desc = json.dumps({"apc": APC_VERSION, "layers": layers}, sort_keys=True).encode()
        identity = hashlib.blake2b(base + desc, digest_size=32, person=b"segcache.apc.2").digest()
        probe, logits = _probe(rt)
        resumes = tuple(layer.resumes_from for layer in rt.cache)
        per_model[key] = Layout(identity, store.page_tokens, resumes, probe, logits)
    return per_model[key]
