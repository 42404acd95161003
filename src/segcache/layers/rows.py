"""What the batched kinds share: rows with their own lengths, and mlx-lm's per-row counts.

A batched kind holds B sequences ("rows") in one cache, each with its own
length; row i of every layer of a batch is the same sequence. Attention kinds
keep a row's tokens at its own positions and never shift them:

    row 0  [ a a a a a . . . ]      lengths = [5, 3]
    row 1  [ b b b . . . . . ]      a forward of S writes row i at [L_i, L_i + S)
                                    and query t of row i sees keys j <= L_i + t

so a branch is each row's length when it began (`RowLengths.marks`), and a
ragged commit only moves lengths. Recurrent kinds hold [B, ...] slots and
rebuild each row from its own records (layers/recurrent.py, layers/state.py).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import BranchError, InvariantError, UnsupportedOperationError


class RowLengths:
    """Attention rows with per-row lengths whose branches are those lengths (KV, window).

    Needs `lengths` (tokens per row), `marks` (each row's length when the
    open branch began, None without one; a branch's rows lie past its marks)
    and `keys` / `values` ([B, H, T, D] or None).
    """

    lengths: list[int]
    marks: list[int] | None
    _finalized: list[int] | None = None  # row lengths once a padded forward is done (prepare -> finalize)

    def _right_padded(self, left_padding, lengths) -> None:
        """What `prepare` does for every attention kind: right padding only (a row keeps its
        own length, never shifted), and each row's real end kept for `finalize`."""
        if left_padding is not None and any(ints(left_padding)):
            raise UnsupportedOperationError(
                f"prepare(left_padding=...): {type(self).__name__} keeps per-row lengths and never "
                "left-pads; right-pad the rows (prepare(lengths=..., right_padding=...))"
            )
        if lengths is not None:
            self._finalized = [L + n for L, n in zip(self.lengths, ints(lengths))]

    def finalize(self) -> None:
        """After the padded forward(s): each row holds its real tokens only."""
        ends = self._finalized
        if ends is not None:
            self.lengths, self._finalized = ends, None

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
            elif rows != list(range(self.keys.shape[0])):  # every row in order: the arrays as they are
                idx = mx.array(rows, dtype=mx.int32)
                self.keys, self.values = self.keys[idx], self.values[idx]

    def check_rows(self, lengths: list[int], bases: list[int] | None, sealed: bool = False) -> None:
        """InvariantError unless this layer holds rows of `lengths` tokens (not checked when
        `sealed`: a ragged forward ran) with a branch from `bases` (None: no branch)."""
        if not sealed and self.lengths != lengths:
            raise InvariantError(f"attention lengths {self.lengths} but rows hold {lengths} tokens")
        if self.marks != bases:
            raise InvariantError(f"marks {self.marks} but rows branched at {bases}")


class StackedRows:
    """Recurrent rows stacked on axis 0 of every array in `cache` (GDN: conv tail and
    state; state kinds: the module's slots). A row that saw nothing holds zeros (what
    mlx-lm's modules start from when a slot is None); a slot no row has filled is None.
    `marks` is the branch stack (one level in a batch).
    """

    rows: int = 0  # rows of the batch
    # Tokens each row holds, for `extract` (the count a single-row layer keeps): set by
    # `merge` (BatchGenerator) and kept by `filter` / `extend` / `_count_rows`. None: a
    # BatchRuntime's layer (the batch runtime counts its rows' tokens and moves rows).
    row_offsets: list[int] | None = None
    cache: list
    marks: list
    lengths: mx.array | None

    def row_state(self, i: int) -> list:
        """Row i's arrays, [1, ...] each (None where no row has filled the slot)."""
        return [None if a is None else a[i : i + 1] for a in self.cache]

    def _append(self, slots: list, count: int) -> None:
        """Append `count` rows, which `slots` hold on axis 0 (a None slot: zeros, or nothing).

        Raises:
            UnsupportedOperationError: a slot's shape differs from the other rows' (nothing changed).
        """
        for e, (a, b) in enumerate(zip(self.cache, slots)):
            if a is not None and b is not None and a.shape[1:] != b.shape[1:]:
                raise UnsupportedOperationError(
                    f"{type(self).__name__}: slot {e} has shapes {sorted({a.shape[1:], b.shape[1:]})} across rows; "
                    "rows of one shape only (a context still growing cannot be batched)"
                )
        out = []
        for a, b in zip(self.cache, slots):
            like = a if a is not None else b
            if like is None:
                out.append(None)
                continue
            a = mx.zeros((self.rows, *like.shape[1:]), like.dtype) if a is None else a
            b = mx.zeros((count, *like.shape[1:]), like.dtype) if b is None else b
            out.append(mx.concatenate([a, b]))
        self.cache = out
        self.rows += count

    def check_rows(self, lengths: list[int], bases: list[int] | None, sealed: bool = False) -> None:
        """InvariantError unless this layer holds len(`lengths`) rows, in a branch iff `bases`."""
        if self.rows != len(lengths) or any(a is not None and a.shape[0] != self.rows for a in self.cache):
            raise InvariantError(f"{type(self).__name__} holds {self.rows} rows, the batch has {len(lengths)}")
        if len(self.marks) != int(bases is not None):
            raise InvariantError(f"{type(self).__name__}: branch depth {len(self.marks)}, batch branch open: {bases is not None}")

    # -- mlx-lm's batch-cache protocol (ArraysCache.merge, BatchGenerator) --------------------

    def filter(self, batch_indices) -> None:
        """Keep the rows `batch_indices` (a list or an mx.array of ints), in that order."""
        self._rows_known("filter")
        rows = ints(batch_indices)
        lengths = None if self.lengths is None else self.lengths[mx.array(rows, dtype=mx.int32)]
        self.take(rows)
        self.lengths = lengths
        self.row_offsets = [self.row_offsets[i] for i in rows]

    def _extend_rows(self, other: "StackedRows") -> None:
        """Append `other`'s rows after this layer's (of one layout: the caller checked)."""
        self._rows_known("extend")
        other._rows_known("extend")
        n_self, n_other = self.rows, other.rows
        self._append(list(other.cache), n_other)
        if self.lengths is not None or other.lengths is not None:
            pick = lambda a, n: mx.zeros((n,), mx.int32) if a is None else a
            self.lengths = mx.concatenate([pick(self.lengths, n_self), pick(other.lengths, n_other)])
        self.row_offsets = self.row_offsets + other.row_offsets
        self.offset = max(self.row_offsets, default=0)

    def prepare(self, lengths=None, **kwargs) -> None:
        """Before a right-padded forward (BatchGenerator's, or `BatchRuntime.forward_padded`): row i
        feeds `lengths[i]` real tokens; mlx-lm's mask (`make_mask`) keeps the pads out of the state
        and the conv tail is taken after each row's last real token."""
        if self.marks:
            raise BranchError("prepare() with an open branch: a branch forward is never padded this way")
        ArraysCache.prepare(self, lengths=lengths)

    def finalize(self) -> None:
        ArraysCache.finalize(self)

    def _count_rows(self, N: int) -> None:
        if self.row_offsets is not None:  # a padded row counts its real tokens only
            self.row_offsets = counted(self.row_offsets, self.lengths, N)

    def _rows_known(self, verb: str) -> None:
        if self.row_offsets is None:
            raise UnsupportedOperationError(
                f"{verb}() on a BatchRuntime's {type(self).__name__}: the batch runtime moves rows "
                "(BatchRuntime.extract / leave / join)"
            )
        if self.marks:
            raise BranchError(f"{verb}() with an open branch: commit or roll it back first")


def take_rows(a: mx.array | None, idx: mx.array | None) -> mx.array | None:
    """Rows `idx` (axis 0) of `a`; None stays None, and so does `a` when `idx` is None (all rows)."""
    return a if a is None or idx is None else a[idx]


def ints(a) -> list[int]:
    """A list or an mx.array of ints (what mlx-lm's batch calls pass) as a list of ints."""
    return [int(x) for x in (a.tolist() if isinstance(a, mx.array) else a)]


def counted(row_offsets: list[int], lengths: mx.array | None, N: int) -> list[int]:
    """Per-row token counts after an N-token forward in which row i fed `lengths[i]` real
    tokens (mlx-lm's right-padded prompt, `ArraysCache.prepare`), all N without lengths."""
    if lengths is None:
        return [o + N for o in row_offsets]
    return [o + min(N, max(int(L), 0)) for o, L in zip(row_offsets, lengths.tolist())]
