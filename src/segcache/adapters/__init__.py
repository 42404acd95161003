"""Per-family recurrent adapters: find a layer's recurrent module and adapt it.

Adapting swaps one module instance's class for a subclass whose `__call__`
runs `branch_forward` when its cache is a `RecurrentLayer` inside a branch,
`chunked_forward` for a long enough block on a `RecurrentLayer` set to the
chunked prefill (`Runtime(gdn_prefill=...)`), and mlx-lm's own `__call__`
otherwise (native caches included), so the model keeps working with mlx-lm's
caches, and outside branches under "native" nothing changes.
"""

from __future__ import annotations

from ..layers.recurrent import RecurrentLayer
from . import qwen3_5, qwen3_next, state
from .chunked import chunked_forward, takes_chunked
from .gated_delta import branch_forward

# module class -> project(module, inputs) -> (qkv, z, b, a)
FAMILIES = {
    qwen3_next.MODULE: qwen3_next.project,
    qwen3_5.MODULE: qwen3_5.project,
}

_adapted_classes: dict[type, type] = {}


def _adapted_class(base: type, project) -> type:
    if base not in _adapted_classes:
        original = base.__call__

        def __call__(self, inputs, mask=None, cache=None):
            if isinstance(cache, RecurrentLayer) and cache.capturing:
                return branch_forward(self, project, inputs, mask, cache)
            if isinstance(cache, RecurrentLayer) and takes_chunked(self, inputs, cache):
                return chunked_forward(self, project, inputs, mask, cache)
            return original(self, inputs, mask, cache)

        _adapted_classes[base] = type(base.__name__, (base,), {"__call__": __call__, "segcache_adapted": True})
    return _adapted_classes[base]


def find_recurrent_module(layer):
    """The adaptable recurrent module inside a decoder layer, or None."""
    for _, module in layer.named_modules():
        base = type(module).__mro__[1] if getattr(type(module), "segcache_adapted", False) else type(module)
        if base in FAMILIES:
            return module, base
    return None


def adapt(module, base: type) -> None:
    """Make `module` hand its recurrence inputs to segcache inside branches (idempotent)."""
    if base not in FAMILIES:  # SSM / short-conv modules (adapters/state.py)
        return state.adapt(module, base)
    if not getattr(type(module), "segcache_adapted", False):
        module.__class__ = _adapted_class(base, FAMILIES[base])


def describe_layer(layer) -> str:
    """", with <Module>" naming a recurrent-looking submodule, for error messages."""
    named = getattr(layer, "named_modules", None)
    for name, module in named() if named else ():
        if name and ("attn" in name or "mixer" in name or "ssm" in name):
            return f", {name}: {type(module).__name__}"
    return ""
