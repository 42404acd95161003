"""MTP self-speculation: the target's own multi-token-prediction head as a drafter.

The drafter follows the decoder's protocol (batch/drafting.py). Per row it keeps the
head's KV cache and the target's hidden states it has not fed to the head yet:

    head cache:  pairs (hidden[p], token[p+1]) for p < held      committed
    tail:        hidden[held .. n-1]                              n: tokens the target holds

A round (row i, pending token y = token[n], k drafts):

    catch-up   head(tail, history[held+1 .. n]) in one call       exact pairs: kept
               -> d1 from its last position
    depth j    head(h'_(j-1), d_(j-1)) one position each          the head's own h': dropped
    verify     the target forwards [y, d1..dk] (the decoder); the tap keeps its hidden states
    close      the head's cache is cut back to the catch-up; the tail becomes the
               verify's hidden states of the kept tokens (1 + accepted)

so at every round's start the head holds exactly the pairs a head run on the
committed tokens with the target's own hidden states would hold (the pairs of
depth >= 2 are made of the head's hidden states and are never kept), as vLLM's
and SGLang's MTP workers do. The head's cache is one mlx-lm `KVCache` per head
layer and row, cut back by `trim` (exact: a KV cache is its first `offset`
entries); the drafter rolls it back itself (`rollback`), it is not a segment of
the target's runtime. A row's prompt pairs are fed when it joins, from the
hidden states its prefill collected (`HiddenStates`), else from a forward of
the prompt on a fresh cache.

Rows draft one after another (each row's head call has its own cache length);
every call stays lazy and the drafts of all rows are read with the verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..acceptors import GreedyMatch
from ..batch.drafting import Draft, each_row, no_draft
from ..errors import InvariantError
from ..processors import normalize
from .module import MTPHead, _text_parts
from .tap import install

# A row that does not draft for this many steps (the gate chose plain steps) feeds
# its tail to the head outside a round, so the tail stays short.
TAIL = 16


@dataclass
class HiddenStates:
    """The target's hidden states [m, H] of the last m tokens a runtime holds (what its
    prefill computed), handed to `BatchDecoder.add` as the row's `draft_runtime`."""

    hidden: mx.array

    def clone(self) -> "HiddenStates":
        """The same states (never written: rows of one prompt share them)."""
        return self


@dataclass
class _Row:
    """One row's head state. Invariant (no round open): every cache's offset is `held`,
    and held + len(tail) is the number of tokens the target's row holds."""

    cache: list
    held: int
    tail: mx.array | None  # [L, H] or None (L = 0)

    @property
    def lag(self) -> int:
        return 0 if self.tail is None else self.tail.shape[0]


def _trim(cache: list, offset: int) -> None:
    for c in cache:
        c.trim(c.offset - offset)


def _append(tail, new):
    if new.shape[0] == 0:
        return tail
    return new if tail is None else mx.concatenate([tail, new], axis=0)


class MTP:
    """The head of the target drafting for every row (the decoder's drafter protocol).

    Args:
        head: the target's `MTPHead` (its module and the target it is bound to).
        prefill_step: positions per head call (and per target forward when a row's
            prompt hidden states must be recomputed) when a row joins.
    """

    mode = "mtp"
    min_prob = 0.0
    draft_runtimes = True  # the prefill's HiddenStates

    def __init__(self, head: MTPHead, *, prefill_step: int = 2048):
        self.head = head
        self.model = head.model
        self.tap = install(head.model)
        self.prefill_step = prefill_step
        self.rows: dict = {}
        # The open round: row ids in the verify's order, the drafted rows' state before it
        # ({id: (held, tail, offsets)}), and the cache offset each drafted row keeps at close.
        self._ids: list | None = None
        self._saved: dict = {}
        self._keep: dict = {}
        self._hidden: mx.array | None = None  # the verify's hidden states, taken by fill

    # -- rows -------------------------------------------------------------------------

    def add(self, row_id, history, runtime, draft_runtime):
        if draft_runtime is not None and not isinstance(draft_runtime, HiddenStates):
            raise ValueError(f"add({row_id!r}): an MTP row takes the prefill's HiddenStates, not "
                             f"{type(draft_runtime).__name__}")
        if runtime.model is not self.model:
            raise ValueError(f"add({row_id!r}): the runtime is not of the head's target")
        n = len(history) - 1
        if None in history[:n]:
            raise ValueError(f"add({row_id!r}): the runtime holds tokens fed without Runtime.forward "
                             "(ids unknown), which the MTP head needs; use a fresh runtime")
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
        cache = self.head.make_cache()
        row = _Row(cache, 0, hidden)
        self._feed(row, history)
        self.rows[row_id] = row

    def remove(self, row_id):
        self.rows.pop(row_id, None)
        self._saved.pop(row_id, None)

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

    def _feed(self, row: _Row, history: list) -> None:
        """Feed the head every pair of the row's tail but the last (outside any round)."""
        lag = row.lag
        if lag <= 1:
            return
        tail, held = row.tail, row.held
        for i in range(0, lag - 1, self.prefill_step):
            j = min(i + self.prefill_step, lag - 1)
            toks = mx.array(history[held + i + 1 : held + j + 1], dtype=mx.uint32)[None]
            _, h = self.head(tail[None, i:j], toks, row.cache)
            mx.eval(h, [c.keys_and_values() for c in row.cache])
        row.held, row.tail = held + lag - 1, tail[lag - 1 :]

    # -- a round ------------------------------------------------------------------------

    def offer(self, states, rooms):
        return [room if self.rows[s.row_id].lag else 0 for s, room in zip(states, rooms)]

    def draft(self, states, widths):
        J = max(widths, default=0)
        if J == 0:
            return no_draft(len(states))
        greedy = all(isinstance(s.acceptor, GreedyMatch) for s in states)
        self._ids = [s.row_id for s in states]
        self._saved, self._keep = {}, {}
        chains, qs = [], []
        try:
            for i, (s, w) in enumerate(zip(states, widths)):
                if w == 0:
                    chains.append(mx.zeros((J,), dtype=mx.uint32))
                    qs.append(None)
                    continue
                chain, q = each_row([s], lambda _, s: self._chain(s, w, greedy))[0]
                if w < J:
                    chain = mx.concatenate([chain, mx.zeros((J - w,), dtype=mx.uint32)])
                chains.append(chain)
                qs.append(q)
        except BaseException:
            self.rollback()
            raise
        tokens = mx.stack(chains)  # [B, J]
        mx.async_eval(tokens)
        return Draft(tokens, list(widths), qs)

    def _chain(self, s, w: int, greedy: bool):
        """Row `s`'s w drafts (lazy, uint32 [w]) and the distributions they were drawn from."""
        row = self.rows[s.row_id]
        self._saved[s.row_id] = (row.held, row.tail, [c.offset for c in row.cache])
        lag = row.lag
        toks = mx.array(s.history[row.held + 1 : row.held + lag + 1], dtype=mx.uint32)[None]
        logits, h = self.head(row.tail[None], toks, row.cache)
        row.held, row.tail = row.held + lag, None
        self._keep[s.row_id] = row.held
        logits, h = logits[:, -1:], h[:, -1:]
        chain, q = [], []
        for j in range(w):
            raw = logits[0, 0]
            if s.processors is None:
                lp = normalize(raw)
            else:
                lp = s.processors.process_next(raw, s.history, mx.stack(chain) if chain else ())[0]
            if greedy:
                tok = mx.argmax(lp, axis=-1)
            else:
                tok, dist = s.acceptor.propose(lp)
                if dist is not None:
                    q.append(dist)
            tok = tok.astype(mx.uint32)
            chain.append(tok)
            if j + 1 < w:
                logits, h = self.head(h, tok.reshape(1, 1), row.cache, depth=j + 1)
        return mx.stack(chain), (mx.stack(q) if q else None)

    def fill(self, proposals):
        self._hidden = self.tap.take()  # the verify forward's, [B, 1 + J, H]

    def close(self, states, keep):
        if self._hidden is not None:
            hidden, ids = self._hidden, self._ids
        else:  # a plain step: the forward that just ran fed every row its pending token
            hidden, ids = self.tap.take(), [s.row_id for s in states]
        for s, k in zip(states, keep):
            row = self.rows[s.row_id]
            if s.row_id in self._keep:
                _trim(row.cache, self._keep[s.row_id])
            row.tail = _append(row.tail, hidden[ids.index(s.row_id), :k])
            if row.lag > TAIL:
                self._feed(row, s.history)
        self._end()

    def rollback(self):
        for rid, (held, tail, offsets) in self._saved.items():
            row = self.rows.get(rid)
            if row is not None:
                for c, offset in zip(row.cache, offsets):
                    c.trim(c.offset - offset)
                row.held, row.tail = held, tail
        self._end()

    def _end(self) -> None:
        self._ids, self._saved, self._keep, self._hidden = None, {}, {}, None

    def extend(self, row_id, tokens: Sequence[int]):
        pass  # the row's history (the decoder's) has them; its hidden states come at close

    def check(self, states, settled: bool = True) -> None:
        """Between rounds: each row's head holds `held` pairs and held + tail = the target's tokens."""
        for s in states if settled else ():
            row = self.rows.get(s.row_id)
            if row is None:
                raise InvariantError(f"MTP: no head state for row {s.row_id!r}")
            if any(c.offset != row.held for c in row.cache):
                raise InvariantError(f"MTP row {s.row_id!r}: head caches at {[c.offset for c in row.cache]}, "
                                     f"not its {row.held} pairs")
            if row.held + row.lag != len(s.history) - 1:
                raise InvariantError(f"MTP row {s.row_id!r}: {row.held} pairs + {row.lag} hidden states "
                                     f"for {len(s.history) - 1} tokens")
