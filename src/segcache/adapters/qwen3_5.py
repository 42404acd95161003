"""Adapter for mlx-lm's qwen3_5 Gated DeltaNet (separate qkv / z / b / a projections)."""

from mlx_lm.models.qwen3_5 import GatedDeltaNet

MODULE = GatedDeltaNet


def project(module, inputs):
    """(qkv rows, z, b, a) exactly as the mlx-lm module derives them."""
    B, S, _ = inputs.shape
    qkv = module.in_proj_qkv(inputs)
    z = module.in_proj_z(inputs).reshape(B, S, module.num_v_heads, module.head_v_dim)
    return qkv, z, module.in_proj_b(inputs), module.in_proj_a(inputs)
