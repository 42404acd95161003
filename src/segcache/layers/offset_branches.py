"""Branches as offsets, for append-only buffers (full-attention KV, quantized or not).

    buffer  [ committed ........ | branch 1 ..... | branch 2 ... | free ]
            0                    marks[0]         marks[1]       offset  capacity

Rows a branch writes land past every mark, where no committed reader looks,
so a branch is where it began, and `commit(n)` / `rollback` only move `offset`.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import BranchError, InvariantError
from .tree import Tree, path_index, tree_mask


class OffsetBranches:
    """Mixin: a branch stack of offsets over a cache whose `offset` counts its rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # marks[i]: offset where open branch i began; non-decreasing, each <= offset.
        self.marks: list[int] = []

    @property
    def committed_offset(self) -> int:
        """Tokens outside every open branch."""
        return self.marks[0] if self.marks else self.offset

    def fork(self) -> None:
        self.marks.append(self.offset)

    def commit(self, n: int) -> None:
        self.offset = self.marks.pop() + n

    def rollback(self) -> None:
        self.offset = self.marks.pop()

    def branch_offsets(self) -> list[int]:
        return list(self.marks)

    # -- tree verify (layers/tree.py) ----------------------------------------------

    def tree_begin(self, tree: Tree) -> None:
        """Before a tree forward: the model's mask is the tree's. An instance attribute, so the
        class's `make_mask` (every chain forward's) is untouched; `tree_end` removes it."""
        before = self.offset
        self.make_mask = lambda N, return_array=False, window_size=None, **_: tree_mask(tree, before, window_size)

    def tree_end(self) -> None:
        vars(self).pop("make_mask", None)

    def take_path(self, path: list[int]) -> None:
        """The innermost branch, which holds a tree, becomes the chain of `path`'s nodes: their
        rows copied down to the branch's start (node j of the path to row base + j)."""
        base = self.marks[-1]
        if path != list(range(len(path))):
            idx = path_index(base, path)
            self.keys, self.values = _moved(self.keys, idx, base), _moved(self.values, idx, base)
        self.offset = base + len(path)

    def savepoint(self) -> int:
        return self.offset

    def check_marks(self, where: str) -> None:
        """The invariants of `offset` and `marks` (InvariantError naming `where`)."""
        if self.offset < 0:
            raise InvariantError(f"{where}: negative offset")
        if any(b < a for a, b in zip(self.marks, self.marks[1:])):
            raise InvariantError(f"{where}: marks must be non-decreasing")
        if self.marks and self.marks[-1] > self.offset:
            raise InvariantError(f"{where}: a branch begins past the end of the cache")

    def restore(self, point: int) -> None:
        """Undo a forward that failed half-way (rows past offset are never read)."""
        self.offset = point

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens (fewer if it holds fewer), as mlx-lm's `trim`.

        Notes the trim for the runtime's token ledger (`MlxCompat._note_trim`).

        Raises:
            BranchError: the trim would reach below the innermost open branch; nothing changed.
        """
        n = min(self.offset, n)
        if self.marks and self.offset - n < self.marks[-1]:
            raise BranchError(
                f"trim({n}) reaches below the innermost open branch (it holds {self.offset - self.marks[-1]} "
                "tokens): roll the branch back instead"
            )
        self.offset -= n
        self._note_trim()
        return n


def _moved(buf, idx: mx.array, base: int):
    """`buf` (an array or quantized parts, token axis 2) with rows `idx` written to base, base+1, ..."""
    if isinstance(buf, tuple):
        return tuple(_moved(a, idx, base) for a in buf)
    buf[..., base : base + idx.size, :] = buf[..., idx, :]
    return buf
