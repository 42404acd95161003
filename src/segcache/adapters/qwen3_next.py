"""Adapter for mlx-lm's qwen3_next Gated DeltaNet (fused qkvz / ba projections)."""

import mlx.core as mx
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

MODULE = Qwen3NextGatedDeltaNet


def project(module, inputs):
    """(qkv rows, z, b, a) exactly as the mlx-lm module derives them."""
    B, S, _ = inputs.shape
    q, k, v, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(inputs), module.in_proj_ba(inputs)
    )
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    return qkv, z, b, a
