"""Which segment kind replaces which mlx-lm cache: the one place a new kind is registered.

`plan` matches every cache of `model.make_cache()` to a kind before anything
changes; `adapt` then adapts the recurrent modules all or none, and each kind
builds its layer: `build` for a `Runtime` (one sequence), `batched` for a
`BatchRuntime` (B rows). A kind needs its own module (mlx-lm's cache protocol
for the model, `layers.protocol` for the prefix store, its batched form beside
it) and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from . import adapters
from .adapters import state as state_hooks
from .errors import UnsupportedModelError
from .layers.composite import CompositeLayer
from .layers.kv import BatchKVLayer, KVLayer
from .layers.recurrent import BatchRecurrentLayer, RecurrentLayer
from .layers.state import BatchStateLayer, StateLayer
from .layers.window import BatchWindowLayer, WindowLayer


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
        batched: (native cache, matched, options) -> the layer holding B rows of it
            (`BatchRuntime`), or None: this kind is not batched. It may raise
            UnsupportedModelError for a layout it cannot batch.
    """

    name: str
    native: type
    match: Callable[[Any, Any], Any]
    build: Callable[[Any, Any, Options], Any]
    modules: Callable[[Any], list] = lambda matched: []
    batched: Callable[[Any, Any, Options], Any] | None = None


def _recurrent_match(cache, layer):
    return adapters.find_recurrent_module(layer) if len(cache.cache) == 2 else None


KINDS = (
    SegmentKind(
        "kv", KVCache, lambda cache, layer: True, lambda cache, m, o: KVLayer(),
        batched=lambda cache, m, o: BatchKVLayer(),
    ),
    SegmentKind(
        "window", RotatingKVCache, lambda cache, layer: True, lambda cache, m, o: WindowLayer(cache.max_size, cache.keep),
        batched=lambda cache, m, o: BatchWindowLayer(cache.max_size, keep=cache.keep),
    ),
    SegmentKind(
        "recurrent",
        ArraysCache,
        _recurrent_match,
        lambda cache, m, o: RecurrentLayer(
            m[0].conv_kernel_size - 1, o.recurrent_strategy, states_budget_bytes=o.states_budget_bytes
        ),
        modules=lambda matched: [matched],
        batched=lambda cache, m, o: BatchRecurrentLayer(
            m[0].conv_kernel_size - 1, o.recurrent_strategy, states_budget_bytes=o.states_budget_bytes
        ),
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
        batched=lambda cache, m, o: _batched_state(cache, m[2], o),
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


def _batched_state(cache, hook, options: Options) -> BatchStateLayer:
    if hook.growing or hook.fresh:
        why = "grows with the first tokens" if hook.growing else "starts otherwise from None than from zeros"
        raise UnsupportedModelError(
            f"{hook.family}: its {hook.cls} state {why}, so rows of one batch cannot share its slots"
        )
    return BatchStateLayer(len(cache.cache), hook.family, options.state_strategy, states_budget_bytes=options.states_budget_bytes)


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


def plan(model, max_kv_size: int | None = None) -> list[tuple[SegmentKind, Any, Any]]:
    """(kind, native cache, what the kind matched) for every cache `model` makes; changes nothing.

    `max_kv_size` is mlx-lm's (`make_prompt_cache`): a model without its own
    `make_cache` gets sliding windows of that many tokens; else it is ignored.

    Raises:
        UnsupportedModelError: a cache no kind serves, or caches whose decoder layers are unknown.
    """
    native = make_prompt_cache(model, max_kv_size)  # mlx-lm's own rule: the model's make_cache if it has one
    layers = owners(model, native)
    if layers is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} makes {len(native)} caches for {len(model.layers)} layers, and "
            "segcache does not know which layer each belongs to (registry.py: OWNERS)"
        )
    out = []
    for i, (cache, layer) in enumerate(zip(native, layers)):
        found = match(cache, layer)
        if found is None:
            inner = adapters.describe_layer(layer)
            raise UnsupportedModelError(
                f"layer {i} ({type(layer).__name__}{inner}) uses {type(cache).__name__}, which segcache "
                f"cannot roll back; supported: {supported()}"
            )
        out.append((found[0], cache, found[1]))
    return out


def adapt(plan) -> None:
    """Adapt the recurrent modules of `plan` (`adapters.adapt`), all or none."""
    recurrent = [m for kind, _, matched in plan for m in kind.modules(matched)]
    classes = [type(module) for module, _ in recurrent]
    try:
        for module, base in recurrent:
            adapters.adapt(module, base)
    except BaseException:
        for (module, _), cls in zip(recurrent, classes):
            module.__class__ = cls
        raise


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
