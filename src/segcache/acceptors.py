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

Randomness: a rule given `Keys` (sampling.py) draws from that stream only, so
what a row samples depends on its own seed and nothing else in the process
(another request, a batch's row order, a request that failed half-way);
without them it draws from mlx's global state, as mlx-lm does. `Keys(seed)`
hands out exactly the keys the global state hands out after
`mx.random.seed(seed)`, so both draw the same tokens.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import mlx.core as mx

from .sampling import Keys, Sampler, match_accept, speculative_accept


class GlobalKeys:
    """mlx's global random state as a stream of keys: `next()` is None, so each draw takes
    the global generator's next key (what mlx-lm's samplers draw from)."""

    def next(self) -> None:
        return None


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
    state (mlx-lm's samplers take no key), so it takes no `Keys`."""

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

    def __init__(self, sampler: Sampler, keys: Optional[Keys] = None):
        self.sampler = sampler
        self.keys = keys if keys is not None else GlobalKeys()

    def sample(self, logprobs):
        return self.sampler.sample(logprobs, self.keys)  # mlx-lm's sampler's draw for these keys

    def propose(self, logprobs):
        return self.sampler.draw(logprobs, self.keys.next())  # q: what the draft was drawn from

    def choices(self, logprobs):
        return ()  # the acceptance draws its own

    def accept(self, logprobs, drafts, q, choices):
        return speculative_accept(self.sampler.probs(logprobs), q, drafts, key=self.keys.next())


def make_acceptor(sampler, keys: Optional[Keys] = None) -> Acceptor:
    """The rule for `sampler`: None (greedy), a `Sampler` (drawing from `keys` if given), or
    any mlx-lm sampler (which draws from mlx's global state).

    Raises:
        ValueError: `keys` with an opaque mlx-lm sampler, which cannot take them.
    """
    if sampler is None:
        return GreedyMatch()
    if isinstance(sampler, Sampler):
        return ExactSpeculative(sampler, keys)
    if keys is not None:
        raise ValueError("an mlx-lm sampler draws from mlx's global random state; pass a segcache Sampler "
                         "(segcache.make_sampler) to give a generation its own seed")
    return SamplerMatch(sampler)
