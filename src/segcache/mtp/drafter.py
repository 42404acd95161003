"""MTP self-speculation: the target's own multi-token-prediction head as a drafter.

The drafter follows the decoder's protocol (batch/drafting.py). Its state is one
`HeadRows` (segment.py) over all its rows: the head's attention cache and the
target's hidden states it has not fed to the head yet:

    head cache:  pairs (hidden[p], token[p+1]) for p < held[i]    committed
    tail:        hidden[held[i] .. n_i - 1]                       n_i: tokens row i's target holds

A round (row i, pending token y_i = token[n_i], k drafts), every call one for all rows:

    catch-up   head(tail_i, history_i[held_i+1 .. n_i]), rows right-padded      exact pairs: kept
               -> d1_i from row i's last position
    depth j    head(h'_(j-1), d_(j-1)), one position per row                      the head's own h': dropped
    verify     the target forwards [y_i, d1_i..dk_i] (the decoder); the tap keeps its hidden states
    close      the head's layers keep the catch-up (a branch commit); the tail becomes the
               verify's hidden states of the kept tokens (1 + accepted)

so at every round's start the head holds exactly the pairs a head run on the
committed tokens with the target's own hidden states would hold (the pairs of
depth >= 2 are made of the head's hidden states and are never kept), as vLLM's
and SGLang's MTP workers do. A row that does not draft this round (width 0)
feeds all of its tail but the last state in the catch-up. A row's prompt pairs
are fed when it joins (on a cache of its own, then merged in), from the hidden
states its prefill collected (`HiddenStates`), else from a forward of the
prompt on a fresh cache. Every call stays lazy; the drafts of all rows are read
with the verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..acceptors import GreedyMatch
from ..batch.drafting import TOP, Draft, draft_position, no_draft, path_of, tree_of_leaves
from ..errors import InvariantError
from .module import MTPHead, _text_parts
from .segment import HeadRows
from .state import HeadSegment, head_identity
from .tap import install

# A row that does not draft for this many steps (the gate chose plain steps) feeds
# its tail to the head outside a round (all rows in one call), so tails stay short.
TAIL = 16


@dataclass
class HiddenStates:
    """The target's hidden states [m, H] of the last m tokens a runtime holds (what its
    prefill computed), handed to `BatchDecoder.add` as the row's `draft_runtime`."""

    hidden: mx.array

    def clone(self) -> "HiddenStates":
        """The same states (never written: rows of one prompt share them)."""
        return self


class MTP:
    """The head of the target drafting for every row (the decoder's drafter protocol).

    Args:
        head: the target's `MTPHead` (its module and the target it is bound to).
        prefill_step: positions per head call (and per target forward when a row's
            prompt hidden states must be recomputed) when a row joins.
        plain_first: a row's first step after it joins drafts nothing, so its first token
            comes from the forward of its pending token alone, before any head call or
            verify (False: its first step may draft, delivering the first token with them).
    """

    mode = "mtp"
    min_prob = 0.0
    draft_runtimes = True  # the prefill's HiddenStates
    offers_rooms = True  # every row has a hidden state to draft from after a plain step
    blockwise = False  # one head call per depth

    def __init__(self, head: MTPHead, *, prefill_step: int = 2048, plain_first: bool = True, tree: int = 0):
        head = head.for_drafting()  # float16 weights of a float32 target: a float32 copy (same drafts)
        self.head = head
        self.model = head.model
        self.tap = install(head.model)
        self.prefill_step = prefill_step
        self.plain_first = plain_first
        self.rows = HeadRows(head)  # every row's head state, in the decoder's row order
        self._identity: bytes | None = None  # the head's, as its drafter segments name it
        # The open round: row ids in the verify's order (None: no round), and the
        # verify's hidden states, taken by fill.
        self._ids: list | None = None
        self._hidden: mx.array | None = None
        # Rows that joined and have not stepped yet: their first step drafts nothing, so its
        # forward is the pending token's alone and the first token is delivered before any
        # head call or verify (a round would deliver it only with its drafts, after the head's
        # catch-up, its depths and a wider verify). Cleared by the step's close.
        self._fresh: set = set()
        # Greedy rows' trees (docs/tree.md): the chain and, up to `tree` nodes, the head's next
        # likeliest tokens at each depth as leaves (the decoder's tree gate may lower it per round);
        # the open round's trees, per row (None: a chain), to find each row's kept path at close.
        self.tree = tree
        self._trees: list | None = None

    # -- rows -------------------------------------------------------------------------

    def add(self, row_id, history, runtime, draft_runtime):
        if draft_runtime is not None and not isinstance(draft_runtime, HiddenStates):
            raise ValueError(f"add({row_id!r}): an MTP row takes the prefill's HiddenStates, not "
                             f"{type(draft_runtime).__name__}")
        if runtime.model is not self.model:
            raise ValueError(f"add({row_id!r}): the runtime is not of the head's target")
        if row_id in self.rows.ids:
            raise ValueError(f"add({row_id!r}): the MTP head has a row with that id already")
        n = len(history) - 1
        if None in history[:n]:
            raise ValueError(f"add({row_id!r}): the runtime holds tokens fed without Runtime.forward "
                             "(ids unknown), which the MTP head needs; use a fresh runtime")
        if self._takes_segment(runtime, n):  # the runtime's head state: no head call, no forward
            self.rows.join_state(row_id, *runtime.drafters.get(HeadSegment.name).lend())
            self._joined(row_id)
            return
        given = None if draft_runtime is None else draft_runtime.hidden
        if given is not None:
            given = given.reshape(-1, given.shape[-1])
            if given.shape[0] > n:
                raise ValueError(f"add({row_id!r}): {given.shape[0]} hidden states for {n} tokens")
        start = n - (0 if given is None else given.shape[0])
        parts = [self._hidden_of(history[:start])] if start else []
        if given is not None:
            parts.append(given)
        hidden = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0] if parts else None
        self.rows.join(row_id, hidden, history, self.prefill_step)
        self._joined(row_id)

    def _joined(self, row_id) -> None:
        if self.plain_first:
            self._fresh.add(row_id)

    def attach(self, runtime) -> None:
        """Give `runtime` this head's drafter segment (`Runtime(model, mtp=head)`), unless it
        carries a live one of this head: its forwards from here on feed it, the store saves
        and resumes it, and `add` takes it (a runtime holding tokens already gets a stale one)."""
        seg = runtime.drafters.get(HeadSegment.name)
        if seg is None or seg.stale or seg.identity != self.segment_identity:
            runtime.attach(HeadSegment(self.head))

    @property
    def segment_identity(self) -> bytes:
        if self._identity is None:
            self._identity = head_identity(self.head)
        return self._identity

    def _takes_segment(self, runtime, n: int) -> bool:
        seg = runtime.drafters.get(HeadSegment.name)
        return seg is not None and seg.offset == n and runtime.depth == 0 and seg.identity == self.segment_identity

    def hand_back(self, row_id, runtime, history: list, keep: int | None = None, fed=None) -> None:
        """Row `row_id` is released as `runtime`, which holds its len(history) - 1 committed tokens
        (with `keep`, a round is open: the row keeps that many of its branch's tokens; with `fed`
        [1, 1, H], the runtime holds the pending token too, fed by a lookahead whose hidden state
        that is): the runtime gets the row's head state as a live drafter segment, its unfed pairs
        fed in one head call, so what it publishes carries the head's records and a next turn on it
        (or resumed from them) runs no head over these tokens again. A state that does not account
        for what the runtime holds is not handed back (the segment stays stale, as before)."""
        if row_id not in self.rows.ids or runtime.depth:
            return
        more = None
        if keep is not None and self._ids is not None and self._hidden is not None:
            more = self._hidden[self._ids.index(row_id)][None, :keep]  # the verify's states of kept tokens
        keys, values, held, unfed = self.rows.row_state(row_id, more)
        n = held + (0 if unfed is None else unfed.shape[1])
        if n != len(history) - 1:
            return
        seg = HeadSegment(self.head)
        try:
            seg.load(keys, values, held, None if unfed is None else unfed[:, :1])
            if n - held > 1:  # the pairs the rounds had not fed yet: one head call
                seg.extend(unfed[:, 1:], history[held + 1 : n])
            if fed is not None:
                seg.extend(fed, history[n:])
        except Exception:  # nothing handed back is a stale segment, never a failed release
            return
        if seg.offset == runtime.offset:  # else it would not account for what the runtime holds
            runtime.attach(seg)

    def remove(self, row_id):
        self._fresh.discard(row_id)
        if row_id in self.rows.ids:
            self.rows.leave(row_id)

    def _hidden_of(self, ids: list) -> mx.array:
        """The target's hidden states of `ids` [len, H], from forwards on a fresh mlx-lm cache."""
        _, text_model, _, _ = _text_parts(self.model)
        cache = make_prompt_cache(self.model)
        out = []
        for i in range(0, len(ids), self.prefill_step):
            h = text_model(mx.array(ids[i : i + self.prefill_step], dtype=mx.uint32)[None], cache)
            mx.eval(h)
            out.append(h[0])
        return mx.concatenate(out, axis=0) if len(out) > 1 else out[0]

    # -- a round ------------------------------------------------------------------------

    def offer(self, states, rooms):
        self.rows.order([s.row_id for s in states])
        fresh = self._fresh
        return [room if lag and rid not in fresh else 0 for lag, room, rid in zip(self.rows.lags, rooms, self.rows.ids)]

    def draft(self, states, widths):
        J = max(widths, default=0)
        if J == 0:
            return no_draft(len(states))
        rows = self.rows
        rows.order([s.row_id for s in states])
        greedy = all(isinstance(s.acceptor, GreedyMatch) for s in states)
        processed = any(s.processors is not None for s in states)
        histories = [s.history for s in states]
        rows.fork()
        self._ids = list(rows.ids)
        try:
            h = rows.catch_up([w > 0 for w in widths], histories)
            logits = self.head.project(h)  # [B, 1, V]: the drafting rows' last positions only
            chain, qs, tops = [], [[] for _ in states], []
            branching = self.tree > 0 and greedy and not processed
            for j in range(J):
                lp, toks = draft_position(logits[:, 0], states, widths, j, chain, qs, greedy=greedy,
                                          processed=processed)
                chain.append(toks)
                if branching:  # the head's TOP likeliest tokens at this depth, read with the chain
                    order = mx.argsort(-lp, axis=-1)[:, :TOP]
                    tops.append((order, mx.take_along_axis(lp, order, axis=-1)))
                if j + 1 < J:
                    logits, h = rows.depth(h, toks[:, None], j + 1)
        except BaseException:
            self.rollback()
            raise
        tokens = mx.stack(chain, axis=1)  # [B, J]
        if branching:
            mx.eval(tokens, tops)
            self._trees = [tree_of_leaves(tokens[i, :w].tolist(), [(o[i], lp[i]) for o, lp in tops], self.tree)
                           if w else None for i, w in enumerate(widths)]
            return Draft(tokens, list(widths), [None] * len(states), self._trees)
        mx.async_eval(tokens)
        return Draft(tokens, list(widths), [mx.stack(q) if q else None for q in qs])

    def fill(self, proposals):
        self._hidden = self.tap.take()  # the verify forward's, [B, 1 + J, H]

    def capture(self):
        return self.tap.take()  # the forward's hidden states, kept for a close after later forwards

    def close(self, states, keep, fed=None):
        ids_now = [s.row_id for s in states]
        if self._ids is not None:  # a round: the verify's hidden states, rows that left since dropped
            hidden, ids = self._hidden, self._ids
        elif fed is not None:  # a plain step: the hidden states captured from the forward that fed it
            hidden, ids = fed
        else:  # a plain step: the forward that just ran fed every row its pending token
            hidden, ids = self.tap.take(), ids_now
        self.rows.order(ids_now)
        if self._trees is not None and self._ids is not None:  # a tree round: each kept path's states
            hidden = _along_paths(hidden, [path_of(t, s.history[len(s.history) - k : -1]) if t else list(range(k))
                                           for t, s, k in zip(self._ordered(self._trees, ids, ids_now), states, keep)],
                                  [ids.index(r) for r in ids_now])
        elif ids != ids_now:
            hidden = hidden[mx.array([ids.index(r) for r in ids_now], dtype=mx.int32)]
        self.rows.close(hidden, list(keep))
        self._fresh.difference_update(ids_now)
        self._end()
        self.rows.feed_tails([s.history for s in states], TAIL)

    def rollback(self):
        self.rows.rollback()
        self._end()

    def _end(self) -> None:
        self._ids, self._hidden, self._trees = None, None, None

    @staticmethod
    def _ordered(trees: list, ids: list, ids_now: list) -> list:
        return [trees[ids.index(r)] for r in ids_now]

    def extend(self, row_id, tokens: Sequence[int]):
        pass  # the row's history (the decoder's) has them; its hidden states come at close

    def check(self, states, settled: bool = True) -> None:
        """Between rounds (`settled`; with a round open there is nothing to check): the head's
        invariants, its rows the decoder's, held + tail = the target's tokens."""
        if not settled:
            return
        ids = [s.row_id for s in states]
        if sorted(map(repr, ids)) != sorted(map(repr, self.rows.ids)):
            raise InvariantError(f"MTP head rows {self.rows.ids}, decoder rows {ids}")
        if not self._fresh <= set(self.rows.ids):
            raise InvariantError(f"MTP rows not stepped yet {self._fresh}, rows {self.rows.ids}")
        by_id = {s.row_id: len(s.history) - 1 for s in states}
        self.rows.check([by_id[r] for r in self.rows.ids])


def _along_paths(hidden: mx.array, paths: list[list[int]], rows: list[int]) -> mx.array:
    """The verify's hidden states [B, N, H] of each row's kept path, first (row i: `rows[i]` of the
    verify, its path's nodes, then its last node again up to the longest path: never kept)."""
    L = max((len(p) for p in paths), default=0) or 1
    idx = [p + [p[-1] if p else 0] * (L - len(p)) for p in paths]
    return hidden[mx.array(rows, dtype=mx.int32)[:, None], mx.array(idx, dtype=mx.int32)]
