"""Tiny random-weight models built from mlx-lm's own model classes.

For tests, benchmarks and the runtime demo: no downloads, deterministic seeds.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

VOCAB = 64

_CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=VOCAB, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=10000.0, partial_rotary_factor=0.5,
        max_position_embeddings=4096, full_attention_interval=2, tie_word_embeddings=False,
    ),
    "qwen3_5": dict(
        model_type="qwen3_5", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, vocab_size=VOCAB,
        max_position_embeddings=4096, full_attention_interval=2, tie_word_embeddings=False,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=VOCAB, sliding_window=8, sliding_window_pattern=3,
        query_pre_attn_scalar=16, max_position_embeddings=4096,
    ),
}

FAMILIES = tuple(_CONFIGS)
HYBRID = ("qwen3_next", "qwen3_5")
LOGIT_GAIN = 4.0  # sharpens random-init logits so greedy choices are well separated


def config(family: str, **overrides) -> dict:
    """The tiny config of `family`, with `overrides` applied."""
    if family not in _CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    return {**_CONFIGS[family], **overrides}


def build(family: str, *, seed: int = 0, dtype=mx.float32, **overrides) -> nn.Module:
    """A tiny `family` model with random weights drawn from `seed`.

    Embedding and output weights are scaled by LOGIT_GAIN so that logits are
    far from uniform and greedy tokens are well separated.
    """
    cfg = config(family, **overrides)
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    sharpened = [
        (name, w * LOGIT_GAIN)
        for name, w in tree_flatten(model.parameters())
        if name.endswith(("embed_tokens.weight", "lm_head.weight"))
    ]
    model.load_weights(sharpened, strict=False)
    model.set_dtype(dtype)
    model.eval()  # as mlx_lm.load leaves it: inference mode (GDN uses its kernel on Metal)
    mx.eval(model.parameters())
    return model
