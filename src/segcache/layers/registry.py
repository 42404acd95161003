"""Which segment kind replaces which mlx-lm cache: the one place a new kind is registered.

`Runtime` asks `match` for every decoder layer before it changes anything, then
builds the layers (adapting recurrent modules all or none). A kind needs its
own module (mlx-lm's cache protocol for the model, `layers.protocol` for the
prefix store) and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from .. import adapters
from ..adapters import state as state_hooks
from .composite import CompositeLayer
from .kv import KVLayer
from .recurrent import RecurrentLayer
from .state import StateLayer
from .window import WindowLayer


@dataclass(frozen=True)
class Options:
    """Runtime settings a kind may use when it builds a layer."""

    recurrent_strategy: str  # Gated DeltaNet layers
    states_budget_bytes: int  # per recurrent layer
    state_strategy: str = "replay"  # StateLayer (layers/state.py: default_state_strategy)


@dataclass(frozen=True)
class SegmentKind:
    """One segment kind: what mlx-lm cache it replaces and how it is built.

    Attributes:
        name: for messages.
        native: the mlx-lm cache class `model.make_cache()` returns for such a layer.
        match: (native cache, decoder layer) -> what `build` needs, or None if this kind cannot serve it.
        build: (native cache, matched, options) -> the segment layer.
        modules: matched -> [(module, its mlx-lm class)] to adapt (`adapters.adapt`).
    """

    name: str
    native: type
    match: Callable[[Any, Any], Any]
    build: Callable[[Any, Any, Options], Any]
    modules: Callable[[Any], list] = lambda matched: []


def _recurrent_match(cache, layer):
    return adapters.find_recurrent_module(layer) if len(cache.cache) == 2 else None


KINDS = (
    SegmentKind("kv", KVCache, lambda cache, layer: True, lambda cache, m, o: KVLayer()),
    SegmentKind("window", RotatingKVCache, lambda cache, layer: True, lambda cache, m, o: WindowLayer(cache.max_size, cache.keep)),
    SegmentKind(
        "recurrent",
        ArraysCache,
        _recurrent_match,
        lambda cache, m, o: RecurrentLayer(
            m[0].conv_kernel_size - 1, o.recurrent_strategy, states_budget_bytes=o.states_budget_bytes
        ),
        modules=lambda matched: [matched],
    ),
    # Any other ArraysCache whose module has a hook (adapters/state.py): SSM, short conv.
    SegmentKind(
        "state",
        ArraysCache,
        lambda cache, layer: state_hooks.find_state_module(layer),
        lambda cache, m, o: StateLayer(
            len(cache.cache), m[2].family, o.state_strategy, states_budget_bytes=o.states_budget_bytes,
            growing=m[2].growing(m[0]) if m[2].growing else None,
        ),
        modules=lambda matched: [matched[:2]],
    ),
    # CacheList: a composite whose children are matched against the same decoder layer.
    SegmentKind(
        "list",
        CacheList,
        lambda cache, layer: _list_match(cache, layer),
        lambda cache, m, o: CompositeLayer(*(kind.build(c, found, o) for c, (kind, found) in zip(cache.caches, m))),
        modules=lambda matched: [x for kind, found in matched for x in kind.modules(found)],
    ),
)


def _list_match(cache, layer):
    children = [match(c, layer) for c in cache.caches]
    return children if children and all(children) else None


# Models whose cache list is not one per decoder layer: model module -> the
# decoder layer each cache belongs to, in cache order.
OWNERS = {
    # MLP / MoE-only blocks ("-", "E") get no cache
    "mlx_lm.models.nemotron_h": lambda model: [l for l in model.layers if l.block_type in ("M", "*")],
    # cache 0 is the n-gram embedding's token context: the embedding module owns it
    "mlx_lm.models.longcat_flash_ngram": lambda model: [model.model.ngram_embeddings, *model.layers],
}


def owners(model, caches: list) -> list | None:
    """The decoder layer each of `caches` belongs to, or None if that is unknown."""
    layers = list(model.layers)
    pick = OWNERS.get(type(model).__module__)
    if pick is not None:
        layers = pick(model)
    return layers if len(layers) == len(caches) else None


def recurrent_count(plan) -> int:
    """Recurrent segments in a build plan (the state budget is split over them)."""
    return sum(len(kind.modules(matched)) for kind, _, matched in plan)


def match(cache, layer) -> tuple[SegmentKind, Any] | None:
    """The kind serving a layer whose native cache is `cache` (exact class), and what it matched."""
    for kind in KINDS:
        if type(cache) is kind.native:
            found = kind.match(cache, layer)
            if found:
                return kind, found
    return None


def supported() -> str:
    """A sentence naming what is supported, for UnsupportedModelError."""
    families = ", ".join(c.__module__.rsplit(".", 1)[-1] for c in adapters.FAMILIES)
    hooked = ", ".join(dict.fromkeys(h.family for h in state_hooks.HOOKS))
    return (
        f"KVCache, RotatingKVCache, CacheList of those, ArraysCache for the Gated DeltaNet of {families}, "
        f"and ArraysCache for the SSM / short-conv modules of {hooked}"
    )
