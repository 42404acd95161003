"""Per-position loss terms of the distillation stages (student toward a frozen teacher)."""

from __future__ import annotations

import mlx.core as mx


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities, in float32."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def kl(t_logp: mx.array, s_logp: mx.array) -> mx.array:
    """Per position: KL(teacher || student) from both log-probabilities."""
    return (mx.exp(t_logp) * (t_logp - s_logp)).sum(axis=-1)


def cross_entropy(s_logp: mx.array, labels: mx.array) -> mx.array:
    """Per position: the student's cross-entropy on ``labels``."""
    return -mx.take_along_axis(s_logp, labels[..., None], axis=-1)[..., 0]
