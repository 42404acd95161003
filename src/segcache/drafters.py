"""Drafters of a speculative round, behind one small protocol.

    drafter.draft(history, target_offset, pending, width) -> Draft (tokens, q)
    ... the target verifies [pending] + draft.tokens in one forward ...
    drafter.extend(emitted tokens)      as each is emitted
    drafter.settle(keep)                the round is over: keep = target tokens kept

Two drafters: a draft model on its own Runtime (`DraftModel`) and n-gram
lookup in prompt + output (`Lookup`). A drafter never touches the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union

import mlx.core as mx

from .acceptors import Acceptor
from .lookup import PromptLookup
from .runtime import Runtime

# A gap (tokens the target committed that the draft has not seen) up to this
# long rides along in the draft's first forward of a round; longer gaps are
# fed outside the fork first, so a branch never holds a long prefill.
GAP_IN_FORK = 8


def eval_cache(rt: Runtime) -> None:
    mx.eval([layer.state for layer in rt.cache])


def feed(rt: Runtime, tokens: Sequence[int], step: int) -> None:
    """Forward `tokens` through `rt` outside any branch, in chunks of `step`."""
    for i in range(0, len(tokens), step):
        rt.forward(tokens[i : i + step])
        eval_cache(rt)
        mx.clear_cache()


def normalize(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@dataclass
class Draft:
    """One round's drafts.

    Attributes:
        tokens: token ids, or an unevaluated [K] array (a draft model's chain,
            evaluated together with the verify forward).
        q: the distributions the drafts were drawn from, [K, V], or None.
    """

    tokens: Union[list, mx.array]
    q: Optional[mx.array] = None

    @property
    def lazy(self) -> bool:
        return isinstance(self.tokens, mx.array)

    def __len__(self) -> int:
        return self.tokens.shape[0] if self.lazy else len(self.tokens)

    def verify_input(self, pending: int):
        """The verify forward's input: the pending token, then the drafts."""
        if self.lazy:
            return mx.concatenate([mx.array([pending], dtype=self.tokens.dtype), self.tokens])
        return [pending] + self.tokens

    def ids(self) -> list:
        """The drafts as ids (evaluates a lazy chain)."""
        return self.tokens.tolist() if self.lazy else self.tokens


NO_DRAFT = Draft([])


class Drafter(Protocol):
    """Proposes tokens for the target to verify.

    `gated` says the drafter sizes its own rounds (then the caller does not
    adapt the width after each round).
    """

    gated: bool

    def catch_up(self, history: list, target_offset: int) -> None:
        """Bring the drafter up to the target's fed tokens, before the first round."""

    def draft(self, history: list, target_offset: int, pending: int, width: int) -> Draft:
        """Up to `width` drafts following `history` (whose last token is `pending`)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens emitted after the ones the drafter has seen."""

    def settle(self, keep: int) -> None:
        """End the round: the target kept `keep` tokens of it (pending included)."""


class Lookup:
    """Prompt lookup: drafts copied from the last earlier match of the history's suffix."""

    gated = False

    def __init__(self, lookup: PromptLookup):
        self.lookup = lookup

    def catch_up(self, history, target_offset):
        pass

    def draft(self, history, target_offset, pending, width):
        return Draft(self.lookup.draft(width))

    def extend(self, tokens):
        self.lookup.extend(tokens)

    def settle(self, keep):
        pass


class DraftModel:
    """A draft model on its own Runtime, forked for each round.

        draft runtime:   fork ─ forward(gap + [y]) ─ forward([d1]) ... ─ commit(gap + kept)

    With `min_prob` > 0 a round stops drafting after the first draft the
    draft model itself gives less than `min_prob` (that draft is still
    verified: even unsure drafts are often right).
    """

    def __init__(self, runtime: Runtime, acceptor: Acceptor, *, prefill_step: int, min_prob: float = 0.0):
        self.runtime = runtime
        self.acceptor = acceptor
        self.prefill_step = prefill_step
        self.min_prob = min_prob
        self.gated = min_prob > 0
        self._branch = None
        self._gap_in_fork = 0

    def catch_up(self, history, target_offset):
        feed(self.runtime, history[self.runtime.offset : target_offset], self.prefill_step)

    def draft(self, history, target_offset, pending, width):
        draft = self.runtime
        gap = history[draft.offset : target_offset]
        if len(gap) > GAP_IN_FORK:
            feed(draft, gap, self.prefill_step)
            gap = []
        self._gap_in_fork = len(gap)
        self._branch = draft.fork()
        tokens, qs = [], []
        step = gap + [pending]
        # The drafts stay lazy: each feeds the next forward as an array. Without
        # the gate the whole chain is evaluated with the verify (one device sync
        # per round); with it, each draft but the last is read to decide
        # whether to go on (a sync per draft, cheap next to a wasted draft).
        for i in range(width):  # the last draft is not fed: the next round's gap holds it if accepted
            logprobs = normalize(draft.forward(step)[0, -1])
            tok, q = self.acceptor.propose(logprobs)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            if self.gated and i + 1 < width:
                # How sure the draft is of its token: under the distribution
                # it was drawn from (a Sampler's), else the model's own.
                sure = qs[-1][tok] if qs else mx.exp(logprobs[tok])
                if sure.item() < self.min_prob:
                    break
            step = tok.reshape(1)
        drafts = mx.stack(tokens)
        # Start on the drafts not read yet while the verify graph is built.
        mx.async_eval(drafts)
        return Draft(drafts, mx.stack(qs) if qs else None)

    def extend(self, tokens):
        pass  # the next round's gap feeds them

    def settle(self, keep):
        branch, self._branch = self._branch, None
        if branch is not None and branch.open:
            branch.commit(min(branch.length, self._gap_in_fork + keep))
