"""The target's last hidden state from the forwards a decoder already runs.

An MTP drafter needs the target's final hidden state (after its final norm, the
tensor the output head scores) at every position the target verifies. The
decoder's rows call ``model(x, cache=...)`` (a `Runtime`, a `BatchRuntime`, a
prefill), so rather than change those calls the tap stands in for the text
model's final norm as a plain attribute: the backbone's ``self.norm(h)`` calls
the tap, which calls the norm and keeps a reference to its output. The norm
module stays where it was in the module tree (parameters, saving, quantizing
see no change), and removing the tap restores the attribute lookup exactly.

Cost: with no tap installed nothing changes anywhere. With one, every forward of
the model keeps a reference to the [B, L, H] hidden array it computes anyway
(the tap holds the last forward's only, and a prefill's chunks while collecting).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .module import _text_parts

_ATTR = "_segcache_hidden_tap"


class HiddenTap:
    """Records the output of the target's final norm at every forward of the model.

    Attributes:
        last: the last forward's hidden states [B, L, H] (lazy), or None.
        chunks: while `collecting`, every forward's hidden states in order.
    """

    def __init__(self, model: nn.Module):
        _, text_model, _, _ = _text_parts(model)
        self.text_model = text_model
        self.norm = text_model["norm"]  # the module in the tree, not an attribute stand-in
        self.last: mx.array | None = None
        self.chunks: list | None = None

    def __call__(self, x: mx.array) -> mx.array:
        h = self.norm(x)
        self.last = h
        if self.chunks is not None:
            self.chunks.append(h)
        return h

    def take(self) -> mx.array:
        """The last forward's hidden states (and forget them)."""
        if self.last is None:
            raise RuntimeError("no forward of the target since the hidden tap last gave its states")
        h, self.last = self.last, None
        return h

    @contextmanager
    def collecting(self):
        """Collect every forward's hidden states while the block runs: yields the list."""
        if self.chunks is not None:
            raise RuntimeError("the hidden tap is collecting already")
        self.chunks = []
        try:
            yield self.chunks
        finally:
            self.chunks = None


def install(model: nn.Module) -> HiddenTap:
    """The model's tap, installed on first use (one per model, shared by its drafters)."""
    tap = getattr(model, _ATTR, None)
    if tap is None:
        tap = HiddenTap(model)
        # plain (non-module) attributes bypass nn.Module's dict: the module tree is unchanged
        object.__setattr__(tap.text_model, "norm", tap)
        object.__setattr__(model, _ATTR, tap)
    return tap


def uninstall(model: nn.Module) -> None:
    """Remove the model's tap (the norm is found in the module tree again)."""
    tap = getattr(model, _ATTR, None)
    if tap is not None:
        object.__delattr__(tap.text_model, "norm")
        object.__delattr__(model, _ATTR)
