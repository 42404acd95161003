"""Hooks for modules whose recurrent state lives in `ArraysCache` slots (SSM, short conv).

A family's hook is one `Hook` entry: the module class that consumes the
cache and the names of its (input, mask, cache) parameters. Adapting swaps
the module instance's class for a subclass whose `__call__`:

* outside a branch (or on any cache that is not a `StateLayer`, mlx-lm's own
  included) runs mlx-lm's `__call__` with the caller's very arguments, so the
  kernel it selects (`ssm_update`'s Metal kernel, ...) stays on the hot path;
* inside a branch records a `Call` on the layer: with "replay" after running
  mlx-lm's `__call__` on the block unchanged; with "states" running it one
  token at a time and keeping the slots after each token.

The module is its own recurrence: a replay calls mlx-lm's `__call__` again on
the accepted inputs, with a scratch `ArraysCache` holding the slots to start
from, and keeps only the slots it leaves (its output is never evaluated). On a
batched layer (B rows) a replay may take some rows only: every input with the
batch's rows on axis 0 is cut to them, so a row's slots are rebuilt from its
own tokens alone.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import BranchError, UnsupportedModelError
from ..layers.composite import BatchCompositeLayer, CompositeLayer
from ..layers.state import Call, StateLayer


def _baichuan_tail(module, x: mx.array, n: int) -> list:
    """The last raw key / value row after n tokens: what baichuan_m1's 2-tap conv keeps."""
    B, _, D = x.shape
    kv = module.num_kv_heads * module.head_dim
    _, k, v = mx.split(module.W_pack(x[:, n - 1 : n]), (D, D + kv), axis=-1)
    return [t.reshape(B, 1, module.num_kv_heads, module.head_dim).transpose(0, 2, 1, 3) for t in (k, v)]


@dataclass(frozen=True)
class Hook:
    """How one module class consumes its `ArraysCache`.

    Attributes:
        family: the mlx-lm model module (`mlx_lm.models.<family>`).
        cls: the module class's name in it.
        input, mask, cache: its parameter names (mask None: it takes none).
        advances: True if the module calls `cache.advance(S)` itself.
        position: a parameter giving the position of the first input token
            (bailing_moe_linear's RoPE `offset`, read from the attention
            layer's cache); a call cut at `start` gets position + start.
        kernel: the recurrence `__call__` reaches, as a dotted name under the
            family's model module (tests record its calls).
        sliced: more parameters cut by time with the input (rwkv7's v_first).
        child: the state is child `child` of the `CacheList` the module gets
            (baichuan_m1: its attention module gets the conv tail and the K/V).
        tail: (module, input, n) -> the slots after the first n tokens, where
            they are rows the module computed from its input alone (a conv
            tail): commit computes them instead of re-running the module.
        growing: module -> {slot: (axis, most rows)} for slots whose length grows
            up to a bound (the store's spec allows that range).
        fresh: the module starts from a None slot otherwise than from zeros
            (recurrent_gemma scales a sequence's first token apart), so a batch,
            whose empty rows hold zeros beside the others, is not exact: not batched.
        split: the module is a Mamba-2 mixer with mlx-lm's `_conv(conv_input,
            cache, mask)` and `_ssm(x, B, C, dt, cache, mask)` steps: with
            "replay" a branch records what they consumed, and a partial commit
            slices the conv tail from the recorded conv rows and re-runs only
            `_ssm` (not the projections, the conv, the norm).
    """

    family: str
    cls: str
    input: str
    mask: str | None
    cache: str
    advances: bool
    kernel: str
    position: str | None = None
    sliced: tuple[str, ...] = ()
    child: int | None = None
    tail: Callable | None = None
    split: bool = False
    growing: Callable | None = None
    fresh: bool = False

    @property
    def module_class(self) -> type:
        return getattr(importlib.import_module(f"mlx_lm.models.{self.family}"), self.cls)


_MAMBA2 = dict(mask="mask", cache="cache", advances=True, kernel="ssm_update", split=True)

HOOKS = (
    Hook("nemotron_h", "NemotronHMamba2Mixer", "hidden_states", **_MAMBA2),
    Hook("granitemoehybrid", "GraniteMoeHybridMamba2Mixer", "hidden_states", **_MAMBA2),
    Hook("falcon_h1", "FalconH1Mixer", "input_states", **_MAMBA2),
    Hook("mamba2", "Mamba2Block", "hidden_states", **_MAMBA2),
    Hook("lfm2", "ShortConv", "x", "mask", "cache", True, "nn.Conv1d.__call__"),
    Hook("lfm2_moe", "ShortConv", "x", "mask", "cache", True, "nn.Conv1d.__call__"),
    Hook("mamba", "MambaBlock", "x", None, "cache", False, "MambaBlock.ssm_step"),
    Hook("jamba", "JambaMambaMixer", "x", None, "cache", False, "JambaMambaMixer.ssm_step"),
    Hook("plamo2", "Mamba", "hidden_states", **_MAMBA2),
    Hook("kimi_linear", "KimiDeltaAttention", "x", "mask", "cache", True, "gated_delta_update"),
    # its mask argument is the attention mask, unused by the recurrent block: passed as is
    Hook("recurrent_gemma", "RecurrentBlock", "x", None, "cache", False, "rnn_scan", fresh=True),
    Hook("bailing_moe_linear", "LinearAttention", "x", "mask", "cache", False, "recurrent_gla", position="offset"),
    # the decoder layer: time mixing (slots 0, 1) and channel mixing (slot 2) share one cache
    Hook("rwkv7", "Rwkv7Layer", "x", None, "cache", False, "Rwkv7TimeMixing._wkv7", sliced=("v_first",)),
    Hook("olmo_hybrid", "GatedDeltaNet", "x", "mask", "cache", True, "gated_delta_update"),
    Hook("gear", "ConvKVGatedMixer", "x", "mask", "cache", True, "nn.Conv1d.__call__"),
    Hook("bailing_hybrid", "LinearAttention", "x", "mask", "cache", True, "recurrent_gla", position="offset"),
    Hook("bailing_moe_v3", "BailingKDA", "x", "mask", "cache", True, "gated_delta_update"),
    Hook("kimi_k3", "KimiK3DeltaAttention", "x", "mask", "cache", True, "gated_delta_update"),
    # a model-level module: the last n-1 token ids its n-gram embedding needs (registry.py: OWNERS)
    Hook("longcat_flash_ngram", "NgramEmbedding", "input_ids", None, "cache", False, "NgramEmbedding._get_ngram_ids",
         growing=lambda module: {0: (1, module.n - 1)}),
    Hook("baichuan_m1", "Attention", "x", None, "cache", False, "Attention._custom_convolution", child=0,
         tail=_baichuan_tail),
)

_by_class: dict[type, Hook] | None = None


def by_class() -> dict[type, Hook]:
    """module class -> its hook (the model modules are imported on first use)."""
    global _by_class
    if _by_class is None:
        _by_class = {h.module_class: h for h in HOOKS}
    return _by_class


def find_state_module(layer):
    """(module, its mlx-lm class, hook) of the one state module in a decoder layer, or None."""
    hooks = by_class()
    found = []
    for _, module in layer.named_modules():
        base = type(module).__mro__[1] if getattr(type(module), "segcache_adapted", False) else type(module)
        if base in hooks:
            found.append((module, base, hooks[base]))
    return found[0] if len(found) == 1 else None


_adapted: dict[type, type] = {}
# id(module) -> what its `_conv` / `_ssm` consumed during one branch call (split hooks only)
_recording: dict[int, dict] = {}


def _split_methods(base: type) -> dict:
    """Pass-through `_conv` / `_ssm` that also record their inputs while a branch call records."""
    conv, ssm = base._conv, base._ssm

    def _conv(self, conv_input, cache, mask):
        rec = _recording.get(id(self))
        if rec is not None:
            rec["conv"] = conv_input if mask is None else mx.where(mask[..., None], conv_input, 0)
        return conv(self, conv_input, cache, mask)

    def _ssm(self, x, B, C, dt, cache, mask):
        rec = _recording.get(id(self))
        if rec is not None:
            rec["ssm"] = (x, B, C, dt, mask)
        return ssm(self, x, B, C, dt, cache, mask)

    return {"_conv": _conv, "_ssm": _ssm}


def adapted_class(base: type) -> type:
    """The subclass of `base` that records calls inside branches (one per base)."""
    if base not in _adapted:
        hook = by_class()[base]
        original = base.__call__
        params = list(inspect.signature(original).parameters)
        cache_pos = params.index(hook.cache) - 1  # positional index after self
        input_pos = params.index(hook.input) - 1

        def __call__(self, *args, **kwargs):
            cache = kwargs.get(hook.cache, args[cache_pos] if len(args) > cache_pos else None)
            layer = _state_layer(cache, hook)
            if layer is None:
                return original(self, *args, **kwargs)
            if layer.capturing:
                return _branch_call(self, original, hook, args, kwargs, layer)
            out = original(self, *args, **kwargs)
            if not hook.advances:
                x = kwargs.get(hook.input, args[input_pos] if len(args) > input_pos else None)
                layer.count(x.shape[1])
            return out

        methods = {"__call__": __call__, "segcache_adapted": True}
        if hook.split:
            methods.update(_split_methods(base))
        _adapted[base] = type(base.__name__, (base,), methods)
    return _adapted[base]


def _state_layer(cache, hook: Hook) -> StateLayer | None:
    """The segcache layer holding the hook's state, if `cache` is one of ours."""
    # StateLayer or the batched kind StateLayer.merge makes (which only counts); a
    # composite or what CompositeLayer.merge makes of it
    if hook.child is not None:
        if isinstance(cache, (CompositeLayer, BatchCompositeLayer)) and isinstance(cache.caches[hook.child], StateLayer):
            return cache.caches[hook.child]
        return None
    return cache if isinstance(cache, StateLayer) else None


def _concat(outs: list):
    """Per-token outputs joined by time (each element of tuple outputs; None stays None)."""
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        return tuple(None if o[0] is None else mx.concatenate(list(o), axis=1) for o in zip(*outs))
    return mx.concatenate(outs, axis=1)


def adapt(module, base: type) -> None:
    """Make `module` record its calls inside branches (idempotent)."""
    if not getattr(type(module), "segcache_adapted", False):
        module.__class__ = adapted_class(base)


def _cut(mask, start: int, end: int, S: int):
    if mask is None:
        return None
    if isinstance(mask, mx.array) and mask.ndim == 2 and mask.shape[1] == S:
        return mask[:, start:end]
    raise UnsupportedModelError(f"a state module's mask of shape {getattr(mask, 'shape', mask)!r} cannot be cut by time")


def _branch_call(module, original, hook: Hook, args, kwargs, layer: StateLayer):
    if layer.lengths is not None or layer.left_padding is not None:
        raise BranchError("batched (padded) recurrent caches cannot be forwarded inside a branch")
    bound = inspect.signature(original).bind(module, *args, **kwargs)
    arguments = dict(bound.arguments)
    x = arguments[hook.input]
    mask = arguments.get(hook.mask) if hook.mask else None
    S = x.shape[1]
    _cut(mask, 0, S, S)  # a mask that cannot be cut fails here, before anything changed, not at commit
    cache_arg = arguments[hook.cache]

    B = x.shape[0]
    if hook.tail is not None:
        # the state is rows the module computed: run it unchanged, commit recomputes the rows
        out = original(**arguments)
        layer.count(S)
        layer.record(Call(S, lambda n, slots, rows=None: hook.tail(module, _rows(x, rows, B), n), None))
        return out

    def run(start: int, end: int, cache, rows=None):
        call = dict(arguments)
        whole = (start, end) == (0, S)
        call[hook.input] = _rows(x if whole else x[:, start:end], rows, B)
        if hook.mask:
            call[hook.mask] = _rows(mask if whole else _cut(mask, start, end, S), rows, B)
        for name in hook.sliced:
            v = arguments.get(name)
            call[name] = _rows(v if whole or v is None else v[:, start:end], rows, B)
        call[hook.cache] = cache
        if hook.position:
            call[hook.position] = _rows(arguments.get(hook.position, 0), rows, B) + start
        out = original(**call)
        if not hook.advances and cache is cache_arg:
            layer.count(end - start)
        return out

    per_token = layer.strategy == "states"

    def replay(n: int, slots: list, rows=None) -> list:
        # the same call boundaries the forward used: the block, or one token at a time
        scratch = ArraysCache(len(slots))
        scratch.cache = list(slots)
        for start, end in ([(t, t + 1) for t in range(n)] if per_token else [(0, n)]):
            run(start, end, scratch, rows)
        return scratch.cache

    states = None
    if per_token:
        # "states": one token at a time; keep each token's slots while within the budget
        keep = layer.keeps_states(S, max(layer.state_bytes(), 1))
        outs, kept = [], []
        for t in range(S):
            outs.append(run(t, t + 1, cache_arg))
            kept.append(list(layer.cache))
        # from an empty layer the slots' size is known only after the first token
        if keep and S * layer.state_bytes() + layer.kept_bytes <= layer.states_budget_bytes:
            states = kept
        out = _concat(outs)
    elif hook.split:
        # "replay" of a Mamba-2 mixer: mlx-lm's own call on the block, its steps' inputs recorded
        _recording[id(module)] = rec = {}
        try:
            out = run(0, S, cache_arg)
        finally:
            del _recording[id(module)]
        replay = _split_replay(module, type(module).__mro__[1], rec, S)
    else:
        # "replay": mlx-lm's own call on the block, unchanged
        out = run(0, S, cache_arg)
    layer.record(Call(S, replay, states))
    return out


def _split_replay(module, base: type, rec: dict, S: int):
    """(n, slots, rows) -> slots after n tokens: the conv tail sliced, `_ssm` re-run on n tokens."""
    conv_rows, (x, B, C, dt, mask) = rec["conv"], rec["ssm"]
    keep = module.conv_kernel_size - 1
    batch = conv_rows.shape[0]

    def replay(n: int, slots: list, rows=None) -> list:
        inputs = _rows(conv_rows, rows, batch)
        tail = slots[0]
        if tail is None:  # as mlx-lm's _conv starts
            tail = mx.zeros((inputs.shape[0], keep, inputs.shape[2]), dtype=inputs.dtype)
        # mlx-lm keeps padded_input[:, -keep:]: the same rows, sliced
        conv = mx.concatenate([tail, inputs[:, :n]], axis=1)[:, -keep:, :]
        scratch = ArraysCache(2)
        scratch.cache = [conv, slots[1]]
        cut = [_rows(a if n == S else a[:, :n], rows, batch) for a in (x, B, C, dt)]
        base._ssm(module, *cut, scratch, _rows(mask if n == S else _cut(mask, 0, n, S), rows, batch))
        return scratch.cache

    return replay


def _rows(a, rows, batch: int):
    """`a` cut to the batch rows `rows` (an index array; None: all) if its axis 0 holds the batch's rows."""
    if rows is None or not isinstance(a, mx.array) or a.ndim == 0 or a.shape[0] != batch:
        return a
    return a[rows]
