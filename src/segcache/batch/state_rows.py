"""`StateLayer`s batched for mlx-lm's BatchGenerator: B rows of slots, each row's token count.

What `StateLayer.merge` makes. Slots are stacked on axis 0 (zeros for a row
that saw nothing, what mlx-lm's `ArraysCache.merge` gives and what the modules
start from), so the model runs mlx-lm's own code on it as on a merged
`ArraysCache`: `make_mask` from the per-row `lengths` a right-padded prompt
sets (`prepare`), `advance` moving them. What segcache adds is the count of
real tokens per row (`row_offsets`, from `advance`, or from the family hook's
`count` for modules that never call it), so `extract(i)` gives row i back as
a `StateLayer` holding exactly its slots and its count. No branches: batched
speculative rounds on state families are not supported (`fork` refuses).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import BranchError, InvariantError, UnsupportedOperationError
from ..layers.state import StateLayer


class BatchStateLayer(StateLayer):
    """B rows of a `StateLayer`'s slots (mlx-lm's `ArraysCache` protocol for the model)."""

    # row_offsets[i]: real tokens row i holds (pads excluded); len == rows.
    row_offsets: list[int]

    @classmethod
    def merge(cls, caches) -> "BatchStateLayer":
        """One row per `StateLayer` of one family and slot count, in order.

        Raises:
            BranchError: a layer has an open branch; nothing changed.
            UnsupportedOperationError: other kinds or layouts, a layer of several rows,
                or slots whose shapes differ between rows (a context still growing).
        """
        first = caches[0]
        for c in caches:
            if type(c) is not StateLayer or c.layout() != first.layout():
                raise UnsupportedOperationError(
                    f"StateLayer.merge() of a {type(c).__name__} {c.layout()}: merge StateLayers of one layout "
                    f"({first.layout()})"
                )
            if c.marks:
                raise BranchError(
                    f"merge() of a StateLayer with {len(c.marks)} open branch(es): commit or roll them back first"
                )
        slots = []
        for e in range(first.size):
            present = [c.cache[e] for c in caches if c.cache[e] is not None]
            if not present:
                slots.append(None)
                continue
            if len({a.shape for a in present}) != 1 or present[0].shape[0] != 1:
                raise UnsupportedOperationError(
                    f"StateLayer.merge() ({first.family}): slot {e} has shapes {sorted({a.shape for a in present})} "
                    "across rows; merge rows of one shape (one row each)"
                )
            like = present[0]
            slots.append(mx.concatenate([mx.zeros_like(like) if c.cache[e] is None else c.cache[e] for c in caches]))
        layer = cls(first.size, first.family, first.strategy, states_budget_bytes=first.states_budget_bytes,
                    growing=first.growing)
        layer.cache = slots
        layer.row_offsets = [c.offset for c in caches]
        layer.offset = max(layer.row_offsets, default=0)
        return layer

    def extract(self, idx: int) -> StateLayer:
        """Row `idx` as a `StateLayer` (its slots shared: modules replace slots, never write them)."""
        out = StateLayer(self.size, self.family, self.strategy, states_budget_bytes=self.states_budget_bytes,
                         growing=self.growing)
        n = self.row_offsets[idx]
        if n:
            out.cache = [None if a is None else a[idx : idx + 1] for a in self.cache]
            out.offset = n
        return out

    def filter(self, batch_indices) -> None:
        rows = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        ArraysCache.filter(self, mx.array(rows, dtype=mx.int32))
        self.row_offsets = [self.row_offsets[i] for i in rows]

    def extend(self, other: "BatchStateLayer") -> None:
        if type(other) is not BatchStateLayer or other.layout() != self.layout():
            raise UnsupportedOperationError(f"extend() with a {type(other).__name__}: extend with rows of one layout")
        n_self, n_other = len(self.row_offsets), len(other.row_offsets)
        lengths = None
        if self.lengths is not None or other.lengths is not None:
            pick = lambda a, n: mx.zeros((n,), mx.int32) if a is None else a
            lengths = mx.concatenate([pick(self.lengths, n_self), pick(other.lengths, n_other)])
        slots = []
        for a, b in zip(self.cache, other.cache):
            like = a if a is not None else b
            if like is None:
                slots.append(None)
                continue
            a = mx.zeros((n_self, *like.shape[1:]), like.dtype) if a is None else a
            b = mx.zeros((n_other, *like.shape[1:]), like.dtype) if b is None else b
            slots.append(mx.concatenate([a, b]))
        self.cache, self.lengths = slots, lengths
        self.row_offsets = self.row_offsets + other.row_offsets
        self.offset = max(self.row_offsets, default=0)

    def prepare(self, lengths=None, **kwargs) -> None:
        ArraysCache.prepare(self, lengths=lengths)

    def finalize(self) -> None:
        ArraysCache.finalize(self)

    def advance(self, N):
        self._count_rows(N)
        ArraysCache.advance(self, N)
        self.offset += N

    def count(self, N: int) -> None:
        """Tokens fed through a module that does not call `advance` (the hook counts them)."""
        self._count_rows(N)
        self.offset += N

    def _count_rows(self, N: int) -> None:
        real = [N] * len(self.row_offsets) if self.lengths is None else [
            min(N, max(int(L), 0)) for L in self.lengths.tolist()
        ]
        self.row_offsets = [o + r for o, r in zip(self.row_offsets, real)]

    def fork(self) -> None:
        raise BranchError("a batched StateLayer has no branches (batched speculative rounds need BatchRuntime)")

    def check(self) -> None:
        where = f"BatchStateLayer({self.family}, rows={len(self.row_offsets)})"
        if len(self.cache) != self.size:
            raise InvariantError(f"{where}: {len(self.cache)} slots, expected {self.size}")
        rows = {a.shape[0] for a in self.cache if a is not None}
        if rows - {len(self.row_offsets)}:
            raise InvariantError(f"{where}: slots hold {sorted(rows)} rows")
        if self.marks:
            raise InvariantError(f"{where}: a branch is open")
