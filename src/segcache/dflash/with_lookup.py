"""Prompt lookup and a DFlash drafter on the same rows: per row, the proposal expected to yield more.

    offer    every row its room (DFlash's: it can always draft a block)
    draft    per drafting row of width w: lookup's match m (n = the suffix length it matched) or
             DFlash's block, whichever the row's estimates expect more drafts accepted of,
                 E(kind) = a + a^2 + ... + a^w      a: the row's acceptance of that kind
             (lookup's per n, ties to lookup: it costs no forward); DFlash drafts only its rows
             (no forward at all when every row took lookup's), and the step's drafts are one
             [B, J] array, each row's from the kind it chose
    verify   the decoder's: q is the chosen proposal's (lookup's: None, a point mass; DFlash's:
             the distribution it drew from), so exact sampling stays exact
    close    DFlash appends the kept positions' context (it sees every verify), and each row's
             estimates move by how far each proposal it had agreed with what the row kept
             (the unchosen one too: a censored look at what it would have given)

Greedy or sampled, the tokens emitted are the target's (the acceptors decide on the target's
logits); the choice only moves how many drafts a round keeps.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..batch.drafting import Draft
from ..batch.gate import Acceptance
from ..errors import InvariantError
from .drafter import DFlash

DFLASH = "dflash"


def agreed(kept: Sequence[int], proposal: Sequence[int]) -> int:
    """How many leading proposals equal the tokens a row kept after its pending one."""
    n = 0
    while n < min(len(kept), len(proposal)) and kept[n] == proposal[n]:
        n += 1
    return n


class WithLookup:
    """Prompt lookup beside a DFlash drafter (the decoder's drafter protocol, batch/drafting.py).

    Args:
        lookup: the prompt-lookup drafter (drafters.Lookup: an n-gram index per row, no tree).
        dflash: the `DFlash` drafter of the rows.
        decay: weight of the past in each estimate, per round it is updated.

    Attributes:
        chosen: rounds of rows drafted by each kind ("lookup", "dflash").
    """

    mode = "lookup+dflash"
    min_prob = 0.0
    draft_runtimes = False
    offers_rooms = True  # DFlash can draft every row its room; lookup's match only picks the proposal
    blockwise = True  # either proposal, any width, in one call

    def __init__(self, lookup, dflash: DFlash, *, decay: float = 0.8):
        self.lookup, self.dflash, self.decay = lookup, dflash, decay
        self.model = dflash.model
        self.tap = dflash.tap
        # row id -> kind -> Acceptance; kinds: ("lookup", n) per suffix length matched, DFLASH
        self.estimates: dict = {}
        self.chosen = {"lookup": 0, DFLASH: 0}
        # The open round: row id -> (whether it verifies lookup's proposal, the suffix length lookup
        # matched, lookup's proposal or None, its width), and
        # DFlash's [B, J] proposals with the rows they are of (None: DFlash drafted nothing).
        self._round: dict | None = None
        self._blocks: tuple | None = None

    @property
    def block_size(self) -> int:
        return self.dflash.block_size

    @property
    def segment_identity(self) -> bytes:
        return self.dflash.segment_identity

    def attach(self, runtime) -> None:
        self.dflash.attach(runtime)

    def hand_back(self, row_id, runtime, history: list, keep: int | None = None, fed=None) -> None:
        """DFlash's context goes back to the released runtime (lookup keeps nothing there)."""
        self.dflash.hand_back(row_id, runtime, history, keep, fed)

    # -- rows -------------------------------------------------------------------------

    def add(self, row_id, history, runtime, draft_runtime):
        self.lookup.add(row_id, history, runtime, draft_runtime)
        try:
            self.dflash.add(row_id, history, runtime, draft_runtime)
        except BaseException:
            self.lookup.remove(row_id)
            raise
        self.estimates[row_id] = {DFLASH: Acceptance()}

    def remove(self, row_id):
        self.lookup.remove(row_id)
        self.dflash.remove(row_id)
        self.estimates.pop(row_id, None)
        if self._round is not None:
            self._round.pop(row_id, None)

    def extend(self, row_id, tokens):
        self.lookup.extend(row_id, tokens)
        self.dflash.extend(row_id, tokens)

    # -- a round ------------------------------------------------------------------------

    def offer(self, states, rooms):
        return self.dflash.offer(states, rooms)

    def _estimate(self, row_id, kind) -> Acceptance:
        return self.estimates[row_id].setdefault(kind, Acceptance())

    def draft(self, states, widths):
        plan, own = {}, []
        for s, w in zip(states, widths):
            n, match = self.lookup.index[s.row_id].match(w) if w else (0, [])
            take = bool(match) and (self._estimate(s.row_id, ("lookup", n)).expected(w)
                                    >= self._estimate(s.row_id, DFLASH).expected(w))
            plan[s.row_id] = (take, n, match or None, w)
            own.append(w if w and not take else 0)
            if w:
                self.chosen["lookup" if take else DFLASH] += 1
        self._round = plan
        ours = [plan[s.row_id][2] if plan[s.row_id][0] else None for s in states]
        if not any(own):  # every drafting row takes lookup's: no DFlash forward
            self.dflash.open(states)
            self._blocks = None
            return Draft([m or [] for m in ours], list(widths), [None] * len(states))
        block = self.dflash.draft(states, own)
        self._blocks = (block.tokens, [s.row_id for s in states])
        if not any(ours):
            return block
        J = max(widths)
        tokens = block.tokens if block.tokens.shape[1] >= J else mx.pad(
            block.tokens, [(0, 0), (0, J - block.tokens.shape[1])])
        tokens = tokens[:, :J]
        looked = mx.array([(m or [])[:J] + [0] * (J - len((m or [])[:J])) for m in ours], dtype=tokens.dtype)
        chosen = mx.array([m is not None for m in ours])[:, None]
        tokens = mx.where(chosen, looked, tokens)
        mx.async_eval(tokens)
        return Draft(tokens, list(widths), [None if m is not None else q for m, q in zip(ours, block.q)])

    def fill(self, proposals):
        self.dflash.fill(proposals)

    def capture(self):
        return self.dflash.capture()

    def close(self, states, keep, fed=None):
        plan, self._round = self._round, None
        blocks, self._blocks = self._blocks, None
        if plan is not None:
            drafted = {}
            if blocks is not None:
                drafted = dict(zip(blocks[1], blocks[0].tolist()))  # read with the verify already
            for s, k in zip(states, keep):
                if s.row_id not in plan or not plan[s.row_id][3]:
                    continue
                _, n, match, w = plan[s.row_id]
                kept = s.history[len(s.history) - k :]  # what it emitted and kept, after its pending token
                if match is not None:
                    self._learn(s.row_id, ("lookup", n), kept, match[:w])
                if s.row_id in drafted:
                    self._learn(s.row_id, DFLASH, kept, drafted[s.row_id][:w])
        self.dflash.close(states, keep, fed)

    def _learn(self, row_id, kind, kept: list, proposal: list) -> None:
        """The row's estimate of `kind` by how far `proposal` agreed with what the row kept: a
        mismatch seen is a failed draft; agreeing to the end of what is known tells no failure."""
        a = agreed(kept, proposal)
        failed = a < min(len(kept), len(proposal))
        self._estimate(row_id, kind).update(a + failed, a, self.decay)

    def rollback(self):
        self._round = self._blocks = None
        self.lookup.rollback()
        self.dflash.rollback()

    def check(self, states, settled: bool = True) -> None:
        self.lookup.check(states, settled)
        self.dflash.check(states, settled)
        ids = {s.row_id for s in states}
        if set(self.estimates) != ids:
            raise InvariantError(f"lookup+dflash estimates of rows {list(self.estimates)}, decoder rows {sorted(map(repr, ids))}")
        for kinds in self.estimates.values():
            for estimate in kinds.values():
                estimate.check()
