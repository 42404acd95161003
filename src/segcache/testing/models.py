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

# Recurrent families beyond Gated DeltaNet (issue 12), kept out of FAMILIES so
# the suites parametrized over FAMILIES do not grow; tests/test_families.py covers them.
_RECURRENT_CONFIGS = {
    "nemotron_h": dict(
        model_type="nemotron_h", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
        ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5,
        use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "-", "*", "M"],
        time_step_limit=(0.0, float("inf")),
    ),
    "granitemoehybrid": dict(
        model_type="granitemoehybrid", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, max_position_embeddings=4096, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=False, embedding_multiplier=1.0,
        attention_multiplier=0.25, logits_scaling=1.0, residual_multiplier=1.0,
        layer_types=["mamba", "attention", "mamba"], rms_norm_eps=1e-5,
        shared_intermediate_size=128, mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False,
        mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True,
        tie_word_embeddings=False,
    ),
    "falcon_h1": dict(
        model_type="falcon_h1", hidden_size=64, head_dim=16, intermediate_size=128,
        mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_expand=1,
        mamba_n_groups=1, mamba_n_heads=4, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "lfm2": dict(
        model_type="lfm2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=128,
        full_attn_idxs=[1], rope_theta=10000.0,
    ),
    "mamba": dict(
        model_type="mamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        state_size=16, num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=8, tie_word_embeddings=False,
    ),
    "jamba": dict(
        model_type="jamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_offset=1, attn_layer_period=2,
        expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4, mamba_d_state=16,
        mamba_expand=2, num_experts=2, num_experts_per_tok=1, rms_norm_eps=1e-6,
        max_position_embeddings=4096, vocab_size=VOCAB, tie_word_embeddings=False,
    ),
    "mamba2": dict(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=64,
        intermediate_size=64, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
        conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
        time_step_limit=(0.0, float("inf")), time_step_rank="auto",
    ),
    "lfm2_moe": dict(
        model_type="lfm2_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, use_expert_bias=True, num_dense_layers=1, norm_eps=1e-5,
        conv_bias=False, conv_L_cache=3, full_attn_idxs=[1], rope_theta=10000.0,
    ),
    "plamo2": dict(
        model_type="plamo2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, hidden_size_per_head=16, max_position_embeddings=4096,
        attention_window_size=4096, mamba_d_state=16, mamba_d_conv=4, mamba_num_heads=4,
        mamba_step=2, mamba_chunk_size=16, intermediate_size=128, vocab_size=VOCAB,
        tie_word_embeddings=False,
    ),
    "kimi_linear": dict(
        model_type="kimi_linear", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-6, model_max_length=4096, num_experts=4,
        moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, mla_use_nope=True, first_k_dense_replace=2,
        linear_attn_config={"kda_layers": [1], "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4},
    ),
    "recurrent_gemma": dict(
        model_type="recurrent_gemma", attention_bias=False, conv1d_width=4, hidden_size=64,
        intermediate_size=128, logits_soft_cap=30.0, num_attention_heads=4, num_key_value_heads=1,
        num_hidden_layers=3, rms_norm_eps=1e-6, rope_theta=10000.0, attention_window_size=8,
        vocab_size=VOCAB, block_types=["recurrent", "recurrent", "attention"],
    ),
    "bailing_moe_linear": dict(
        model_type="bailing_moe_linear", hidden_size=64, intermediate_size=128,
        max_position_embeddings=4096, moe_intermediate_size=32, num_experts=4,
        num_shared_experts=1, norm_topk_prob=True, num_attention_heads=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        vocab_size=VOCAB, first_k_dense_replace=2, layer_group_size=2, group_norm_size=1,
        head_dim=16,
    ),
    "rwkv7": dict(
        model_type="rwkv7", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, norm_eps=1e-5,
        head_dim=16, num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
        decay_low_rank_dim=8,
    ),
    "baichuan_m1": dict(
        model_type="baichuan_m1", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
        sliding_window=8, sliding_window_layers=[1], conv_window=2, rms_norm_eps=1e-6,
        num_swa_attention_heads=4, num_swa_key_value_heads=2,
    ),
    "olmo_hybrid": dict(
        model_type="olmo_hybrid", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
        max_position_embeddings=4096, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True, tie_word_embeddings=False, attention_bias=False, head_dim=16,
    ),
    "gear": dict(
        model_type="gear", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, layer_types=["conv_mixer", "sliding_attention", "full_attention"],
        max_position_embeddings=4096, sliding_window=8, conv_L_cache=3, tie_word_embeddings=False,
    ),
    "bailing_hybrid": dict(
        model_type="bailing_hybrid", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=2, layer_group_size=2, group_norm_size=1, vocab_size=VOCAB,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
        routed_scaling_factor=1.0, head_dim=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16,
    ),
    "bailing_moe_v3": dict(
        model_type="bailing_moe_v3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        first_k_dense_replace=2, n_group=1, topk_group=1, layer_group_size=2, head_dim=16,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=4096, rope_theta=10000.0,
    ),
    "kimi_k3": dict(
        model_type="kimi_k3", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        max_position_embeddings=4096, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_token=2,
        moe_intermediate_size=32, first_k_dense_replace=2,
        linear_attn_config={"kda_layers": [1], "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4},
    ),
    "longcat_flash_ngram": dict(
        model_type="longcat_flash_ngram", hidden_size=64, ffn_hidden_size=128, moe_topk=2,
        expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=1, num_layers=2,
        vocab_size=VOCAB, max_position_embeddings=4096, num_attention_heads=4, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        routed_scaling_factor=1.0, rms_norm_eps=1e-6, rope_theta=10000.0, mla_scale_q_lora=True,
        mla_scale_kv_lora=True, ngram_vocab_size_ratio=2,
    ),
}

FAMILIES = tuple(_CONFIGS)
RECURRENT = tuple(_RECURRENT_CONFIGS)  # SSM / short-conv families (tests/test_families.py)
HYBRID = ("qwen3_next", "qwen3_5")
LOGIT_GAIN = 4.0  # sharpens random-init logits so greedy choices are well separated


def config(family: str, **overrides) -> dict:
    """The tiny config of `family`, with `overrides` applied."""
    configs = {**_CONFIGS, **_RECURRENT_CONFIGS}
    if family not in configs:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES + RECURRENT}")
    return {**configs[family], **overrides}


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
    if family in _RECURRENT_CONFIGS:
        # Several of these modules initialise parameters to zeros (token-shift
        # mixes, conv taps, gate weights), which would make their state
        # irrelevant to the output and the tests blind to it: draw them too.
        sharpened += [
            (name, 0.3 * mx.random.normal(w.shape, dtype=w.dtype))
            for name, w in tree_flatten(model.parameters())
            if w.size and not mx.any(w).item()
        ]
    model.load_weights(sharpened, strict=False)
    model.set_dtype(dtype)
    model.eval()  # as mlx_lm.load leaves it: inference mode (GDN uses its kernel on Metal)
    mx.eval(model.parameters())
    return model
