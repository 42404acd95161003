"""The outputs of chosen target layers, from the forwards the target runs anyway.

A DFlash drafter reads the outputs of a few target decoder layers at every position the
target computes. Rather than change any call, each tapped layer *instance* gets a
subclass of its own class whose `__call__` calls the original and keeps a reference to
its output (the way the recurrent adapters swap a module's class). The layer stays the
same object in the module tree (parameters, saving, quantizing see no change), mlx-lm's
code runs unchanged, and `uninstall` puts the original class back.

Cost: with no tap installed nothing changes anywhere. With one, every forward keeps a
reference to the [B, L, H] output each tapped layer computes anyway (the last forward's
only, and a prefill's chunks while collecting).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .model import _target_parts

_ATTR = "_segcache_dflash_tap"
_SLOT = "_segcache_dflash_slot"
_CLASSES: dict[type, type] = {}  # original layer class -> its tapped subclass


def _tapped(cls: type) -> type:
    found = _CLASSES.get(cls)
    if found is None:
        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            tap, slot = object.__getattribute__(self, _SLOT)
            tap.record(slot, out[0] if isinstance(out, tuple) else out)
            return out
        found = _CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_segcache_tapped": cls})
    return found


class LayerTap:
    """Records the outputs of the target layers `layer_ids` at every forward of the model.

    Attributes:
        layer_ids: the tapped layers, in the order their outputs are concatenated.
        chunks: while `collecting`, every forward's concatenated outputs in order.
    """

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...]):
        inner, _, _ = _target_parts(model)
        self.layers = inner.layers
        self.layer_ids = tuple(layer_ids)
        self._outs: list = [None] * len(self.layer_ids)
        # slots are recorded in forward order and concatenated in layer_ids' order: a forward's
        # states are complete once the deepest tapped layer ran
        self._last_slot = max(range(len(self.layer_ids)), key=lambda s: self.layer_ids[s])
        self.last: mx.array | None = None
        self.chunks: list | None = None

    def record(self, slot: int, out: mx.array) -> None:
        self._outs[slot] = out
        if slot == self._last_slot:
            h = self._outs[0] if len(self._outs) == 1 else mx.concatenate(self._outs, axis=-1)
            self.last = h
            if self.chunks is not None:
                self.chunks.append(h)

    def take(self) -> mx.array:
        """The last forward's concatenated layer outputs [B, L, m*H] (and forget them)."""
        if self.last is None:
            raise RuntimeError("no forward of the target since the DFlash tap last gave its states")
        h, self.last = self.last, None
        return h

    @contextmanager
    def collecting(self):
        """Collect every forward's states while the block runs: yields the list."""
        if self.chunks is not None:
            raise RuntimeError("the DFlash tap is collecting already")
        self.chunks = []
        try:
            yield self.chunks
        finally:
            self.chunks = None


def install(model: nn.Module, layer_ids: tuple[int, ...]) -> LayerTap:
    """The model's tap of `layer_ids`, installed on first use (one per model and layer set).

    Raises:
        ValueError: the model is tapped at other layers already (two drafters of other layers).
    """
    tap = getattr(model, _ATTR, None)
    if tap is not None:
        if tap.layer_ids != tuple(layer_ids):
            raise ValueError(f"the target is tapped at layers {tap.layer_ids} already, not {tuple(layer_ids)}; "
                             "one DFlash drafter per target")
        return tap
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"target_layer_ids {layer_ids}: each layer once")
    tap = LayerTap(model, layer_ids)
    for slot, lid in enumerate(layer_ids):
        layer = tap.layers[lid]
        object.__setattr__(layer, _SLOT, (tap, slot))
        layer.__class__ = _tapped(type(layer))
    object.__setattr__(model, _ATTR, tap)
    return tap


def uninstall(model: nn.Module) -> None:
    """Remove the model's tap (its layers get their own classes back)."""
    tap = getattr(model, _ATTR, None)
    if tap is None:
        return
    for lid in tap.layer_ids:
        layer = tap.layers[lid]
        layer.__class__ = type(layer)._segcache_tapped
        object.__delattr__(layer, _SLOT)
    object.__delattr__(model, _ATTR)
