"""Batched decoding on a BatchRuntime: one forward per step for every row, speculative or plain.

    step():   every row drafts (prompt lookup, its own history)
              no row drafted  -> forward [[y_i]]                        (no branch)
              else            -> fork, forward [[y_i] + drafts_i] ragged, commit [1 + n_i]
              each row emits drafts_i[:n_i] + [t_i]; t_i becomes its pending y_i

As `generation._Speculator` for one sequence: a row's runtime holds its
history but the last emitted token (`pending`, fed by the next step). A row
leaves between steps (`remove`); the others are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

import mlx.core as mx

from ..acceptors import Acceptor, GreedyMatch
from ..drafters import normalize
from ..lookup import PromptLookup
from ..runtime import Runtime
from .runtime import BatchRuntime


@dataclass
class RowState:
    """One row's generation state.

    Invariant: the batch row holds exactly `history[:-1]`; history[-1] is `pending`.
    """

    acceptor: Acceptor
    history: list
    lookup: Optional[PromptLookup] = None
    cap: int = 0  # this row's current draft width (adaptive as stream_generate's)
    remaining: int = -1  # tokens it may still emit (-1: no limit)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    per_round: list = field(default_factory=list)


class BatchDecoder:
    """Rows of one model generating together.

    Args:
        model: the target model.
        num_draft_tokens: drafts per row per round by prompt lookup (0: plain decoding).
        recurrent_strategy: as for `Runtime`.
    """

    def __init__(self, model, *, num_draft_tokens: int = 0, recurrent_strategy: str = "auto"):
        self.batch = BatchRuntime(model, recurrent_strategy=recurrent_strategy)
        self.width = num_draft_tokens
        self.rows: dict[Hashable, RowState] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row_id, runtime: Runtime, pending: int, *, acceptor: Acceptor | None = None,
            max_tokens: int = -1) -> None:
        """Add a row whose `runtime` holds its prompt but the last token `pending`."""
        self.batch.join(row_id, runtime)
        history = runtime.tokens + [pending]
        lookup = None
        if self.width:
            lookup = PromptLookup()
            lookup.extend(history)
        self.rows[row_id] = RowState(acceptor or GreedyMatch(), history, lookup, self.width, max_tokens)

    def remove(self, row_id) -> None:
        """The row leaves (finished or cancelled); the others keep their state."""
        self.batch.leave(row_id)
        del self.rows[row_id]

    def runtime(self, row_id) -> Runtime:
        """A single-sequence Runtime holding the row's history, all fed (e.g. to publish it)."""
        rt = self.batch.to_runtime(row_id)
        rt.forward([self.rows[row_id].history[-1]])
        return rt

    def step(self) -> dict:
        """One forward for every row; returns {row id: [(token, logprobs [V], from_draft), ...]}."""
        ids = self.batch.ids
        states = [self.rows[r] for r in ids]
        drafts = [self._draft(s) for s in states]
        pending = [s.history[-1] for s in states]
        branch = any(drafts)
        if branch:
            self.batch.fork()
        try:
            logits = self.batch.forward([[p] + d for p, d in zip(pending, drafts)])
            logprobs = normalize(logits)  # [B, S, V]
            rows = [logprobs[i, : 1 + len(d)] for i, d in enumerate(drafts)]
            choices = [s.acceptor.choices(lp) for s, lp in zip(states, rows)]
            mx.eval(logprobs, *[c for cs in choices for c in cs])  # one sync for every row
            out, keep = {}, []
            for rid, s, d, lp, cs in zip(ids, states, drafts, rows, choices):
                n, nxt = s.acceptor.accept(lp, d, None, cs)
                keep.append(1 + n)
                out[rid] = [(t, lp[j], True) for j, t in enumerate(d[:n])] + [(nxt, lp[n], False)]
                self._advance(s, d, n, nxt)
        except BaseException:
            if branch:
                self.batch.rollback()
            raise
        if branch:
            self.batch.commit(keep)
        return out

    def _draft(self, s: RowState) -> list:
        if s.lookup is None:
            return []
        room = s.cap if s.remaining < 0 else min(s.cap, s.remaining - 1)
        return s.lookup.draft(room) if room > 0 else []

    def _advance(self, s: RowState, drafts: list, n: int, nxt: int) -> None:
        emitted = drafts[:n] + [nxt]
        s.history.extend(emitted)
        if s.lookup is not None:
            s.lookup.extend(emitted)
        if s.remaining >= 0:
            s.remaining -= len(emitted)
        if drafts:
            s.rounds += 1
            s.drafted += len(drafts)
            s.accepted += n
            # as stream_generate's adaptive width for prompt lookup
            if n == 0:
                s.cap = max(1, s.cap // 2)
            elif n == len(drafts):
                s.cap = min(self.width, 2 * s.cap)
