"""The target's last hidden state, from the same forward that produces its logits.

mlx-lm's text models end ``hidden = self.model(inputs, cache)`` (the backbone,
which applies the final norm) and ``logits = lm_head(hidden)`` (or the tied
embedding). :func:`forward_with_hidden` runs those two steps itself, in the same
order on the same modules, so the logits are bit-identical to ``model(inputs,
cache=cache)`` and the hidden state is the very array the output head consumed:
no second forward, no hook, no patched module.

Cost: when MTP is off nothing changes (callers keep calling ``model(...)``).
When it is on, the only extra is keeping a reference to the ``[B, L, H]`` hidden
array that the forward computes anyway (H / V of the logits' memory).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from .module import _text_parts


def forward_with_hidden(model: nn.Module, inputs: mx.array,
                        cache: Optional[Any] = None) -> tuple[mx.array, mx.array]:
    """Runs ``model`` on ``inputs`` and returns ``(logits, hidden)``.

    Args:
        model: An mlx-lm model of a family with an MTP head (qwen3_5, qwen3_5_moe,
            qwen3_next), unmodified.
        inputs: Token ids ``[B, L]``.
        cache: The model's per-layer caches (mlx-lm's or segcache's), or None.

    Returns:
        ``logits [B, L, V]`` (bit-identical to ``model(inputs, cache=cache)``) and
        ``hidden [B, L, H]``: the final hidden states after the final norm, the
        input of the output head.

    Raises:
        UnsupportedModelError: the family has no known MTP head.
    """
    _, text_model, projection, _ = _text_parts(model)
    hidden = text_model(inputs, cache)
    return projection(hidden), hidden
