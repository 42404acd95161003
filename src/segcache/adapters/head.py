"""The model's output head apart from its body: logits only where a caller reads them.

mlx-lm's models end their forward with the output head over every position:

    out = self.model(inputs, cache)                       the body: embeddings, layers, final norm
    out = embed_tokens.as_linear(out) | lm_head(out)      the head: [B, S, H] -> [B, S, V]

A prefill reads one position per row at most (the last real one: at the
prompt's end, its first sampled token), so the head over the other S - 1
positions is wasted: on the shipped target about a tenth of a prefill
forward's products. mlx-lm's BatchGenerator skips it by
never evaluating a prefill's logits; a segcache prefill needs the last
position's, so `rows_logits` runs the body and then the head on the positions
asked for only: a padded batch's rows (`BatchRuntime.forward_padded(last_only=True)`),
and `last_logits` the last position of a one-row forward
(`Runtime.forward(last_only=True)`, what `Prefill.feed` runs).

A chunk whose logits nobody reads needs no split: the head's product is lazy and
nothing evaluated depends on it (a prefill evaluates the layers' states only), so
it never runs. The body's final norm still runs, and with it the MTP head's
hidden-state tap (mtp/tap.py), which sees every position's hidden state either way.

The body runs untouched, so every layer's state is bit for bit what the full
call leaves; the head is the same module on the same rows of the same hidden
states, so each row's logits are the full call's at that position up to the
rounding of a product over fewer rows (bit for bit for the shipped target's
tied head on this CPU, within 1e-4 with the same greedy tokens on the tiny
test models: tests/test_head.py). A family is split only where its `Model.__call__`
is exactly the two lines above (`FAMILIES`); any other model, or one whose
head is sharded and gathered (qwen3_5's `sharding_group`), runs its own full
call and the positions are gathered from it.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

# mlx-lm module of the model class -> (attribute path from the model to its text model, the
# object holding `.model`, the body, and the head; whether its forward reads the tie from
# `self.tie_word_embeddings` rather than `self.args`), for the families whose forward is body + head
FAMILIES = {
    "mlx_lm.models.llama": ((), False),
    "mlx_lm.models.qwen2": ((), False),
    "mlx_lm.models.qwen3": ((), False),
    "mlx_lm.models.qwen3_next": ((), False),
    "mlx_lm.models.gemma3_text": ((), True),
    "mlx_lm.models.qwen3_5": (("language_model",), False),
}


def split(model) -> Optional[tuple[Callable, Callable]]:
    """(body, head) of `model`: body(inputs, cache) -> hidden [B, S, H], head(hidden) -> logits;
    None where the model's forward is not known to be exactly body then head."""
    family = FAMILIES.get(type(model).__module__)
    if family is None or type(model).__name__ != "Model":
        return None
    path, own_tie = family
    text = model
    for name in path:
        text = getattr(text, name, None)
    body = getattr(text, "model", None)
    if body is None or getattr(text, "sharding_group", None) is not None:
        return None
    tied = getattr(text if own_tie else getattr(text, "args", None), "tie_word_embeddings", None)
    if tied is None:
        return None
    head = body.embed_tokens.as_linear if tied else getattr(text, "lm_head", None)
    if head is None:
        return None
    return (lambda inputs, cache: body(inputs, cache)), head


class Head:
    """A model's forward with the head at chosen positions only (the full call where unknown)."""

    def __init__(self, model):
        self.model = model
        self.parts = split(model)

    def rows_logits(self, inputs: mx.array, cache, positions) -> mx.array:
        """One forward of `inputs` [B, S]; returns the logits [B, V] of row i at `positions[i]`
        (the model's own call's, where it is not split)."""
        rows = mx.arange(inputs.shape[0])
        at = mx.array(list(positions))
        if self.parts is None:
            return self.model(inputs, cache=cache)[rows, at]
        body, head = self.parts
        return head(body(inputs, cache)[rows, at])


def last_logits(model, inputs: mx.array, cache) -> mx.array:
    """One forward of `inputs` [B, S]; returns the logits [B, 1, V] of the last position only
    (the model's own call's, sliced, where it is not split)."""
    parts = split(model)
    if parts is None:
        return model(inputs, cache=cache)[:, -1:]
    body, head = parts
    return head(body(inputs, cache)[:, -1:])
