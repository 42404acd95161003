"""Which segment kind replaces which mlx-lm cache: the one place a new kind is registered.

`Runtime` asks `match` for every decoder layer before it changes anything, then
builds the layers (adapting recurrent modules all or none). A kind needs its
own module (mlx-lm's cache protocol for the model, `layers.protocol` for the
prefix store) and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from .. import adapters
from .kv import KVLayer
from .recurrent import RecurrentLayer
from .window import WindowLayer


@dataclass(frozen=True)
class Options:
    """Runtime settings a kind may use when it builds a layer."""

    recurrent_strategy: str
    states_budget_bytes: int  # per recurrent layer


@dataclass(frozen=True)
class SegmentKind:
    """One segment kind: what mlx-lm cache it replaces and how it is built.

    Attributes:
        name: for messages.
        native: the mlx-lm cache class `model.make_cache()` returns for such a layer.
        match: (native cache, decoder layer) -> what `build` needs, or None if this kind cannot serve it.
        build: (native cache, matched, options) -> the segment layer.
        module: matched -> (recurrent module, its mlx-lm class) to adapt, or None.
    """

    name: str
    native: type
    match: Callable[[Any, Any], Any]
    build: Callable[[Any, Any, Options], Any]
    module: Callable[[Any], tuple | None] = lambda matched: None


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
        module=lambda matched: matched,
    ),
)


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
    return f"KVCache, RotatingKVCache, and ArraysCache for the Gated DeltaNet of {families}"
