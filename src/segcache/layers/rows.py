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


def ints(a) -> list[int]:
    """A list or an mx.array of ints (what mlx-lm's batch calls pass) as a list of ints."""
    return [int(x) for x in (a.tolist() if isinstance(a, mx.array) else a)]


def counted(row_offsets: list[int], lengths: mx.array | None, N: int) -> list[int]:
    """Per-row token counts after an N-token forward in which row i fed `lengths[i]` real
    tokens (mlx-lm's right-padded prompt, `ArraysCache.prepare`), all N without lengths."""
    if lengths is None:
        return [o + N for o in row_offsets]
    return [o + min(N, max(int(L), 0)) for o, L in zip(row_offsets, lengths.tolist())]
