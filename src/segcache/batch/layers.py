"""Batched segment kinds: B rows in one cache, each with its own length and branch.

KV keeps per-row lengths in one buffer; a row's tokens sit at [0, length):

    row 0  [ a a a a a . . . ]      lengths = [5, 3]
    row 1  [ b b b . . . . . ]      a forward of S writes row i at [L_i, L_i + S)
                                    and query t of row i sees keys j <= L_i + t

so rows never shift and RoPE takes the per-row offsets (as mlx-lm's
BatchKVCache does with left padding). Recurrent layers hold [B, ...] conv
tails and states; an empty row holds zeros, which is what mlx-lm's module
starts from when its cache holds None, so merging empty and populated rows
keeps every row exactly.

Rows of a ragged forward are padded on the right, and only inside a branch:
padding never reaches a committed state, because `commit_rows` rebuilds each
row from exactly its first n_i recorded tokens (KV: the length; recurrent:
the conv inputs and recurrence inputs recorded per row, sliced to n_i).
One branch level (what a speculative round needs).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import BranchError, InvariantError, UnsupportedOperationError
from ..layers.kept_states import first_records
from ..layers.recurrent import RecurrentLayer, Steps, _RecurrentMark


def _take(a, idx: mx.array):
    return None if a is None else a[idx]


class RowLengths:
    """Attention rows with per-row lengths whose branches are those lengths (KV, window).

    Needs `lengths` (tokens per row), `marks` (each row's length when the
    open branch began, None without one; a branch's rows lie past its marks)
    and `keys` / `values` ([B, H, T, D] or None).
    """

    lengths: list[int]
    marks: list[int] | None

    @property
    def offset(self) -> mx.array:
        """Per-row positions, [B] (RoPE offsets the rows by them)."""
        return mx.array(self.lengths, dtype=mx.int32)

    def __bool__(self) -> bool:  # models test `if cache`
        return True

    def fork(self) -> None:
        self.marks = list(self.lengths)

    def commit_rows(self, ns: Sequence[int]) -> None:
        self.lengths = [m + n for m, n in zip(self.marks, ns)]
        self.marks = None

    def rollback(self) -> None:
        self.lengths, self.marks = self.marks, None

    def take(self, rows: Sequence[int]) -> None:
        """Keep `rows` (in that order), their branch marks included."""
        rows = list(rows)
        self.lengths = [self.lengths[i] for i in rows]
        if self.marks is not None:
            self.marks = [self.marks[i] for i in rows]
        if self.keys is not None:
            if not rows:
                self.keys = self.values = None
            else:
                idx = mx.array(rows, dtype=mx.int32)
                self.keys, self.values = self.keys[idx], self.values[idx]


class BatchKVLayer(RowLengths):
    """Full attention over B rows with per-row lengths (mlx-lm's cache protocol for the model)."""

    step = 256

    def __init__(self, rows: int = 0):
        self.keys = None  # [B, H, T, D]; row i valid on [0, lengths[i])
        self.values = None
        self.lengths: list[int] = [0] * rows
        # marks[i]: row i's length when the open branch began (None: no branch).
        self.marks: list[int] | None = None

    # -- the protocol the model speaks ----------------------------------------------

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs) -> mx.array:
        T = max(self.lengths) + N
        q = mx.array(self.lengths, dtype=mx.int32)[:, None, None] + mx.arange(N)[None, :, None]
        keys = mx.arange(T)[None, None, :]
        mask = keys <= q
        if window_size is not None:  # as mlx-lm's KVCache given a window: the last window_size keys
            mask = mask & (keys > q - window_size)
        return mask[:, None]  # [B, 1, N, T]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, S, _ = keys.shape
        end = max(self.lengths) + S
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(B, H, end, keys, values)
        if len(set(self.lengths)) == 1:
            L = self.lengths[0]
            self.keys[..., L : L + S, :] = keys
            self.values[..., L : L + S, :] = values
        elif S == 1:  # a decode step of rows at different lengths: one scatter, not one update per row
            rows = mx.arange(B)[:, None]
            heads = mx.arange(H)[None, :]
            at = mx.array(self.lengths, dtype=mx.int32)[:, None]
            self.keys[rows, heads, at] = keys[:, :, 0, :]
            self.values[rows, heads, at] = values[:, :, 0, :]
        else:
            for i, L in enumerate(self.lengths):
                self.keys[i : i + 1, :, L : L + S, :] = keys[i : i + 1]
                self.values[i : i + 1, :, L : L + S, :] = values[i : i + 1]
        self.lengths = [L + S for L in self.lengths]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(self, B, H, end, keys, values) -> None:
        size = (end + self.step - 1) // self.step * self.step
        k = mx.zeros((B, H, size, keys.shape[3]), keys.dtype)
        v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
        if self.keys is not None:
            T = self.keys.shape[2]
            k[..., :T, :] = self.keys
            v[..., :T, :] = self.values
        self.keys, self.values = k, v

    # -- rows ----------------------------------------------------------------------


    def row_state(self, i: int) -> tuple:
        """(keys, values) of row i's first `lengths[i]` tokens, [1, H, L, D] copies, or (None, None)."""
        L = self.lengths[i]
        if self.keys is None or L == 0:
            return None, None
        return self.keys[i : i + 1, :, :L, :] * 1, self.values[i : i + 1, :, :L, :] * 1

    def add_row(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Append a row holding `keys`/`values` ([1, H, L, D]) or nothing; outside a branch."""
        L = 0 if keys is None else keys.shape[2]
        if keys is not None:
            B = len(self.lengths)
            if self.keys is None:
                size = (L + self.step) // self.step * self.step
                self.keys = mx.zeros((B, keys.shape[1], size, keys.shape[3]), keys.dtype)
                self.values = mx.zeros((B, values.shape[1], size, values.shape[3]), values.dtype)
            self._fit(L)
            row_k = mx.zeros((1, *self.keys.shape[1:]), keys.dtype)
            row_v = mx.zeros((1, *self.values.shape[1:]), values.dtype)
            row_k[..., :L, :] = keys
            row_v[..., :L, :] = values
            self.keys = mx.concatenate([self.keys, row_k])
            self.values = mx.concatenate([self.values, row_v])
        elif self.keys is not None:
            self.keys = mx.concatenate([self.keys, mx.zeros((1, *self.keys.shape[1:]), self.keys.dtype)])
            self.values = mx.concatenate([self.values, mx.zeros((1, *self.values.shape[1:]), self.values.dtype)])
        self.lengths.append(L)

    def _fit(self, L: int) -> None:
        if L > self.keys.shape[2]:
            extra = (L - self.keys.shape[2] + self.step - 1) // self.step * self.step
            pad = lambda a: mx.concatenate([a, mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)], axis=2)
            self.keys, self.values = pad(self.keys), pad(self.values)

    def check(self) -> None:
        where = f"BatchKVLayer(lengths={self.lengths}, marks={self.marks})"
        if any(L < 0 for L in self.lengths):
            raise InvariantError(f"{where}: negative length")
        if self.marks is not None and (
            len(self.marks) != len(self.lengths) or any(m > L for m, L in zip(self.marks, self.lengths))
        ):
            raise InvariantError(f"{where}: a branch begins past its row's end")
        if self.keys is None:
            if any(self.lengths):
                raise InvariantError(f"{where}: tokens counted but no buffer")
            return
        if self.keys.shape[0] != len(self.lengths) or max(self.lengths, default=0) > self.keys.shape[2]:
            raise InvariantError(f"{where}: buffer {self.keys.shape} does not hold the rows")

    # -- mlx-lm's batch-cache protocol (KVCache.merge, BatchGenerator) ----------------------
    #
    # mlx-lm's BatchKVCache left-pads rows; this layer keeps rows where they are
    # (per-row lengths), so merging, filtering and extending never shift a row,
    # and a row extracted is bit for bit the tokens it was merged with or fed.

    _finalized: list[int] | None = None  # row lengths once a padded forward is done (prepare -> finalize)

    @classmethod
    def merge(cls, caches) -> "BatchKVLayer":
        """One row per cache (`KVLayer`s, or `WindowLayer`s that dropped no token), in order.

        An empty cache is a row of length 0. The buffer is as long as the longest
        row (mlx-lm's merged keys have that shape too); the next forward grows it.

        Raises:
            BranchError: a cache has an open branch (its rows are not settled); nothing changed.
            UnsupportedOperationError: the caches are of different kinds, hold more than
                one row, or a window dropped tokens (a full-attention row cannot hold it).
        """
        rows = [_settled_rows(c) for c in caches]
        if len({type(c) for c in caches}) > 1:
            raise UnsupportedOperationError(
                f"merge() of {sorted({type(c).__name__ for c in caches})}: merge caches of one kind"
            )
        layer = cls(len(rows))
        full = [r for r in rows if r is not None]
        if not full:
            return layer
        T = max(k.shape[2] for k, _ in full)
        H, Dk, Dv, dtype = full[0][0].shape[1], full[0][0].shape[3], full[0][1].shape[3], full[0][0].dtype
        layer.keys = mx.zeros((len(rows), H, T, Dk), dtype)
        layer.values = mx.zeros((len(rows), H, T, Dv), dtype)
        for i, r in enumerate(rows):
            if r is not None:
                L = r[0].shape[2]
                layer.keys[i : i + 1, :, :L, :] = r[0]
                layer.values[i : i + 1, :, :L, :] = r[1]
                layer.lengths[i] = L
        return layer

    def extract(self, idx: int):
        """Row `idx` as a `KVLayer` holding its own copy of the row's tokens.

        Raises:
            BranchError: a branch is open (its rows are not settled).
        """
        from ..layers.kv import KVLayer

        self._settled("extract")
        out = KVLayer()
        L = self.lengths[idx]
        if L:
            out.keys = mx.contiguous(self.keys[idx : idx + 1, :, :L, :])
            out.values = mx.contiguous(self.values[idx : idx + 1, :, :L, :])
            out.offset = L
        return out

    def filter(self, batch_indices) -> None:
        """Keep the rows `batch_indices` (a list or an mx.array of ints), in that order."""
        self._settled("filter")
        rows = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.take([int(i) for i in rows])

    def extend(self, other: "BatchKVLayer") -> None:
        """Append `other`'s rows after this layer's (both settled, one head layout)."""
        self._settled("extend")
        other._settled("extend")
        if other.keys is not None and self.keys is not None:
            T = max(self.keys.shape[2], other.keys.shape[2])
            pad = lambda a: a if a.shape[2] == T else mx.concatenate(
                [a, mx.zeros((*a.shape[:2], T - a.shape[2], a.shape[3]), a.dtype)], axis=2
            )
            self.keys = mx.concatenate([pad(self.keys), pad(other.keys)])
            self.values = mx.concatenate([pad(self.values), pad(other.values)])
        elif other.keys is not None:
            B = len(self.lengths)
            self.keys = mx.concatenate([mx.zeros((B, *other.keys.shape[1:]), other.keys.dtype), other.keys])
            self.values = mx.concatenate([mx.zeros((B, *other.values.shape[1:]), other.values.dtype), other.values])
        elif self.keys is not None:
            B = len(other.lengths)
            self.keys = mx.concatenate([self.keys, mx.zeros((B, *self.keys.shape[1:]), self.keys.dtype)])
            self.values = mx.concatenate([self.values, mx.zeros((B, *self.values.shape[1:]), self.values.dtype)])
        self.lengths = self.lengths + other.lengths

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a right-padded forward (BatchGenerator): row i feeds `lengths[i]` real tokens.

        Pads land past a row's end, so only the lengths change: `finalize` sets them.
        """
        self._settled("prepare")
        if left_padding is not None and any(int(p) for p in _ints(left_padding)):
            raise UnsupportedOperationError(
                "prepare(left_padding=...): this layer keeps per-row lengths and never left-pads; "
                "right-pad the rows (prepare(lengths=..., right_padding=...))"
            )
        if lengths is not None:
            self._finalized = [L + n for L, n in zip(self.lengths, _ints(lengths))]

    def finalize(self) -> None:
        """After the padded forward(s): each row holds its real tokens only."""
        ends = self._finalized
        if ends is not None:
            self.lengths, self._finalized = ends, None

    @property
    def state(self):
        """(keys, values): what BatchGenerator evaluates after a step."""
        return self.keys, self.values

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def _settled(self, verb: str) -> None:
        if self.marks is not None:
            raise BranchError(f"{verb}() with an open branch: commit or roll it back first")


def _ints(a) -> list[int]:
    return [int(x) for x in (a.tolist() if isinstance(a, mx.array) else a)]


def _settled_rows(cache):
    """(keys, values) of a single-sequence KV cache's tokens, [1, H, L, D], or None if it holds none."""
    from ..layers.kv import KVLayer
    from ..layers.window import WindowLayer

    if not isinstance(cache, (KVLayer, WindowLayer)):
        raise UnsupportedOperationError(
            f"KVLayer.merge() of a {type(cache).__name__}: merge segcache KV or window layers"
        )
    if cache.marks:
        raise BranchError(
            f"merge() of a {type(cache).__name__} with {len(cache.marks)} open branch(es): "
            "commit or roll them back first; nothing changed"
        )
    if cache.keys is None or cache.offset == 0:
        return None
    if isinstance(cache, WindowLayer) and (cache.offset > cache.max_size or cache._idx != cache.offset):
        raise UnsupportedOperationError(
            f"KVLayer.merge() of a WindowLayer that holds {cache.offset} tokens in a window of {cache.max_size}: "
            "it dropped tokens, so a full-attention row cannot hold it; merge windows with WindowLayer.merge"
        )
    if cache.keys.shape[0] != 1:
        raise UnsupportedOperationError(f"merge() of a cache of {cache.keys.shape[0]} rows: merge one-row caches")
    n = cache.offset
    return cache.keys[..., :n, :], cache.values[..., :n, :]


class BatchRecurrentLayer(RecurrentLayer):
    """A Gated DeltaNet cache over B rows: conv tails [B, k-1, C], states [B, ...].

    It is a `RecurrentLayer`, so the family adapter records each branch
    forward's inputs here (`Steps` over all B rows), and `commit_rows` cuts
    them per row.
    """

    # -- branches --------------------------------------------------------------------

    def fork(self) -> None:
        self.marks.append(_RecurrentMark(0, self.cache[0], self.cache[1]))

    def rollback(self) -> None:
        mark = self.marks.pop()
        self.cache = [mark.conv, mark.state]

    def commit(self, n: int) -> None:
        raise BranchError("a batched recurrent layer commits per row: commit_rows(ns)")

    def commit_rows(self, ns: Sequence[int]) -> None:
        """Keep the first ns[i] recorded tokens of row i and close the branch."""
        mark = self.marks.pop()
        if all(n == mark.appended for n in ns):
            # every row keeps all it fed (none was padded, or it could not commit that many):
            # the live conv tails and states are those rows' exactly, no slicing nor replay
            return
        convs, states = [], []
        for i, n in enumerate(ns):
            conv, state = self._row_prefix(mark, i, n)
            convs.append(conv)
            states.append(state)
        if all(c is None for c in convs):
            self.cache = [None, None]
            return
        like = next(c for c in convs if c is not None), next(s for s in states if s is not None)
        fill = lambda a, ref: mx.zeros((1, *ref.shape[1:]), ref.dtype) if a is None else a
        self.cache = [
            mx.concatenate([fill(c, like[0]) for c in convs]),
            mx.concatenate([fill(s, like[1]) for s in states]),
        ]

    def _row_prefix(self, mark: _RecurrentMark, i: int, n: int) -> tuple:
        """Row i's (conv tail, state) after its first n branch tokens, [1, ...] each."""
        conv0 = None if mark.conv is None else mark.conv[i : i + 1]
        state = None if mark.state is None else mark.state[i : i + 1]
        if n == 0:
            return conv0, state
        records = [_row_steps(s, i) for s in mark.records]
        kept = first_records(records, n)
        rows = [s.conv_rows for s in records]
        if conv0 is None:
            conv0 = mx.zeros((1, self.conv_tail, rows[0].shape[2]), rows[0].dtype)
        conv_inputs = mx.concatenate([conv0, *rows], axis=1)
        conv = mx.contiguous(conv_inputs[:, n : n + self.conv_tail, :])
        start = 0
        for j, steps in enumerate(kept):
            if steps.states:
                start, state = j + 1, steps.states[-1]
        for steps in kept[start:]:
            state = steps.replay(steps.inputs, state)
        return conv, state

    # -- rows -------------------------------------------------------------------------

    def take(self, rows: Sequence[int]) -> None:
        """Keep `rows` (in that order), their branch records included."""
        idx = mx.array(list(rows), dtype=mx.int32)
        if not rows:
            self.cache = [None, None]
            self.marks = [_RecurrentMark(0, None, None) for _ in self.marks]
            return
        self.cache = [_take(a, idx) for a in self.cache]
        for mark in self.marks:
            mark.conv, mark.state = _take(mark.conv, idx), _take(mark.state, idx)
            mark.records = [_take_steps(s, idx) for s in mark.records]

    def row_state(self, i: int) -> tuple:
        """(conv, state) of row i, [1, ...], or (None, None) for a batch that saw nothing."""
        conv, state = self.cache
        return (None, None) if conv is None else (conv[i : i + 1], state[i : i + 1])

    def add_row(self, conv, state, rows_before: int) -> None:
        """Append a row holding (conv, state) or nothing (zeros); outside a branch."""
        have, _ = self.cache
        if have is None and conv is None:
            return
        ref_c, ref_s = (conv, state) if conv is not None else self.cache
        if have is None:
            have_c = mx.zeros((rows_before, *ref_c.shape[1:]), ref_c.dtype)
            have_s = mx.zeros((rows_before, *ref_s.shape[1:]), ref_s.dtype)
        else:
            have_c, have_s = self.cache
        if conv is None:
            conv = mx.zeros((1, *ref_c.shape[1:]), ref_c.dtype)
            state = mx.zeros((1, *ref_s.shape[1:]), ref_s.dtype)
        self.cache = [mx.concatenate([have_c, conv]), mx.concatenate([have_s, state])]

    def check(self) -> None:
        conv, state = self.cache
        where = f"BatchRecurrentLayer(depth={len(self.marks)})"
        if (conv is None) != (state is None):
            raise InvariantError(f"{where}: conv tail and state present together")
        if conv is not None and (conv.shape[1] != self.conv_tail or conv.shape[0] != state.shape[0]):
            raise InvariantError(f"{where}: conv {conv.shape} / state {state.shape} do not line up")
        if len(self.marks) > 1:
            raise InvariantError(f"{where}: one branch level at most")

    # -- mlx-lm's batch-cache protocol (ArraysCache.merge, BatchGenerator) --------------------

    # Tokens each row holds, for `extract` (the count a RecurrentLayer keeps); set by
    # `merge` and kept by the calls below. None: a BatchRuntime's layer (the batch
    # runtime counts its rows and extracts through row_state).
    row_offsets: list[int] | None = None

    @classmethod
    def merge(cls, caches) -> "BatchRecurrentLayer":
        """One row per `RecurrentLayer`, in order; an empty one is a row of zeros (what
        mlx-lm's module starts from), as mlx-lm's `ArraysCache.merge` makes it.

        Raises:
            BranchError: a layer has an open branch; nothing changed.
            UnsupportedOperationError: not all `RecurrentLayer`s of one conv tail, or a
                layer holds more than one row.
        """
        for c in caches:
            if type(c) is not RecurrentLayer:
                raise UnsupportedOperationError(
                    f"RecurrentLayer.merge() of a {type(c).__name__}: merge RecurrentLayers only"
                )
            if c.marks:
                raise BranchError(
                    f"merge() of a RecurrentLayer with {len(c.marks)} open branch(es): "
                    "commit or roll them back first; nothing changed"
                )
            if c.cache[0] is not None and c.cache[0].shape[0] != 1:
                raise UnsupportedOperationError(f"merge() of a layer of {c.cache[0].shape[0]} rows: merge one-row layers")
        tails = {c.conv_tail for c in caches}
        if len(tails) != 1:
            raise UnsupportedOperationError(f"merge() of RecurrentLayers with conv tails {sorted(tails)}: one model's layers")
        first = caches[0]
        layer = cls(first.conv_tail, first.strategy, states_budget_bytes=first.states_budget_bytes)
        for i, c in enumerate(caches):
            layer.add_row(c.cache[0], c.cache[1], i)
        layer.row_offsets = [c.offset for c in caches]
        layer.offset = max(layer.row_offsets, default=0)
        return layer

    def extract(self, idx: int) -> RecurrentLayer:
        """Row `idx` as a `RecurrentLayer` (its conv tail and state, shared: slots are never written)."""
        self._rows_known("extract")
        out = RecurrentLayer(self.conv_tail, self.strategy, states_budget_bytes=self.states_budget_bytes)
        n = self.row_offsets[idx]
        if n:
            conv, state = self.cache
            out.cache, out.offset = [conv[idx : idx + 1], state[idx : idx + 1]], n
        return out

    def filter(self, batch_indices) -> None:
        """Keep the rows `batch_indices` (a list or an mx.array of ints), in that order."""
        self._rows_known("filter")
        rows = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        lengths = None if self.lengths is None else self.lengths[mx.array(rows, dtype=mx.int32)]
        self.take(rows)
        self.lengths = lengths
        self.row_offsets = [self.row_offsets[i] for i in rows]

    def extend(self, other: "BatchRecurrentLayer") -> None:
        """Append `other`'s rows after this layer's (rows without a state are zeros)."""
        self._rows_known("extend")
        other._rows_known("extend")
        if other.conv_tail != self.conv_tail:
            raise UnsupportedOperationError(f"extend(): conv tails {self.conv_tail} and {other.conv_tail}")
        n_self, n_other = len(self.row_offsets), len(other.row_offsets)
        conv, state = other.cache
        if conv is not None:
            self.add_row(conv, state, n_self)  # add_row concatenates all of other's rows at once
        else:
            for i in range(n_other):
                self.add_row(None, None, n_self + i)  # zeros, or nothing while no row has a state
        if self.lengths is not None or other.lengths is not None:
            pick = lambda a, n: mx.zeros((n,), mx.int32) if a is None else a
            self.lengths = mx.concatenate([pick(self.lengths, n_self), pick(other.lengths, n_other)])
        self.row_offsets = self.row_offsets + other.row_offsets
        self.offset = max(self.row_offsets, default=0)

    def prepare(self, lengths=None, **kwargs) -> None:
        """Before a right-padded forward (BatchGenerator): mlx-lm's mask keeps pads out of the state."""
        self._rows_known("prepare")
        ArraysCache.prepare(self, lengths=lengths)

    def finalize(self) -> None:
        ArraysCache.finalize(self)

    def advance(self, N):
        if self.row_offsets is not None:  # a padded row counts its real tokens only
            real = [N] * len(self.row_offsets) if self.lengths is None else [
                min(N, max(int(L), 0)) for L in self.lengths.tolist()
            ]
            self.row_offsets = [o + r for o, r in zip(self.row_offsets, real)]
        super().advance(N)

    def _rows_known(self, verb: str) -> None:
        if self.row_offsets is None:
            raise UnsupportedOperationError(
                f"{verb}() on a BatchRuntime's recurrent layer: the batch runtime moves rows "
                "(BatchRuntime.extract / leave / join)"
            )
        if self.marks:
            raise BranchError(f"{verb}() with an open branch: commit or roll it back first")


def _row_steps(s: Steps, i: int) -> Steps:
    sl = slice(i, i + 1)
    inputs = {k: (None if v is None else v[sl]) for k, v in s.inputs.items()}
    states = None if s.states is None else [a[sl] for a in s.states]
    return Steps(s.conv_rows[sl], inputs, s.replay, states)


def _take_steps(s: Steps, idx: mx.array) -> Steps:
    inputs = {k: _take(v, idx) for k, v in s.inputs.items()}
    states = None if s.states is None else [a[idx] for a in s.states]
    return Steps(s.conv_rows[idx], inputs, s.replay, states)
