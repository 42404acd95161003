"""Acceptance rules of a speculative round, behind one small protocol.

    verify logprobs [K+1, V] ──choices()──> what the rule needs evaluated with the verify
                             ──accept()───> (n drafts kept, the token after them)

Three rules, chosen by the sampler (`make_acceptor`):

| sampler                 | rule                 | draws a draft as      |
|-------------------------|----------------------|-----------------------|
| None (greedy)           | greedy match         | argmax                |
| an opaque mlx-lm one    | sampler match        | the sampler's token   |
| `segcache.Sampler`      | exact spec. sampling | categorical from q    |

Every rule is exact: an emitted token is distributed as the target's own
choice (see sampling.py).

Randomness: a rule given an `Rng` draws from that stream only, so what a row
samples depends on its own seed and nothing else in the process (another
request, a batch's row order, a request that failed half-way); without one it
draws from mlx's global state, as mlx-lm does. An `Rng(seed)` draws exactly
what the global state draws after `mx.random.seed(seed)`.
"""

from __future__ import annotations

import secrets
from typing import Optional, Protocol, Sequence

import mlx.core as mx

from .sampling import Sampler, match_accept, speculative_accept


class Rng:
    """One row's own random stream: the keys mlx's global state would hand out after
    `mx.random.seed(seed)` (a fresh secret seed when None)."""

    def __init__(self, seed: Optional[int] = None):
        self.seed = secrets.randbits(63) if seed is None else seed
        self._key = mx.random.key(self.seed)

    def next(self) -> mx.array:
        """The key for the next draw (the stream moves on; nothing is evaluated)."""
        keys = mx.random.split(self._key)
        self._key = keys[0]
        return keys[1]


def _key(rng: Optional[Rng]):
    return None if rng is None else rng.next()


class Acceptor(Protocol):
    """How tokens are chosen from a model's logprobs and drafts are accepted."""

    def sample(self, logprobs: mx.array) -> mx.array:
        """The next token from logprobs [V], unevaluated (plain decoding)."""

    def propose(self, logprobs: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        """A draft model's token from its logprobs [V], unevaluated, and the
        distribution it was drawn from (None when the rule needs none)."""

    def choices(self, logprobs: mx.array) -> tuple:
        """Arrays to evaluate with the verify forward (logprobs [K+1, V])."""

    def accept(self, logprobs: mx.array, drafts: Sequence[int], q, choices: tuple) -> tuple[int, int]:
        """(drafts accepted, the token after them) for one row's verify."""


class GreedyMatch:
    """Greedy decoding: accept drafts while they equal the target's argmax."""

    def sample(self, logprobs):
        return mx.argmax(logprobs, axis=-1)

    def propose(self, logprobs):
        return mx.argmax(logprobs, axis=-1), None

    def choices(self, logprobs):
        return (mx.argmax(logprobs, axis=-1),)

    def accept(self, logprobs, drafts, q, choices):
        targets = choices[0].tolist()
        n = match_accept(drafts, targets)
        return n, targets[n]


class SamplerMatch:
    """An opaque mlx-lm sampler: sample the target at every position, accept
    drafts while they equal those samples. It draws from mlx's global random
    state (mlx-lm's samplers take no key), so it takes no `Rng`."""

    def __init__(self, sampler):
        self.sampler = sampler

    def sample(self, logprobs):
        return self.sampler(logprobs[None])[0]

    def propose(self, logprobs):
        return self.sampler(logprobs[None])[0], None

    def choices(self, logprobs):
        return (self.sampler(logprobs),)

    def accept(self, logprobs, drafts, q, choices):
        targets = choices[0].tolist()
        n = match_accept(drafts, targets)
        return n, targets[n]


class ExactSpeculative:
    """A `Sampler` with a visible distribution: exact speculative sampling."""

    def __init__(self, sampler: Sampler, rng: Optional[Rng] = None):
        self.sampler = sampler
        self.rng = rng

    def sample(self, logprobs):
        return mx.random.categorical(mx.log(self.sampler.probs(logprobs).astype(mx.float32)), key=_key(self.rng))

    def propose(self, logprobs):
        q = self.sampler.probs(logprobs)
        return mx.random.categorical(mx.log(q), key=_key(self.rng)), q

    def choices(self, logprobs):
        return ()  # the acceptance draws its own

    def accept(self, logprobs, drafts, q, choices):
        return speculative_accept(self.sampler.probs(logprobs), q, drafts, rng=self.rng)


def make_acceptor(sampler, rng: Optional[Rng] = None) -> Acceptor:
    """The rule for `sampler`: None (greedy), a `Sampler` (drawing from `rng` if given), or
    any mlx-lm sampler (which draws from mlx's global state).

    Raises:
        ValueError: an `rng` with an opaque mlx-lm sampler, which cannot take it.
    """
    if sampler is None:
        return GreedyMatch()
    if isinstance(sampler, Sampler):
        return ExactSpeculative(sampler, rng)
    if rng is not None:
        raise ValueError("an mlx-lm sampler draws from mlx's global random state; pass a segcache Sampler "
                         "(segcache.make_sampler) to give a generation its own seed")
    return SamplerMatch(sampler)
