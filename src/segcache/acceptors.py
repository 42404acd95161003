"""Acceptance rules of a speculative round, behind one small protocol.

    verify logprobs [K+1, V] ──choices()──> what the rule needs evaluated with the verify
                             ──accept()───> (n drafts kept, the token after them)

Three rules, chosen by the sampler (`make_acceptor`):

| sampler                      | rule                 | draws a draft as              |
|------------------------------|----------------------|-------------------------------|
| None (greedy)                | greedy match         | argmax                        |
| an opaque mlx-lm one         | sampler match        | the sampler's token           |
| `segcache.Sampler` + `Keys`  | keyed match          | the same draw on q, same keys |
| `segcache.Sampler` alone     | exact spec. sampling | categorical from q            |

Every rule is exact: an emitted token is distributed as the target's own
choice (see sampling.py). The keyed match is more: a row's tokens are the
very tokens plain decoding draws with its keys, however many drafts each
round had (so a seeded request is reproducible under any drafting or
batching, and equals mlx-lm's seeded output).

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

from .sampling import Keys, Sampler, match_accept, speculative_accept, tree_speculative_accept


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


def walk(parents: Sequence[int], tokens: Sequence[int], targets: list[int]) -> tuple[list[int], int]:
    """A tree's match rule: from the root, the child holding the target's choice at its parent
    (`targets[node]`), while there is one; (the root path walked, the choice after it)."""
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
    path = [0]
    while (path[-1], targets[path[-1]]) in child:
        path.append(child[(path[-1], targets[path[-1]])])
    return path, targets[path[-1]]


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

    def accept_tree(self, logprobs, parents, tokens):
        """(accepted root path, the token after it) for a tree's verify logprobs [N, V]: from
        the root, the child holding the target's argmax, while there is one (batch/tree.py)."""
        return walk(parents, tokens, mx.argmax(logprobs, axis=-1).tolist())


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

    def accept_tree(self, logprobs, parents, tokens):
        """A tree of point-mass drafts, exactly: recursive rejection over siblings
        (`sampling.tree_speculative_accept`)."""
        return tree_speculative_accept(self.sampler.probs(logprobs), parents, tokens, key=self.keys.next())


class KeyedMatch:
    """A `Sampler` drawing from its own `Keys`: the target's own draw at every position of a verify,
    each with the keys plain decoding would use there (the stream moves one position per token
    emitted, never per round), and drafts accepted while they equal those draws.

    The tokens emitted are exactly plain decoding's for the same keys, so the rule is exact
    and a seeded row's text does not depend on how far its rounds drafted (the cost gate's
    timing-based widths, a batch's neighbours). A sampling drafter's proposal at a position is
    the same draw on its own distribution with the same keys (Gumbel-max coupling): it equals
    the target's draw whenever both distributions put the noise's winner on the same token.
    Prompt lookup's drafts are accepted with probability p(d), as by rejection sampling.
    """

    def __init__(self, sampler: Sampler, keys: Keys):
        self.sampler = sampler
        self.keys = keys
        self._proposing: Optional[Keys] = None  # the open round's proposals draw from a copy
        self._after: list = []  # the stream after each position of the verify being accepted

    def sample(self, logprobs):
        self._proposing = None
        return self.sampler.sample(logprobs, self.keys)

    def propose(self, logprobs):
        if self._proposing is None:
            self._proposing = self.keys.copy()
        return self.sampler.sample(logprobs, self._proposing), None

    def choices(self, logprobs):
        self._proposing = None
        tokens, self._after = self.sampler.sample_positions(logprobs, self.keys)
        return (tokens,)

    def accept(self, logprobs, drafts, q, choices):
        targets = choices[0].tolist()
        n = match_accept(drafts, targets)
        self.keys = self._after[n]  # past the n + 1 positions emitted
        self._after = []
        return n, targets[n]

    def accept_tree(self, logprobs, parents, tokens):
        """A tree's match rule on the target's own draws, node i drawn with the keys of its depth
        (`Sampler.sample_tree`): the tokens emitted are plain decoding's for these keys."""
        self._proposing = None
        depths = [0] * len(parents)
        for i, p in enumerate(parents[1:], start=1):
            depths[i] = depths[p] + 1
        draws, after = self.sampler.sample_tree(logprobs, depths, self.keys)
        path, token = walk(parents, tokens, draws.tolist())
        self.keys = after[len(path) - 1]  # past the positions emitted
        return path, token


def make_acceptor(sampler, keys: Optional[Keys] = None) -> Acceptor:
    """The rule for `sampler`: None (greedy), a `Sampler` (with `keys`: the keyed match; without:
    exact speculative sampling on mlx's global state), or any mlx-lm sampler (which draws from
    mlx's global state).

    Raises:
        ValueError: `keys` with an opaque mlx-lm sampler, which cannot take them.
    """
    if sampler is None:
        return GreedyMatch()
    if isinstance(sampler, Sampler):
        return ExactSpeculative(sampler) if keys is None else KeyedMatch(sampler, keys)
    if keys is not None:
        raise ValueError("an mlx-lm sampler draws from mlx's global random state; pass a segcache Sampler "
                         "(segcache.make_sampler) to give a generation its own seed")
    return SamplerMatch(sampler)
