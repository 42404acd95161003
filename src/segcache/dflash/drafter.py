"""DFlash block drafting for rows (the decoder's drafter protocol, batch/drafting.py).

Each row keeps the drafter's context K/V of every token its target holds:

    row i     n_i committed tokens; ctx K/V rows 0 .. n_i - 1 (a KV cache of its own)
    draft     block_i = [pending_i, mask x J] at positions n_i .. n_i + J   (J = the step's widest row)
              one drafter forward for all rows: each row's context right-padded to the longest,
              padded rows masked out; drafts_i = the first widths[i] of positions 1 .. J
    verify    the decoder forwards [pending_i, drafts_i]; the tap keeps the tapped layers' outputs
    close     the first keep[i] positions of that forward are committed: their ctx K/V
              (one batched projection, rotary at each row's n_i) are appended to row i

The block's own K/V never enter a row's cache, so a round needs no branch of the drafter:
what it appends at close is of committed tokens only. A row joins from its runtime's
drafter segment (dflash/segment.py: no forward at all, e.g. after a resume from the
store), else from a forward of its history on a fresh cache with the tap on.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..acceptors import GreedyMatch
from ..batch.drafting import Draft, draft_position, no_draft
from ..errors import InvariantError
from .model import Drafter
from .segment import ContextSegment, drafter_identity
from .tap import install


class _Row:
    """One row's context: K/V rows of its n committed tokens (`kv.offset == n`), and the last
    one's ctx (`tail` [1, 1, H], None iff n == 0), what a drafter segment handed back keeps."""

    __slots__ = ("kv", "tail")

    def __init__(self):
        self.kv = KVCache()
        self.tail: mx.array | None = None

    @property
    def n(self) -> int:
        return self.kv.offset

    def append(self, keys: mx.array, values: mx.array) -> None:
        if keys.shape[2]:
            self.kv.update_and_fetch(keys, values)

    def context(self) -> tuple:
        if not self.kv.offset:
            return None, None
        return self.kv.keys[..., : self.kv.offset, :], self.kv.values[..., : self.kv.offset, :]


class DFlash:
    """A DFlash drafter drafting a block for every row (the decoder's drafter protocol).

    Args:
        drafter: the `Drafter` bound to the decoder's target.
        block_size: positions per block, the pending token included (drafts per round at most
            block_size - 1); None: the drafter's config.
        prefill_step: tokens per target forward when a joining row's context must be recomputed.
    """

    mode = "dflash"
    min_prob = 0.0
    draft_runtimes = False
    offers_rooms = True  # every row drafts from its context whatever the last token was
    blockwise = True  # one drafter forward per block, whatever the width

    def __init__(self, drafter: Drafter, *, block_size: int | None = None, prefill_step: int = 2048):
        self.drafter = drafter
        self.model = drafter.model
        self.block_size = int(block_size or drafter.cfg.block_size)
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block holds the pending token and at least one mask")
        self.mask_id = drafter.cfg.mask_token_id
        self.tap = install(drafter.model, drafter.cfg.target_layer_ids)
        self.prefill_step = prefill_step
        self.rows: dict = {}
        self._ids: list | None = None  # the open round's rows in the verify's order (None: no round)
        self._hidden: mx.array | None = None

    @property
    def segment_identity(self) -> bytes:
        return drafter_identity(self.drafter)

    # -- rows -------------------------------------------------------------------------

    def attach(self, runtime) -> None:
        """Give `runtime` this drafter's segment unless it carries a live one of it (then its
        forwards feed it, the store saves and resumes it, and `add` takes it)."""
        seg = runtime.drafters.get(ContextSegment.name)
        if seg is None or seg.stale or seg.identity != self.segment_identity:
            runtime.attach(ContextSegment(self.drafter))

    def add(self, row_id, history, runtime, draft_runtime):
        if draft_runtime is not None:
            raise ValueError(f"add({row_id!r}): a DFlash row takes no draft runtime")
        if runtime.model is not self.model:
            raise ValueError(f"add({row_id!r}): the runtime is not of the drafter's target")
        if row_id in self.rows:
            raise ValueError(f"add({row_id!r}): the DFlash drafter has a row with that id already")
        n = len(history) - 1
        row = _Row()
        seg = runtime.drafters.get(ContextSegment.name)
        if seg is not None and seg.offset == n and runtime.depth == 0 and seg.identity == self.segment_identity:
            keys, values, held, tail = seg.lend()  # no forward: the segment's rows and its last ctx
            if held:
                row.append(keys, values)
            if tail is not None:
                row.append(*self.drafter.context_kv(tail, held))
            row.tail = tail
        elif n:
            if None in history[:n]:
                raise ValueError(f"add({row_id!r}): the runtime holds tokens fed without Runtime.forward "
                                 "(ids unknown), which the DFlash drafter needs; use a fresh runtime")
            self._recompute(row, history[:n])
        self.rows[row_id] = row

    def _recompute(self, row: _Row, ids: list) -> None:
        """The context of `ids` from target forwards on a fresh mlx-lm cache (the tap records them)."""
        cache = make_prompt_cache(self.model)
        for i in range(0, len(ids), self.prefill_step):
            self.model(mx.array(ids[i : i + self.prefill_step], dtype=mx.uint32)[None], cache=cache)
            ctx = self.drafter.context(self.tap.take())
            row.append(*self.drafter.context_kv(ctx, row.n))
            row.tail = ctx[:, -1:]
            mx.eval(row.kv.keys, row.kv.values, row.tail)

    def remove(self, row_id):
        self.rows.pop(row_id, None)

    def hand_back(self, row_id, runtime, history: list, keep: int | None = None, fed=None) -> None:
        """Row `row_id` is released as `runtime`, holding its len(history) - 1 committed tokens (with
        `keep`, a round is open: the row keeps that many of its verify's tokens; with `fed` [1, 1, ...],
        the runtime holds the pending token too, fed by a lookahead whose tapped outputs those are):
        the runtime gets the row's context as a live `ContextSegment` (as the MTP head's drafter hands
        its state back), so what it publishes carries the context's records and a next turn on it (a
        hot conversation, serve/hot.py) joins with no forward. A context that does not account for
        what the runtime holds is not handed back (the runtime's segment stays stale, as before)."""
        row = self.rows.get(row_id)
        if row is None or runtime.depth:
            return
        more = None
        if keep and self._ids is not None and self._hidden is not None:
            more = self._hidden[self._ids.index(row_id)][None, :keep]  # the verify's outputs of kept tokens
        n = row.n
        if n + (keep or 0) != len(history) - 1:
            return
        seg = ContextSegment(self.drafter)
        try:
            if n:
                keys, values = row.context()
                seg.load(keys[..., : n - 1, :], values[..., : n - 1, :], n - 1, row.tail)
            if more is not None:
                seg.extend(more, history[n : n + keep])
            if fed is not None:
                seg.extend(fed, history[len(history) - 1 :])
        except Exception:  # nothing handed back is a stale segment, never a failed release
            return
        if seg.offset == runtime.offset:  # else it would not account for what the runtime holds
            runtime.attach(seg)

    # -- a round ------------------------------------------------------------------------

    def offer(self, states, rooms):
        return [min(room, self.block_size - 1) for room in rooms]

    def draft(self, states, widths):
        J = min(max(widths, default=0), self.block_size - 1)
        if J == 0:
            return no_draft(len(states))
        rows = [self.rows[s.row_id] for s in states]
        B = len(rows)
        self.open(states)
        block = mx.array([[s.history[-1]] + [self.mask_id] * J for s in states], dtype=mx.uint32)
        if B == 1:
            keys, values = rows[0].context()
            context = (keys, values, rows[0].n)
        else:
            context = self._padded(rows, J + 1)
        selector = self.drafter.selector
        if selector is None:
            logits = self.drafter.block(block, *context)
        else:  # DFlash2: each position's proposal rescored given the draft before it
            h = self.drafter.block_states(block, *context)
            logits, projected = self.drafter.logits(h), selector.project(h)
        processed = any(s.processors is not None for s in states)
        greedy = all(isinstance(s.acceptor, GreedyMatch) for s in states)
        if greedy and not processed and selector is None:  # one argmax for the batch
            tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
            mx.async_eval(tokens)
            return Draft(tokens, [min(w, J) for w in widths], [None] * B)
        chain, qs = [], [[] for _ in states]

        def select(lp, j):  # DFlash2: the selector's candidates given the draft before j (the pending token)
            return selector.rescore(lp, projected[:, j], chain[j - 1] if j else block[:, 0])

        for j in range(J):
            _, toks = draft_position(logits[:, j], states, widths, j, chain, qs, greedy=greedy, processed=processed,
                                     select=None if selector is None else select)
            chain.append(toks)
        tokens = mx.stack(chain, axis=1)
        mx.async_eval(tokens)
        return Draft(tokens, [min(w, J) for w in widths], [mx.stack(q) if q else None for q in qs])

    def open(self, states) -> None:
        """Open the round the decoder verifies next for `states` (in the verify's order), drafted or
        not: `close` appends the context of what each row keeps of that verify. `draft` opens it;
        a drafter proposing other rows' drafts (prompt lookup beside this one) opens it alone."""
        self._ids = [s.row_id for s in states]

    def _padded(self, rows: list, L: int) -> tuple:
        """(keys, values, offsets, mask) of rows whose contexts differ in length: right-padded to the
        longest, the pads masked out of every query's keys."""
        ns = [r.n for r in rows]
        C = max(ns)
        offsets = mx.array(ns, dtype=mx.int32)
        if C == 0:
            return None, None, offsets, None
        ks, vs = [], []
        for r in rows:
            k, v = r.context()
            if k is None:
                k0 = next(x for x in rows if x.n).kv.keys
                k = v = mx.zeros((1, k0.shape[1], 0, k0.shape[3]), dtype=k0.dtype)
            if k.shape[2] < C:
                pad = [(0, 0), (0, 0), (0, C - k.shape[2]), (0, 0)]
                k, v = mx.pad(k, pad), mx.pad(v, pad)
            ks.append(k)
            vs.append(v)
        keys, values = mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)
        if min(ns) == C:
            return keys, values, offsets, None
        cols = mx.arange(C + L)[None]
        mask = (cols < offsets[:, None]) | (cols >= C)
        return keys, values, offsets, mask[:, None, None, :]

    def fill(self, proposals):
        self._hidden = self.tap.take()  # the verify forward's tapped outputs, [B, 1 + J, m*H]

    def capture(self):
        return self.tap.take()

    def close(self, states, keep, fed=None):
        ids_now = [s.row_id for s in states]
        if self._ids is not None:
            hidden, ids = self._hidden, self._ids
        elif fed is not None:
            hidden, ids = fed
        else:
            hidden, ids = self.tap.take(), ids_now
        self._end()
        if ids != ids_now:
            hidden = hidden[mx.array([ids.index(r) for r in ids_now], dtype=mx.int32)]
        rows = [self.rows[r] for r in ids_now]
        T = max(keep, default=0)
        if not rows or T == 0:
            return
        offsets = mx.array([r.n for r in rows], dtype=mx.int32) if len(rows) > 1 else rows[0].n
        ctx = self.drafter.context(hidden[:, :T])
        keys, values = self.drafter.context_kv(ctx, offsets)
        for i, (r, k) in enumerate(zip(rows, keep)):
            r.append(keys[i : i + 1, :, :k], values[i : i + 1, :, :k])
            if k:
                r.tail = ctx[i : i + 1, k - 1 : k]

    def rollback(self):
        self._end()

    def _end(self) -> None:
        self._ids, self._hidden = None, None

    def extend(self, row_id, tokens: Sequence[int]):
        pass  # the context of those tokens comes at close, from the forward that fed them

    def check(self, states, settled: bool = True) -> None:
        """Between rounds: the drafter's rows are the decoder's, each holding the context of every
        token its target holds."""
        if not settled:
            return
        ids = [s.row_id for s in states]
        if sorted(map(repr, ids)) != sorted(map(repr, self.rows)):
            raise InvariantError(f"DFlash rows {list(self.rows)}, decoder rows {ids}")
        for s in states:
            n = self.rows[s.row_id].n
            if n != len(s.history) - 1:
                raise InvariantError(f"DFlash row {s.row_id!r} holds the context of {n} tokens, its target "
                                     f"{len(s.history) - 1}")
