"""The DFlash block drafter: a small non-causal decoder stack on the target's hidden states.

    ctx[p]  = hidden_norm(fc(concat(target layer outputs at position p)))       [H], p < n
    K/V     = per drafter layer: k_norm(k_proj(ctx)) with rotary position p, v_proj(ctx)   (cached)
    block   = [last verified token, mask, ..., mask] at positions n .. n+B-1
    x       = embed(block) * embed_scale                                       the target's embedding
    x      += attn(input_layernorm(x)) over [context K/V | the block's own K/V]   no causal mask
    x      += mlp(post_attention_layernorm(x))                                 every drafter layer
    drafts  = argmax lm_head(norm(x[:, 1:]))                                   the target's output head

A DFlash2 drafter (`architectures: ["DFlash2DraftModel"]`) wraps each layer's attention and
MLP in grouped dynamic causal convolutions over the block (conv.py: `ConvLayer` here) and
proposes through a candidate selector (selector.py) instead of each position's argmax; its
context K/V are a DFlash drafter's.

The drafter owns no embedding or output head; `Drafter` binds its `DFlashModule` (its own
weights only, the names of the published checkpoints) to a target. Context K/V of all
drafter layers live in one array [B, layers * kv_heads, n, head_dim] (layer i's heads at
i*kv_heads ...), so one KV cache holds the drafter's whole context.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import UnsupportedModelError
from .config import DFlashConfig
from .conv import GroupedDynamicCausalConv
from .selector import CandidateSelector


class Attention(nn.Module):
    """Queries from the block; keys and values from the context (cached) and the block."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        d, self.heads, self.kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, cfg.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)

    def keys_values(self, x: mx.array, rope, offset) -> tuple[mx.array, mx.array]:
        """K/V [B, kv_heads, S, D] of inputs `x` [B, S, H] at positions offset.. (int or [B])."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, S, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, S, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(self, x, ctx_k, ctx_v, rope, offset, mask):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=offset)
        k, v = self.keys_values(x, rope, offset)
        if ctx_k is not None:
            k, v = mx.concatenate([ctx_k, k], axis=2), mx.concatenate([ctx_v, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx_k, ctx_v, rope, offset, mask):
        h = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, rope, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class ConvLayer(Layer):
    """A DFlash2 layer: each sublayer's input convolved before it and its output after it, with
    taps computed from that input (conv.py)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__(cfg)
        k, g = cfg.conv_kernel_size, cfg.conv_group_size
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, k, g)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, k, g)

    def __call__(self, x, ctx_k, ctx_v, rope, offset, mask):
        y, taps = self.attention_conv.before(self.input_layernorm(x))
        h = x + self.attention_conv.after(self.self_attn(y, ctx_k, ctx_v, rope, offset, mask), taps)
        y, taps = self.mlp_conv.before(self.post_attention_layernorm(h))
        return h + self.mlp_conv.after(self.mlp(y), taps)


class DFlashModule(nn.Module):
    """The drafter's own parameters, named as the published checkpoints name them (DFlash2's
    codebooks are `candidate_selector.*_codebook.weight` here, bare in a checkpoint: load.py)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.context_width, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        layer = ConvLayer if cfg.dflash2 else Layer
        self.layers = [layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.dflash2:
            self.candidate_selector = CandidateSelector(cfg)


def _target_parts(model: nn.Module):
    """(inner text model holding embed_tokens and layers, its output projection, embed scale)."""
    outer = model.language_model if "language_model" in model else model
    inner = outer.model if "model" in outer and "embed_tokens" in outer.model else outer
    if "embed_tokens" not in inner or "layers" not in inner:
        raise UnsupportedModelError(f"{type(model).__name__}: no embed_tokens and layers found for a DFlash "
                                    "drafter to share")
    if getattr(outer, "sharding_group", None) is not None:
        raise UnsupportedModelError("DFlash on a tensor-parallel (sharded lm_head) model is not supported yet")
    head = outer["lm_head"] if "lm_head" in outer else inner.embed_tokens.as_linear
    scale = getattr(inner, "embed_scale", 1.0)
    return inner, head, scale


class Drafter:
    """A `DFlashModule` bound to its target: the target's embedding and output head, the rotary
    embedding of the drafter's config.

    Args:
        module: the drafter's weights.
        cfg: its configuration.
        target: the mlx-lm model it drafts for (hidden size and vocabulary must match).

    Raises:
        UnsupportedModelError: the target's hidden size, vocabulary or layer count does not fit.
    """

    def __init__(self, module: DFlashModule, cfg: DFlashConfig, target: nn.Module):
        inner, head, scale = _target_parts(target)
        width = inner.embed_tokens.weight.shape[0]
        hidden = _hidden_size(target, inner)
        if hidden != cfg.hidden_size:
            raise UnsupportedModelError(f"DFlash drafter of hidden size {cfg.hidden_size} for a target of "
                                        f"hidden size {hidden}; use the drafter trained for this target")
        if width != cfg.vocab_size:
            raise UnsupportedModelError(f"DFlash drafter of vocabulary {cfg.vocab_size} for a target of "
                                        f"vocabulary {width}; use the drafter trained for this target")
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < len(inner.layers)]
        if bad:
            raise UnsupportedModelError(f"DFlash target_layer_ids {bad} outside the target's "
                                        f"{len(inner.layers)} layers")
        self.module, self.cfg, self.model = module, cfg, target
        self.embed: Callable = inner.embed_tokens
        self.head: Callable = head
        self.embed_scale = scale * cfg.input_embedding_scale
        self.rope = initialize_rope(cfg.head_dim, cfg.rope_theta, False, cfg.rope_scaling,
                                    cfg.max_position_embeddings)
        self.kv_heads = cfg.num_key_value_heads
        self.num_layers = cfg.num_hidden_layers
        # DFlash2's candidate selector (None: each position proposes from its own logits)
        self.selector: CandidateSelector | None = module["candidate_selector"] if cfg.dflash2 else None

    def context(self, target_hidden: mx.array) -> mx.array:
        """ctx [B, S, H] of the tapped target layers' outputs concatenated, [B, S, m*H]."""
        m = self.module
        return m.hidden_norm(m.fc(target_hidden))

    def context_kv(self, ctx: mx.array, offset) -> tuple[mx.array, mx.array]:
        """Every drafter layer's K/V of `ctx` [B, S, H] at positions offset.. (int or [B]):
        [B, layers * kv_heads, S, D] each."""
        ks, vs = [], []
        for layer in self.module.layers:
            k, v = layer.self_attn.keys_values(ctx, self.rope, offset)
            ks.append(k)
            vs.append(v)
        if len(ks) == 1:
            return ks[0], vs[0]
        return mx.concatenate(ks, axis=1), mx.concatenate(vs, axis=1)

    def block(self, tokens: mx.array, keys: mx.array | None, values: mx.array | None, offset,
              mask: mx.array | None = None) -> mx.array:
        """Logits [B, L-1, V] of the block's positions 1.. (`tokens` [B, L]: the last verified
        token, then masks, at positions offset.. (int or [B])), over context `keys`/`values`
        ([B, layers*kv_heads, C, D] or None) and the block itself; `mask`: [B, 1, 1, C + L] or
        [B, 1, L, C + L] booleans (padded context rows False), or None (all attended)."""
        return self.logits(self.block_states(tokens, keys, values, offset, mask))

    def block_states(self, tokens: mx.array, keys: mx.array | None, values: mx.array | None, offset,
                     mask: mx.array | None = None) -> mx.array:
        """The final (normed) hidden states [B, L-1, H] of the block's positions 1.. (as `block`), what
        the output head and DFlash2's selector read."""
        x = self.embed(tokens)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        kh = self.kv_heads
        for i, layer in enumerate(self.module.layers):
            ck = None if keys is None else keys[:, i * kh : (i + 1) * kh]
            cv = None if values is None else values[:, i * kh : (i + 1) * kh]
            x = layer(x, ck, cv, self.rope, offset, mask)
        return self.module.norm(x[:, 1:])

    def logits(self, h: mx.array) -> mx.array:
        out = self.head(h)
        if self.cfg.output_multiplier != 1.0:
            out = out * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            out = mx.tanh(out / cap) * cap
        return out


def _hidden_size(target: nn.Module, inner: nn.Module) -> int:
    args = getattr(target, "args", None)
    size = getattr(args, "hidden_size", None)
    if size is None:
        size = getattr(getattr(target, "language_model", None), "args", None)
        size = getattr(size, "hidden_size", None)
    return int(size) if size is not None else int(inner.embed_tokens.weight.shape[1])
