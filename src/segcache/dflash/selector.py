"""DFlash2's candidate selector: which token a drafted position proposes, given the one before it.

A DFlash drafter proposes the argmax of each position's logits independently. DFlash2's
selector rescores a few candidates per position with a low-rank edge from the previous
draft (the pending token before the first):

    cands[j]  = the selector_top_k tokens of the position's logits
    score[c]  = logit[j, c] + sum over r of pred[prev, r] * proj(h[j])[r] * succ[c, r]
    draft[j]  = argmax over cands[j] of score (sampling: drawn from them), prev = draft[j]

`pred` and `succ` are codebooks [V, rank] (published as `candidate_selector.predecessor_codebook`
and `.successor_codebook`, bare arrays), `proj` the `hidden_projection` of the drafter's final
(normed) hidden state at j. The drafts are a chain, so position j's proposal depends on the
drafts before it; exact speculative sampling allows that (its q is conditional on them).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..processors import normalize
from .config import DFlashConfig


class CandidateSelector(nn.Module):
    """The codebooks and the hidden projection (the published names)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def project(self, hidden: mx.array) -> mx.array:
        """proj(h) [B, J, rank] of the block's final hidden states [B, J, H] (one call per block)."""
        return self.hidden_projection(hidden)

    def rescore(self, logprobs: mx.array, projected: mx.array, previous: mx.array) -> mx.array:
        """Log-probs [B, V] to propose from at one position: its top_k tokens by `logprobs` [B, V] (the
        drafter's, after a row's processors), each scored by its log-prob plus the edge from
        `previous` [B] (the draft before it) through `projected` [B, rank]; every other token -inf.
        A shift of a row's log-probs shifts every score alike, so the argmax and the distribution
        are those of the raw logits' scores."""
        V = logprobs.shape[-1]
        cands = mx.argpartition(logprobs, V - self.top_k, axis=-1)[..., V - self.top_k :]  # [B, k]
        query = self.predecessor_codebook(previous.astype(mx.uint32)) * projected  # [B, rank]
        edges = (self.successor_codebook(cands) @ query[:, :, None])[..., 0]  # [B, k]
        scores = mx.take_along_axis(logprobs, cands, axis=-1) + edges.astype(logprobs.dtype)
        out = mx.full(logprobs.shape, -mx.inf, dtype=logprobs.dtype)
        return normalize(mx.put_along_axis(out, cands, scores, axis=-1))
