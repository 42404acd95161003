"""Samplers that expose their distribution, per-request random keys, and exact
speculative sampling.

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

Randomness is per request: a `Keys` stream replaces mlx's global generator.
`Keys(seed)` yields the keys `mx.random.seed(seed)` would hand out, in the
same order, so `Sampler.sample` with it draws what mlx-lm's sampler draws
after `mx.random.seed(seed)`, bit for bit, and no request's draws depend on
another's.
"""

from __future__ import annotations

import secrets
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import ParamError

# mlx_lm.server's default xtc_threshold (a request that sets only xtc_probability).
XTC_THRESHOLD = 0.1


class Keys:
    """One request's random stream: the keys `mx.random.seed(seed)` would yield.

    mlx's global generator holds a key k and hands out k' where
    (k, k') = split(k); this does the same on a key of its own, so draws with
    these keys equal draws after `mx.random.seed(seed)`, and never touch (or
    depend on) the global state.

    Args:
        seed: an integer seed; None for a fresh random one.
    """

    def __init__(self, seed: Optional[int] = None):
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self._key = mx.random.key(self.seed)

    def next(self) -> mx.array:
        """The next key (unevaluated)."""
        pair = mx.random.split(self._key)
        self._key = pair[0]
        return pair[1]

    def copy(self) -> "Keys":
        """An independent stream at this one's position (the same keys next, neither moves the other)."""
        other = Keys.__new__(Keys)
        other.seed, other._key = self.seed, self._key
        return other

    def spawn(self, index: int) -> "Keys":
        """The stream of choice `index` of a request with n choices.

        Choice 0 is this stream's seed itself (so n=1 draws what a plain
        request with the same seed draws); choice i > 0 a stream seeded from
        (seed, i), reproducible across runs.
        """
        if index < 0:
            raise ValueError(f"a choice index is >= 0, got {index}")
        if index == 0:
            return Keys(self.seed)
        return Keys((self.seed * 1_000_003 + index) % (1 << 63))

    def __repr__(self) -> str:
        return f"Keys(seed={self.seed})"


def _check_probability(name: str, value: float, hi: float = 1.0) -> None:
    if not 0.0 <= value <= hi:
        raise ParamError(name, f"{name} must be in [0, {hi}], got {value}")


class Sampler:
    """Temperature sampling with mlx-lm's filters, and the distribution it draws from.

    The filters run in mlx-lm's `make_sampler` order: top-p, min-p, XTC, top-k,
    then temperature. `sample` draws exactly what mlx-lm's sampler draws for the
    same keys; `probs` is the distribution of that draw, which exact
    speculative sampling needs for the target and for a sampling draft.

    Args:
        temp: temperature, > 0.
        top_p: keep the smallest set of tokens with this much mass (0 or 1 = off).
        top_k: keep the k most likely tokens (0 = off).
        min_p: keep tokens with at least min_p times the top probability (0 = off).
        min_tokens_to_keep: tokens min-p never removes.
        xtc_probability: chance that XTC ("exclude top choices") applies at a
            position (0 = off).
        xtc_threshold: XTC removes every token above this probability but the
            least likely of them, in [0, 0.5].
        xtc_special_tokens: tokens XTC never removes (mlx_lm.server passes the
            encoding of "\\n" and the EOS tokens).
    """

    def __init__(self, temp: float, *, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0,
                 min_tokens_to_keep: int = 1, xtc_probability: float = 0.0,
                 xtc_threshold: float = XTC_THRESHOLD, xtc_special_tokens: Sequence[int] = ()):
        if not temp > 0:
            raise ParamError("temperature", f"temp must be > 0 for a Sampler (use sampler=None for greedy), got {temp}")
        _check_probability("top_p", top_p)
        _check_probability("min_p", min_p)
        _check_probability("xtc_probability", xtc_probability)
        _check_probability("xtc_threshold", xtc_threshold, 0.5)
        if top_k < 0:
            raise ParamError("top_k", f"top_k must be >= 0 (0 = off), got {top_k}")
        if min_tokens_to_keep < 1:
            raise ParamError("min_tokens_to_keep", f"min_tokens_to_keep must be >= 1, got {min_tokens_to_keep}")
        self.temp = float(temp)
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.min_tokens_to_keep = min_tokens_to_keep
        self.xtc_probability = xtc_probability
        self.xtc_threshold = xtc_threshold
        self.xtc_special_tokens = [int(t) for t in xtc_special_tokens]

    @property
    def xtc(self) -> bool:
        return self.xtc_probability > 0

    def _filter(self, logprobs: mx.array, xtc: bool) -> mx.array:
        """mlx-lm's chain: top-p, min-p, the XTC mask when `xtc`, top-k."""
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if xtc:
            logprobs = mx.where(self._xtc_mask(logprobs), -mx.inf, logprobs)
        # mlx-lm raises for top_k >= V; keeping every token is what that asks for.
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def _xtc_mask(self, logprobs: mx.array) -> mx.array:
        """The tokens XTC removes: every one above the threshold but the least likely of those."""
        probs = mx.softmax(logprobs, -1)
        mask = probs > mx.where(probs > self.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
        if self.xtc_special_tokens:
            mask[..., self.xtc_special_tokens] = False
        return mask

    def logits(self, logprobs: mx.array) -> mx.array:
        """The filtered, temperature-scaled logits drawn from when XTC does not apply."""
        return self._filter(logprobs, False).astype(mx.float32) * (1.0 / self.temp)

    def probs(self, logprobs: mx.array) -> mx.array:
        """The sampling distribution (float32, rows sum to 1).

        With XTC it is the mixture of the two branches: the XTC mask applies
        with probability `xtc_probability`.
        """
        p = mx.softmax(self.logits(logprobs), axis=-1)
        if not self.xtc:
            return p
        masked = self._filter(logprobs, True).astype(mx.float32) * (1.0 / self.temp)
        x = self.xtc_probability
        return (1.0 - x) * p + x * mx.softmax(masked, axis=-1)

    def sample(self, logprobs: mx.array, keys: Keys) -> mx.array:
        """Tokens [...] from logprobs [..., V], unevaluated: mlx-lm's sampler's draw
        for the same keys (an XTC coin, then the categorical draw)."""
        if self.xtc:
            coin = mx.random.uniform(0, 1, key=keys.next())
            # One coin for all rows, as mlx-lm's sampler on a batch.
            logprobs = mx.where(coin > self.xtc_probability, self._filter(logprobs, False),
                                self._filter(logprobs, True))
        else:
            logprobs = self._filter(logprobs, False)
        if logprobs.ndim == 1:
            # mlx-lm draws for a [1, V] row; mx.random.categorical's noise for a [V] vector
            # differs under the same key, so a row is drawn as a batch of one
            return mx.random.categorical(logprobs[None] * (1.0 / self.temp), key=keys.next())[0]
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=keys.next())

    def sample_positions(self, logprobs: mx.array, keys: Keys) -> tuple[mx.array, list]:
        """The draw `sample` would make at each of a verify's positions [K+1, V] in turn, as if the
        tokens before it had been emitted: tokens [K+1] (unevaluated), and the stream after each
        position (`keys` does not move; the caller keeps the one after the last position it emits)."""
        stream = keys.copy()
        plain = self._filter(logprobs, False)
        masked = self._filter(logprobs, True) if self.xtc else None
        tokens, after = [], []
        for j in range(logprobs.shape[0]):
            row = plain[j : j + 1]  # [1, V]: drawn as `sample` draws a row
            if masked is not None:
                coin = mx.random.uniform(0, 1, key=stream.next())
                row = mx.where(coin > self.xtc_probability, row, masked[j : j + 1])
            tokens.append(mx.random.categorical(row * (1.0 / self.temp), key=stream.next())[0])
            after.append(stream.copy())
        return mx.stack(tokens), after

    def sample_tree(self, logprobs: mx.array, depths, keys: Keys) -> tuple[mx.array, list]:
        """`sample_positions` over a tree's verify [N, V]: node i drawn as at position depths[i] (with
        the stream after depths[i] positions), so the draws along any root path are the draws
        `sample_positions` makes over that path's chain; tokens [N] (unevaluated), and the stream
        after each depth. `keys` does not move."""
        plain = self._filter(logprobs, False)
        masked = self._filter(logprobs, True) if self.xtc else None
        streams = [keys.copy()]  # streams[d]: the stream before position d
        for _ in range(max(depths) + 1):
            stream = streams[-1].copy()
            for _ in range(2 if masked is not None else 1):
                stream.next()
            streams.append(stream)
        tokens = []
        for i, d in enumerate(depths):
            stream = streams[d].copy()
            row = plain[i : i + 1]
            if masked is not None:
                coin = mx.random.uniform(0, 1, key=stream.next())
                row = mx.where(coin > self.xtc_probability, row, masked[i : i + 1])
            tokens.append(mx.random.categorical(row * (1.0 / self.temp), key=stream.next())[0])
        return mx.stack(tokens), streams[1:]

    def draw(self, logprobs: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
        """A draft's token and the distribution q it was drawn from (for a drafter).

        The token is drawn from q itself, so the q the acceptor divides by is,
        by construction, the one the draft was sampled from.
        """
        q = self.probs(logprobs)
        return mx.random.categorical(mx.log(q), key=key), q

    def __call__(self, logprobs: mx.array) -> mx.array:
        # The mlx-lm sampler protocol: draws from mlx's global generator.
        if self.xtc:
            use = mx.random.uniform(0, 1) > self.xtc_probability
            logprobs = mx.where(use, self._filter(logprobs, False), self._filter(logprobs, True))
        else:
            logprobs = self._filter(logprobs, False)
        return mx.random.categorical(logprobs * (1.0 / self.temp))

    def __repr__(self) -> str:
        extra = ""
        if self.xtc:
            extra = f", xtc_probability={self.xtc_probability}, xtc_threshold={self.xtc_threshold}"
        return f"Sampler(temp={self.temp}, top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}{extra})"


def make_sampler(temp: float = 0.0, *, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0,
                 min_tokens_to_keep: int = 1, xtc_probability: float = 0.0,
                 xtc_threshold: float = XTC_THRESHOLD, xtc_special_tokens: Sequence[int] = ()):
    """A `Sampler`, or None (greedy) when temp is 0 (as mlx-lm, the filters then do nothing)."""
    if temp == 0:
        return None
    return Sampler(temp, top_p=top_p, top_k=top_k, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
                   xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                   xtc_special_tokens=xtc_special_tokens)


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


def speculative_accept(p: mx.array, q: mx.array | None, drafts: Sequence[int],
                       key: Optional[mx.array] = None) -> tuple[int, int]:
    """Exact speculative sampling of one round.

    Args:
        p: target distributions, [K+1, V]; row i follows d_1..d_i.
        q: draft distributions the drafts were sampled from, [K, V]; None for
            a point mass at each draft (prompt lookup).
        drafts: d_1..d_K.
        key: the round's random key (split here for the acceptance draws and
            the residual draw); None draws from mlx's global generator.

    Returns:
        (n, token): n drafts accepted, then `token` drawn from the residual at
        position n (or from p[K] when all K were accepted).
    """
    k = len(drafts)
    if p.shape[0] != k + 1:
        raise ValueError(f"p has {p.shape[0]} rows for {k} drafts; expected {k + 1}")
    k_accept = k_token = None
    if key is not None:
        k_accept, k_token = mx.random.split(key)
    p = p.astype(mx.float32)
    n = k
    if k:
        idx = mx.array(list(drafts), dtype=mx.uint32)
        rows = mx.arange(k)
        p_d = p[rows, idx]
        q_d = mx.ones_like(p_d) if q is None else q.astype(mx.float32)[rows, idx]
        u = mx.random.uniform(shape=(k,), key=k_accept)
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
    token = mx.random.categorical(mx.log(dist)[None], key=k_token).item()  # a [1, V] row, as `Sampler.sample`
    return n, token


def tree_speculative_accept(p: mx.array, parents: Sequence[int], tokens: Sequence[int],
                            key: Optional[mx.array] = None) -> tuple[list[int], int]:
    """Exact speculative sampling of one tree round of point-mass drafts (prompt lookup's).

    From the root, the children of the current node are tried in order, each once:
    child c (token t) is accepted with probability r(t), r the residual of the node's
    target distribution after the siblings tried before it were rejected (r starts as
    p[node]; rejecting t sets r(t) = 0 and renormalizes, which is max(r - q, 0) for the
    point mass q on t). An accepted child becomes the current node; when every child of
    a node is rejected (or it has none), the token is drawn from its residual. The first
    emitted token is then distributed as p[0] exactly, and each next one as the target's
    distribution after the tokens before it (SpecInfer's multi-draft rejection, one draft
    per sibling).

    Args:
        p: target distributions, [N, V]; row i follows node i's path.
        parents: each node's parent (node 0, the root, -1; parents[i] < i); siblings hold
            distinct tokens.
        tokens: each node's token (node 0's is the root's own, unused).
        key: the round's random key; None draws from mlx's global generator.

    Returns:
        (path, token): the accepted root path (node indices, 0 first), then the token drawn
        at its last node.
    """
    k_accept = k_token = None
    if key is not None:
        k_accept, k_token = mx.random.split(key)
    p = p.astype(mx.float32)
    u = mx.random.uniform(shape=(len(parents),), key=k_accept).tolist()  # one draw per child, used once
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents[1:], start=1):
        children.setdefault(parent, []).append(i)
    path = [0]
    while True:
        node = path[-1]
        residual = p[node]
        for child in children.get(node, ()):
            r = residual[tokens[child]].item()
            if u[child] < r:
                path.append(child)
                break
            residual = residual.at[tokens[child]].multiply(0.0)
            mass = residual.sum()
            residual = mx.where(mass > 0, residual / mass, p[node])  # all-zero only by rounding
        else:
            token = mx.random.categorical(mx.log(residual)[None], key=k_token).item()
            return path, token
