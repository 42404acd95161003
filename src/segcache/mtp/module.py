"""The multi-token-prediction module of Qwen3-Next / Qwen3.5 checkpoints, in MLX.

Structure and parameter names follow the published checkpoints (their ``mtp.*``
tensors, without the ``mtp.`` prefix) and vLLM's ``qwen3_next_mtp`` /
``qwen3_5_mtp``::

    e  = pre_fc_norm_embedding(embed_tokens(x[t+1]))      the next token
    h  = pre_fc_norm_hidden(hidden[t])                    the target's last hidden state
    z  = fc(concat([e, h]))                               [2H] -> [H]
    z  = layers[d](z)                                     one full-attention decoder layer
    h' = norm(z)                                          fed back at the next depth
    logits = lm_head(h')                                  the target's own output head

``embed_tokens`` and ``lm_head`` are the target's (shared, not stored with the
head). ``hidden[t]`` is the target's final hidden state *after* its final norm,
the tensor its ``lm_head`` scores (see docs/mtp.md for why). The decoder layer is
mlx-lm's own layer class of the target's family, built as a full-attention
layer, so its attention (gated, q/k norms, partial rotary) and MLP or MoE are
exactly the target's.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer
from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

from ..errors import UnsupportedModelError
from ..store.identity import weights_fingerprint


class MTPModule(nn.Module):
    """The head's own parameters: the pre-fc norms, ``fc``, its decoder layer(s), ``norm``.

    Args:
        hidden_size: The target's hidden size.
        eps: RMS-norm epsilon (the target's ``rms_norm_eps``).
        layers: The decoder layers (usually one), built by the family's factory.
    """

    def __init__(self, hidden_size: int, eps: float, layers: list[nn.Module]):
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, layer: int = 0,
                 cache: Optional[Any] = None) -> mx.array:
        """The head's hidden state after layer ``layer`` and the final norm, [B, L, H]."""
        return self.run_layer(self.combine(embedded, hidden), layer, cache)

    def combine(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        """The decoder layer's input: ``fc`` of the normed embedding and hidden state, [B, L, H]."""
        return self.fc(mx.concatenate(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1))

    def run_layer(self, z: mx.array, layer: int = 0, cache: Optional[Any] = None) -> mx.array:
        """Layer ``layer`` on its input ``z`` (its K/V appended to ``cache``), then the final norm."""
        z = self.layers[layer](z, create_attention_mask(z, cache), cache)
        return self.norm(z)


def _qwen3_5_layer(args) -> nn.Module:
    layer = DecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    assert not layer.is_linear
    return layer


def _qwen3_next_layer(args) -> nn.Module:
    # The checkpoints' MTP layer has the routed MLP whenever the model has experts
    # (vLLM builds it as layer 0 of the sparse schedule); mlx-lm decides from
    # layer_idx, so pick the first full-attention index that gets the same MLP.
    want_moe = args.num_experts > 0
    for idx in range(args.full_attention_interval - 1, 64 * args.full_attention_interval,
                     args.full_attention_interval):
        moe = idx not in args.mlp_only_layers and args.num_experts > 0 and \
            (idx + 1) % args.decoder_sparse_step == 0
        if moe == want_moe:
            return Qwen3NextDecoderLayer(args, layer_idx=idx)
    raise UnsupportedModelError("qwen3_next: no full-attention layer index with the MTP "
                                "layer's MLP kind; check decoder_sparse_step / mlp_only_layers")


def _text_parts(model: nn.Module):
    """(args, inner text model, output projection, MTP layer factory) of a supported target."""
    kind = getattr(model, "model_type", None)
    if kind in ("qwen3_5", "qwen3_5_moe"):
        lm = model.language_model if hasattr(model, "language_model") else model
        return lm.args, lm.model, _projection(lm), _qwen3_5_layer
    if kind == "qwen3_next":
        return model.args, model.model, _projection(model), _qwen3_next_layer
    raise UnsupportedModelError(
        f"no MTP head for model_type {kind!r}; segcache knows the heads of qwen3_5, "
        "qwen3_5_moe and qwen3_next checkpoints")


def _projection(lm: nn.Module) -> Callable[[mx.array], mx.array]:
    """The output projection exactly as the text model's ``__call__`` applies it."""
    if getattr(lm, "sharding_group", None) is not None:
        raise UnsupportedModelError("MTP on a tensor-parallel (sharded lm_head) model is not "
                                    "supported yet; load the model on one rank")
    if lm.args.tie_word_embeddings:
        return lm.model.embed_tokens.as_linear
    return lm.lm_head


def num_mtp_layers(config: dict) -> int:
    """The head's decoder layers, from a checkpoint's (text) config: 0 when it has none."""
    for source in (config.get("text_config", {}), config):
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            if key in source:
                return int(source[key])
    return 0


class MTPHead:
    """An MTP module bound to its target: what a drafter calls.

    ``head(hidden, tokens, cache)`` takes the target's hidden states ``[B, L, H]``
    (post final norm, as :func:`segcache.mtp.forward_with_hidden` returns them) and
    the tokens that follow each of them ``[B, L]``, and returns the logits for the
    token after those ``[B, L, V]`` and the head's own hidden states ``[B, L, H]``,
    which the next depth takes in place of the target's (with the drafted token).
    Position ``t`` of the head's cache holds the pair (hidden at ``t``, token
    ``t+1``): fill it during prefill with ``head(hidden[:, :-1], prompt[:, 1:],
    cache)``; a cache is any mlx-lm KV cache (``make_cache`` gives one per layer).

    Args:
        module: The head's parameters (:class:`MTPModule`).
        model: The target (an mlx-lm model of a supported family); its embedding and
            output head are used, never copied.
    """

    def __init__(self, module: MTPModule, model: nn.Module):
        args, text_model, projection, _ = _text_parts(model)
        self.module = module
        self.model = model
        self.args = args
        self._embed = text_model.embed_tokens
        self._project = projection
        self._drafting: "MTPHead | None" = None  # for_drafting's copy, made once
        self._identity: bytes | None = None  # `identity`, computed once

    @classmethod
    def build(cls, model: nn.Module, num_layers: int = 1) -> "MTPHead":
        """A head with fresh (untrained) parameters for ``model``'s family and size."""
        args, _, _, factory = _text_parts(model)
        module = MTPModule(args.hidden_size, args.rms_norm_eps,
                           [factory(args) for _ in range(num_layers)])
        return cls(module, model)

    def for_drafting(self) -> "MTPHead":
        """The head a drafter runs: this one, or a float32 copy when the target computes in float32
        and the head's weights are a narrower float (a float16 file). The copy drafts bit for bit
        the same (the products promote to float32 anyway, tested), without converting the weights
        at every call (1.5-1.7x the head's cost on a CPU). Quantized heads run as they are."""
        if self._drafting is not None:
            return self._drafting
        self._drafting = self._drafting_copy()
        return self._drafting

    @property
    def identity(self) -> bytes:
        """What names the head in the prefix store (its drafter records): its layer count and its
        weights' fingerprint, so another head is a miss. Computed once (a head's weights are fixed
        once it drafts; `load_head` computes its drafting copy's at load)."""
        if self._identity is None:
            h = hashlib.blake2b(digest_size=32, person=b"segcache.mtp.1")
            h.update(f"mtp|layers={self.num_layers}|".encode())
            h.update(weights_fingerprint(self.module))
            self._identity = h.digest()
        return self._identity

    def _drafting_copy(self) -> "MTPHead":
        params = tree_flatten(self.module.parameters())
        if self._embed.weight.dtype != mx.float32 or any(not mx.issubdtype(v.dtype, mx.floating) for _, v in params) \
                or all(v.dtype == mx.float32 for _, v in params):
            return self
        copy = MTPHead.build(self.model, self.num_layers)
        copy.module.load_weights([(k, v.astype(mx.float32)) for k, v in params], strict=True)
        copy.module.eval()
        mx.eval(copy.module.parameters())
        return copy

    @property
    def num_layers(self) -> int:
        return len(self.module.layers)

    def make_cache(self) -> list[KVCache]:
        """One KV cache per decoder layer of the head (mlx-lm's own ``KVCache``)."""
        return [KVCache() for _ in range(self.num_layers)]

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: Optional[list] = None,
                 depth: int = 0) -> tuple[mx.array, mx.array]:
        """Logits for the token after ``tokens`` and the head's hidden states.

        Args:
            hidden: ``[B, L, H]``: the target's hidden states (depth 0) or the head's
                own from the previous depth.
            tokens: ``[B, L]``: the token following each hidden state.
            cache: The head's caches (``make_cache()``), or None for no context.
            depth: Draft depth; a head with several layers uses layer ``depth % n``
                (as vLLM does), a one-layer head applies its layer at every depth.

        Returns:
            ``(logits [B, L, V], hidden [B, L, H])``.
        """
        layer = depth % self.num_layers
        c = cache[layer] if cache is not None else None
        h = self.module(self._embed(tokens), hidden, layer, c)
        return self._project(h), h

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's embedding of ``tokens`` (what the head's first input is)."""
        return self._embed(tokens)

    def project(self, h: mx.array) -> mx.array:
        """Logits of the head's states ``h`` (the target's output head), e.g. of the positions a
        drafter reads only."""
        return self._project(h)
