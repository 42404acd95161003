"""Samplers that expose their distribution, and exact speculative sampling.

Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023): a token
d drafted from q is accepted with probability min(1, p(d) / q(d)); at the
first rejection the token is drawn from the residual max(0, p - q),
normalized; if every draft is accepted the next token is drawn from the
target's last row. Each emitted token is then distributed exactly as the
target's p. Prompt lookup drafts deterministically: q is a point mass, so a
draft d is accepted with probability p(d) and the residual is p without d.

mlx-lm's samplers are opaque functions of logprobs. With those (and with
greedy decoding) generation uses the match rule instead: sample the target's
token at every position and accept a draft while it equals that sample.
The match rule is exact too (every emitted token is the target's own sample),
it only accepts less often (sum p*q instead of sum min(p, q)).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


class Sampler:
    """Temperature sampling (optionally top-k / top-p / min-p) with a visible distribution.

    Callable like an mlx-lm sampler (logprobs [..., V] -> tokens [...]), and
    `probs(logprobs)` gives the distribution it samples from, which exact
    speculative sampling needs for both the target and the draft.

    Args:
        temp: temperature, > 0.
        top_p: keep the smallest set of tokens with this much mass (0 = off).
        top_k: keep the k most likely tokens (0 = off).
        min_p: keep tokens with at least min_p times the top probability (0 = off).
    """

    def __init__(self, temp: float, *, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0):
        if not temp > 0:
            raise ValueError(f"temp must be > 0 for a Sampler (use sampler=None for greedy), got {temp}")
        self.temp = float(temp)
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p

    def logits(self, logprobs: mx.array) -> mx.array:
        """The filtered, temperature-scaled logits the sampler draws from."""
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        return logprobs.astype(mx.float32) * (1.0 / self.temp)

    def probs(self, logprobs: mx.array) -> mx.array:
        """The sampling distribution (float32, rows sum to 1)."""
        return mx.softmax(self.logits(logprobs), axis=-1)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(self.logits(logprobs))

    def __repr__(self) -> str:
        return f"Sampler(temp={self.temp}, top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p})"


def make_sampler(temp: float = 0.0, *, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0):
    """A `Sampler`, or None (greedy) when temp is 0."""
    if temp == 0:
        return None
    return Sampler(temp, top_p=top_p, top_k=top_k, min_p=min_p)


def match_accept(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Drafts accepted by the match rule: the length of the common prefix.

    Args:
        drafts: d_1..d_K.
        targets: the target's tokens t_0..t_K, t_i chosen after d_1..d_i.
    """
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def speculative_accept(p: mx.array, q: mx.array | None, drafts: Sequence[int], rng=None) -> tuple[int, int]:
    """Exact speculative sampling of one round.

    Args:
        p: target distributions, [K+1, V]; row i follows d_1..d_i.
        q: draft distributions the drafts were sampled from, [K, V]; None for
            a point mass at each draft (prompt lookup).
        drafts: d_1..d_K.
        rng: an `acceptors.Rng` to draw from (its `next()` keys); None: mlx's global state.

    Returns:
        (n, token): n drafts accepted, then `token` drawn from the residual at
        position n (or from p[K] when all K were accepted).
    """
    k = len(drafts)
    if p.shape[0] != k + 1:
        raise ValueError(f"p has {p.shape[0]} rows for {k} drafts; expected {k + 1}")
    p = p.astype(mx.float32)
    n = k
    if k:
        idx = mx.array(list(drafts), dtype=mx.uint32)
        rows = mx.arange(k)
        p_d = p[rows, idx]
        q_d = mx.ones_like(p_d) if q is None else q.astype(mx.float32)[rows, idx]
        u = mx.random.uniform(shape=(k,), key=None if rng is None else rng.next())
        # u < min(1, p/q)  <=>  u * q < p, for q > 0 (d was drawn from q).
        accepted = (u * q_d < p_d).tolist()
        n = accepted.index(False) if False in accepted else k
    if n == k:
        dist = p[k]
    else:
        draft_q = mx.zeros_like(p[n]).at[drafts[n]].add(1.0) if q is None else q[n].astype(mx.float32)
        dist = mx.maximum(p[n] - draft_q, 0.0)
        # All-zero only when p == q on the support, where rejection has probability 0;
        # guard against it from float rounding all the same.
        if dist.sum().item() <= 0:
            dist = p[n]
    token = mx.random.categorical(mx.log(dist), key=None if rng is None else rng.next()).item()
    return n, token
