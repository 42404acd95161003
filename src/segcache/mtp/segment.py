"""The MTP head's state over batched rows: one head call per depth for every row.

    HeadRows of B rows (row i of every array is ids[i])
      layers[0]   HeadKV: the head's K/V, row i valid on [0, lengths[i]), lengths[i] == held[i]:
                  the pairs (hidden[p], token[p+1]) for p < held[i], hidden the target's own
      tail        [B, T, H]: row i's hidden[held[i] .. held[i] + lags[i]) at [i, :lags[i]],
                  the target's states not fed to the head yet (past lags[i]: padding)
      held[i] + lags[i] == the tokens row i's target holds

A round is a branch of the head's layers, as a round is a branch of the target's:

    fork ─ catch_up(feeds)   one call: row i feeds feeds[i] pairs of its tail (a drafting row
                             all of them, d1 from its last; the others all but the last)
         ─ depth(h, d, j)    one call, one position per row: the head's own h' (dropped)
         ─ ... the target verifies ...
         ─ close(hidden, keep)   the layers keep the catch-up's pairs only (commit_rows(feeds));
                                 row i's tail gains the verify's hidden[i, :keep[i]]
         | rollback()            everything as at the fork

Rows differ in length, so a call's rows are right-padded to its longest feed;
a pad writes K/V past its row's end, where the row's mask never looks and the
next write lands, and its outputs are never read. Where every row has one
length (one row, or rows that joined together) the head's attention runs
exactly mlx-lm's `KVCache` path (an int RoPE offset, its causal mask), so a row
alone drafts bit for bit what the single-row head drafts; rows of different
lengths attend through a per-row mask over the longest row's keys, which may
round float32 sums differently (the batches' documented tolerance, docs/batching.md).

A head with several layers uses layer `depth % n` at depth `depth`; the exact
pairs are layer 0's, and a deeper layer holds only what the open round's depth
calls wrote (nothing between rounds).

This is the shape of a drafter segment of a batched runtime (a KV kind that
forks, commits and rolls back with the target's rows, one behind it, with the
not-yet-fed hidden states as part of its state): the head's layers are
`BatchKVLayer`s and their branches are the layers' own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from ..errors import BranchError, InvariantError
from ..layers.kv import BatchKVLayer
from .module import MTPHead


class HeadKV(BatchKVLayer):
    """A batched KV layer of the head: rows of one length take mlx-lm's `KVCache` path
    (an int offset, `KVCache`'s mask), rows of different lengths a per-row offset and mask;
    a ragged multi-position write is one scatter."""

    @property
    def offset(self):
        if len(set(self.lengths)) == 1:
            return self.lengths[0]
        return mx.array(self.lengths, dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if len(set(self.lengths)) == 1:
            return create_attention_mask(N, self.lengths[0], return_array, window_size)
        return super().make_mask(N, return_array=return_array, window_size=window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, S, _ = keys.shape
        if S == 1 or len(set(self.lengths)) == 1:
            return super().update_and_fetch(keys, values)
        end = max(self.lengths) + S
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(B, H, end, keys, values)
        rows = mx.arange(B)[:, None, None]
        heads = mx.arange(H)[None, :, None]
        at = mx.array(self.lengths, dtype=mx.int32)[:, None, None] + mx.arange(S)[None, None, :]
        self.keys[rows, heads, at] = keys
        self.values[rows, heads, at] = values
        self.lengths = [L + S for L in self.lengths]
        return self.keys[..., :end, :], self.values[..., :end, :]


class _LastQuery:
    """A read-only view of a head layer for one query per row at its last pair (position
    lengths[i] - 1), attending the keys the layer holds for it: `update_and_fetch` returns the
    buffer and writes nothing (the pair's K/V are in it already)."""

    def __init__(self, layer: HeadKV):
        self.layer = layer
        self.ends = list(layer.lengths)

    def __bool__(self) -> bool:  # models test `if cache`
        return True

    @property
    def offset(self):
        at = [max(L - 1, 0) for L in self.ends]
        return at[0] if len(set(at)) == 1 else mx.array(at, dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if len(set(self.ends)) == 1:
            return None  # one query per row over exactly its keys
        T = max(self.ends)
        return (mx.arange(T)[None, :] < mx.array(self.ends, dtype=mx.int32)[:, None])[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        T = max(self.ends)
        return self.layer.keys[..., :T, :], self.layer.values[..., :T, :]


@dataclass
class _Base:
    """The state at a round's fork, per row (what `rollback` restores)."""

    held: list
    lags: list
    tail: mx.array | None


def _tail_take(tail: mx.array | None, lags: list, index: list) -> mx.array | None:
    """Rows `index` of `tail` (None when no row keeps a state)."""
    if tail is None or not index or not any(lags[i] for i in index):
        return None
    return tail[mx.array(index, dtype=mx.int32)]


def _merge(tail: mx.array | None, lags: list, new: mx.array, counts: list) -> tuple:
    """Row i's tail followed by new[i, :counts[i]]: one gather. Returns (tail, lags)."""
    out = [a + c for a, c in zip(lags, counts)]
    if tail is None or not any(lags):
        return (new if any(counts) else None), out
    T, K = tail.shape[1], new.shape[1]
    width = max(out)
    if width == 0:
        return None, out
    both = mx.concatenate([tail, new.astype(tail.dtype)], axis=1)
    # position t of row i: its old tail while t < lags[i], then new[i, t - lags[i]] (pads clamped)
    idx = [[t if t < a else min(T + t - a, T + K - 1) for t in range(width)] for a in lags]
    return mx.take_along_axis(both, mx.array(idx, dtype=mx.int32)[:, :, None], axis=1), out


def _shift(tail: mx.array, lags: list, fed: list) -> tuple:
    """Row i's tail without its first fed[i] states. Returns (tail, lags)."""
    out = [a - n for a, n in zip(lags, fed)]
    width = max(out, default=0)
    if width == 0:
        return None, out
    if not any(fed):
        return tail, out
    T = tail.shape[1]
    idx = [[min(t + n, T - 1) for t in range(width)] for n in fed]
    return mx.take_along_axis(tail, mx.array(idx, dtype=mx.int32)[:, :, None], axis=1), out


class HeadRows:
    """The head's attention cache and unfed hidden states of every row (see the module docstring).

    Args:
        head: the target's `MTPHead`.
    """

    def __init__(self, head: MTPHead):
        self.head = head
        self.ids: list = []
        # layers[l]: head layer l's K/V. Invariant: no round open <=> no layer has marks; then
        # layers[0].lengths == held and every deeper layer's lengths are 0.
        self.layers = [HeadKV() for _ in range(head.num_layers)]
        self.held: list[int] = []  # row i: exact pairs in layers[0]
        self.lags: list[int] = []  # row i: hidden states in tail[i] not fed yet
        # (between rounds held[i] + lags[i] is the number of tokens row i's target holds: check(tokens))
        self.tail: mx.array | None = None  # [B, T >= max(lags), H]; None iff every lag is 0
        self._base: _Base | None = None  # the open round's fork (None: no round)
        self._fed: list[int] | None = None  # the open round's catch-up: pairs each row keeps

    @property
    def forked(self) -> bool:
        return self._base is not None

    def index(self, row_id) -> int:
        return self.ids.index(row_id)

    # -- rows ---------------------------------------------------------------------------

    def join(self, row_id, hidden: mx.array | None, history: list, step: int) -> None:
        """A row whose target holds len(history) - 1 tokens, `hidden` [n, H] their states (None
        if it holds none): the head is fed every pair but the last here, in calls of `step`
        positions on a cache of its own (exactly the single-row head), then the row joins."""
        if self.forked:
            raise BranchError(f"join({row_id!r}) with a round open: close or roll it back first")
        n = 0 if hidden is None else hidden.shape[0]
        if n != len(history) - 1:
            raise ValueError(f"join({row_id!r}): {n} hidden states for {len(history) - 1} tokens")
        cache = self.head.make_cache()
        for i in range(0, n - 1, step):
            j = min(i + step, n - 1)
            toks = mx.array(history[i + 1 : j + 1], dtype=mx.uint32)[None]
            self.head(hidden[None, i:j], toks, cache)
            mx.eval(cache[0].keys_and_values())  # the K/V only: the layer's output is never read
        held = max(n - 1, 0)
        keys, values = cache[0].keys_and_values() if held else (None, None)
        self._add(row_id, keys, values, None if n == 0 else hidden[None, held:])

    def join_state(self, row_id, keys: mx.array | None, values: mx.array | None, tail: mx.array | None) -> None:
        """A row whose head state its runtime's drafter segment kept (`HeadSegment.lend`): the K/V of
        its pairs [1, h, held, D] (None: none) and the hidden state of its last token [1, 1, H]
        (None: it holds no token). No head call: the pairs were computed as the row's tokens were."""
        if self.forked:
            raise BranchError(f"join_state({row_id!r}) with a round open: close or roll it back first")
        self._add(row_id, keys, values, tail)

    def _add(self, row_id, keys, values, row) -> None:
        """Append a row of `keys`/`values` pairs in layer 0 (None: none) and the tail `row` [1, 1, H]."""
        held = 0 if keys is None else keys.shape[2]
        for layer in self.layers:
            if layer is self.layers[0] and held:
                layer.add_row(keys, values)
            else:
                layer.add_row(None, None)
        if self.tail is None:
            if row is not None:
                self.tail = mx.concatenate([mx.zeros((len(self.ids), 1, row.shape[2]), row.dtype), row]) \
                    if self.ids else row
        else:
            T = self.tail.shape[1]
            new = mx.zeros((1, T, self.tail.shape[2]), self.tail.dtype)
            if row is not None:
                new[:, :1] = row.astype(self.tail.dtype)
            self.tail = mx.concatenate([self.tail, new])
        self.ids.append(row_id)
        self.held.append(held)
        self.lags.append(0 if row is None else 1)

    def row_state(self, row_id, more: mx.array | None = None) -> tuple:
        """Row `row_id`'s state alone: (keys [1, h, held, D] or None, values, held, unfed [1, m, H] or
        None): its exact pairs and its hidden states not fed yet, then `more` [1, k, H] (an open
        round's kept states, not merged yet). In a round, the catch-up's pairs are its exact ones."""
        i = self.index(row_id)
        held, lag = self.held[i], self.lags[i]
        keys = values = None
        if held:
            layer = self.layers[0]
            keys, values = layer.keys[i : i + 1, :, :held], layer.values[i : i + 1, :, :held]
        unfed = self.tail[i : i + 1, :lag] if lag else None
        if more is not None and more.shape[1]:
            unfed = more if unfed is None else mx.concatenate([unfed, more.astype(unfed.dtype)], axis=1)
        return keys, values, held, unfed

    def leave(self, row_id) -> None:
        """The row goes (with its part of an open round)."""
        i = self.index(row_id)
        self.take([j for j in range(len(self.ids)) if j != i])

    def take(self, index: Sequence[int]) -> None:
        """Keep rows `index`, in that order (a round's fork included)."""
        index = list(index)
        for layer in self.layers:
            layer.take(index)
        self.tail = _tail_take(self.tail, self.lags, index)
        self.ids = [self.ids[i] for i in index]
        self.held = [self.held[i] for i in index]
        self.lags = [self.lags[i] for i in index]
        if self._base is not None:
            b = self._base
            self._base = _Base([b.held[i] for i in index], [b.lags[i] for i in index],
                               _tail_take(b.tail, b.lags, index))
        if self._fed is not None:
            self._fed = [self._fed[i] for i in index]

    def order(self, ids: list) -> None:
        """Put the rows in the order `ids` (the same rows)."""
        if ids != self.ids:
            if sorted(map(repr, ids)) != sorted(map(repr, self.ids)):
                raise InvariantError(f"MTP head rows {self.ids}, asked for rows {ids}")
            self.take([self.ids.index(r) for r in ids])

    # -- feeding ------------------------------------------------------------------------

    def _feed(self, feeds: list[int], histories: list) -> mx.array | None:
        """One head call at depth 0: row i feeds its first feeds[i] unfed pairs. Returns the head's
        states [B, max(feeds), H] (row i's valid on [:feeds[i]]), None when no row feeds."""
        S = max(feeds, default=0)
        if S == 0:
            return None
        toks = [list(h[b + 1 : b + 1 + n]) + [0] * (S - n) for h, b, n in zip(histories, self.held, feeds)]
        layer = self.layers[0]
        before = list(layer.lengths)
        _, h = self.head(self.tail[:, :S], mx.array(toks, dtype=mx.uint32), self.layers)
        layer.lengths = [L + n for L, n in zip(before, feeds)]  # pads lie past each row's end
        self.held = [b + n for b, n in zip(self.held, feeds)]
        self.tail, self.lags = _shift(self.tail, self.lags, feeds)
        return h

    def feed_tails(self, histories: list, longer_than: int) -> None:
        """Outside a round: if some row's tail is longer than `longer_than`, every row feeds all of
        its tail but the last state (the pair the next round's catch-up drafts from), in one call."""
        if self.forked:
            raise BranchError("feed_tails() with a round open")
        if max(self.lags, default=0) > longer_than:
            self._feed([max(a - 1, 0) for a in self.lags], histories)
            # computed now, on the plain step that fed it: left lazy it would be computed by the
            # next round's catch-up, whose step (the gate's probe) would then look that much dearer
            mx.async_eval(self.layers[0].keys, self.layers[0].values)

    # -- a round ------------------------------------------------------------------------

    def fork(self) -> None:
        if self.forked:
            raise BranchError("fork(): the head's round is open already")
        for layer in self.layers:
            layer.fork()
        self._base = _Base(list(self.held), list(self.lags), self.tail)

    def catch_up(self, drafting: list[bool], histories: list) -> mx.array:
        """The round's first call: a drafting row feeds its whole tail, the others all but the
        last state. Returns the head's state at each drafting row's last pair, [B, 1, H] (the
        others' rows are padding)."""
        if not self.forked or self._fed is not None:
            raise BranchError("catch_up() outside a freshly forked round")
        if any(d and a == 0 for d, a in zip(drafting, self.lags)):
            raise InvariantError("catch_up(): a drafting row has no hidden state to draft from")
        feeds = [a if d else max(a - 1, 0) for d, a in zip(drafting, self.lags)]
        S = max(feeds)
        toks = [list(h[b + 1 : b + 1 + n]) + [0] * (S - n) for h, b, n in zip(histories, self.held, feeds)]
        module, layer = self.head.module, self.layers[0]
        before = list(layer.lengths)
        z = module.combine(self.head.embed(mx.array(toks, dtype=mx.uint32)), self.tail[:, :S])
        # every pair's K/V (the layer's output here is never read, so only the K/V are computed) ...
        module.run_layer(z, 0, self.layers[0])
        layer.lengths = [L + n for L, n in zip(before, feeds)]  # pads lie past each row's end
        self.held = [b + n for b, n in zip(self.held, feeds)]
        self.tail, self.lags = _shift(self.tail, self.lags, feeds)
        self._fed = feeds
        # ... and the layer's output at each row's last pair only: one query per row
        last = mx.array([max(n - 1, 0) for n in feeds], dtype=mx.int32)[:, None, None]
        return module.run_layer(mx.take_along_axis(z, last, axis=1), 0, _LastQuery(layer))

    def depth(self, h: mx.array, tokens: mx.array, depth: int) -> tuple:
        """One position per row on the head's own states `h` [B, 1, H] and drafts `tokens` [B, 1]:
        (logits [B, 1, V], h'). Written past the catch-up: dropped at close."""
        if self._fed is None:
            raise BranchError("depth() before the round's catch_up()")
        return self.head(h, tokens, self.layers, depth=depth)

    def close(self, hidden: mx.array | None, keep: list[int]) -> None:
        """End the round (or a plain step when none is open): the layers keep the catch-up's pairs;
        row i's tail gains hidden[i, :keep[i]] (the target's states of the tokens it kept)."""
        if self.forked:
            fed = self._fed or [0] * len(self.ids)
            self.layers[0].commit_rows(fed)
            for layer in self.layers[1:]:
                layer.commit_rows([0] * len(self.ids))
            self._base = self._fed = None
        if hidden is not None and any(keep):
            self.tail, self.lags = _merge(self.tail, self.lags, hidden, list(keep))

    def rollback(self) -> None:
        """Drop the open round: rows, lengths and tails as at the fork."""
        if not self.forked:
            return
        for layer in self.layers:
            layer.rollback()
        b = self._base
        self.held, self.lags, self.tail = b.held, b.lags, b.tail
        self._base = self._fed = None

    # -- invariants -----------------------------------------------------------------------

    def check(self, tokens: list[int] | None = None) -> None:
        """The invariants between rounds; with `tokens` (what each row's target holds), that
        held + lags equals it."""
        B = len(self.ids)
        if self.forked or any(layer.marks is not None for layer in self.layers):
            raise InvariantError("MTP head: a round is open (check between rounds)")
        if len(self.held) != B or len(self.lags) != B or len(set(map(repr, self.ids))) != B:
            raise InvariantError(f"MTP head: {B} rows, {len(self.held)} held counts, {len(self.lags)} lags")
        for layer in self.layers:
            layer.check()
            if len(layer.lengths) != B:
                raise InvariantError(f"MTP head layer of {len(layer.lengths)} rows for {B}")
        if self.layers[0].lengths != self.held:
            raise InvariantError(f"MTP head: layer 0 holds {self.layers[0].lengths} pairs, rows {self.held}")
        if any(any(layer.lengths) for layer in self.layers[1:]):
            raise InvariantError("MTP head: a deeper layer holds pairs between rounds")
        if any(a < 0 for a in self.lags) or (self.tail is None) != (not any(self.lags)):
            shape = None if self.tail is None else self.tail.shape
            raise InvariantError(f"MTP head: lags {self.lags} but tail {shape}")
        if self.tail is not None and (self.tail.shape[0] != B or self.tail.shape[1] < max(self.lags)):
            raise InvariantError(f"MTP head: tail {self.tail.shape} does not hold lags {self.lags}")
        if tokens is not None:
            got = [h + a for h, a in zip(self.held, self.lags)]
            if got != list(tokens):
                raise InvariantError(f"MTP head rows {self.ids}: {self.held} pairs + {self.lags} hidden states, "
                                     f"for targets holding {list(tokens)} tokens")
