"""Sliding-window attention over B rows: per-row lengths, each query limited to its row's
window, and compaction so a long generation keeps about `max_size` keys per row.

Row i's keys are in temporal order; column c holds position starts[i] + c:

    row 0  [ . . a a a a a a ]     starts  = [-2, 5]   (columns of negative positions: padding,
    row 1  [ b b b b b b b b ]     lengths = [ 6, 13]    never seen)
                             ^ both rows end at one column: a step writes one slice

Query t of row i (position p = L_i + t, L_i the row's length before the forward) sees key j iff

    max(0, L_i - (M - 1)) <= j <= p   and   j > p - w          M = max_size, w = window_size or M

which is what mlx-lm's RotatingKVCache gives one sequence: before a block it keeps the last
M - 1 keys and masks to the window; a one-token step sees the last M keys, itself included.
Rows never shift within a step, RoPE takes the per-row lengths (`offset` is an array), and
a ragged commit only moves a length, as in BatchKVLayer.

Compaction: when a forward would not fit, every row keeps the positions from its floor,
max(0, base - M) with base its length at fork (or its length), i.e. the last M keys before
anything a rollback can return to, and all rows are realigned to end at one column. The
mask and the write agree because both take the layout from `_plan(S)`, which depends only
on lengths, starts, marks and capacity (every window layer of a model holds the same).
M keys rather than M - 1 are kept so that a row handed back as a WindowLayer holds a full
ring (mlx-lm's in-place step assumes min(offset, M) keys).

`keep` (attention sinks) is 0 in every mlx-lm model; a layer with keep > 0 is refused.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..errors import BranchError, InvariantError, UnsupportedModelError
from .layers import RowLengths


def temporal_window(state) -> tuple:
    """(keys, values, offset) of the last min(offset, M) tokens of a RotatingKVCache state, in order.

    Args:
        state: mlx-lm's `RotatingKVCache.state`: (keys, values, offset, keep, max_size, idx).

    Raises:
        UnsupportedModelError: keep > 0 (attention sinks are not batched).
        ValueError: the ring holds fewer than min(offset, M) tokens.
    """
    keys, values, offset, keep, max_size, idx = state
    offset, idx = int(offset), int(idx)
    if keep:
        raise UnsupportedModelError(f"a sliding window with keep={keep} (attention sinks) is not batched")
    if keys is None or offset == 0:
        return None, None, 0
    # the ring in temporal order, as RotatingKVCache._temporal_order with keep = 0
    if idx == keys.shape[2]:
        k, v = keys, values
    elif idx < offset:
        k = mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2)
        v = mx.concatenate([values[..., idx:, :], values[..., :idx, :]], axis=2)
    else:
        k, v = keys[..., :idx, :], values[..., :idx, :]
    K = min(offset, max_size)
    if k.shape[2] < K:
        raise ValueError(f"a window of {max_size} after {offset} tokens holds only {k.shape[2]} keys (needs {K})")
    return k[..., k.shape[2] - K :, :], v[..., v.shape[2] - K :, :], offset


class BatchWindowLayer(RowLengths):
    """Sliding-window attention over B rows (mlx-lm's cache protocol for the model).

    Args:
        max_size: the window, as `RotatingKVCache(max_size)`.
        rows: empty rows to start with.
    """

    step = 256
    keep = 0

    def __init__(self, max_size: int, rows: int = 0):
        self.max_size = max_size
        self.keys = None  # [B, H, C, D]; column c of row i holds position starts[i] + c, c < lengths[i] - starts[i]
        self.values = None  # (keys None => every row is empty)
        self.lengths: list[int] = [0] * rows  # tokens row i has seen
        # starts[i] <= floor(i) = max(0, min(lengths[i], marks[i]) - max_size): every key a query
        # or a rollback may need is held. Columns of positions < 0 are padding.
        self.starts: list[int] = [0] * rows
        # marks[i]: row i's length when the open branch began (None: no branch); <= lengths[i].
        self.marks: list[int] | None = None

    # -- the protocol the model speaks ----------------------------------------------

    def _floor(self, i: int) -> int:
        base = self.lengths[i] if self.marks is None else min(self.lengths[i], self.marks[i])
        return max(0, base - self.max_size)

    @property
    def _slack(self) -> int:
        # free columns left after a compaction: the next one comes at least this many tokens later,
        # so its copy (about M columns per row) costs at most M / slack columns per token
        return min(self.step, self.max_size)

    def _ends(self, starts: Sequence[int]) -> list[int]:
        return [L - s for L, s in zip(self.lengths, starts)]

    def _plan(self, S: int) -> tuple[list[int], int] | None:
        """The (starts, capacity) an S-token forward compacts to, or None if it fits as is."""
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if max(self._ends(self.starts), default=0) + S <= capacity:
            return None
        end = max((L - self._floor(i) for i, L in enumerate(self.lengths)), default=0)
        return [L - end for L in self.lengths], end + S + self._slack

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs) -> mx.array:
        plan = self._plan(N)
        starts = self.starts if plan is None else plan[0]
        T = max(self._ends(starts)) + N
        L = mx.array(self.lengths, dtype=mx.int32)[:, None, None]
        pos = mx.array(starts, dtype=mx.int32)[:, None, None] + mx.arange(T)[None, None, :]  # [B, 1, T]
        q = L + mx.arange(N)[None, :, None]  # [B, N, 1]
        lo = mx.maximum(L - (self.max_size - 1), 0)
        w = window_size or self.max_size
        return ((pos <= q) & (pos > q - w) & (pos >= lo))[:, None]  # [B, 1, N, T]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        plan = self._plan(S)
        if plan is not None:
            self._relayout(*plan, keys, values)
        ends = self._ends(self.starts)
        if len(set(ends)) == 1:
            E = ends[0]
            self.keys[..., E : E + S, :] = keys
            self.values[..., E : E + S, :] = values
        else:
            for i, E in enumerate(ends):
                self.keys[i : i + 1, :, E : E + S, :] = keys[i : i + 1]
                self.values[i : i + 1, :, E : E + S, :] = values[i : i + 1]
        self.lengths = [L + S for L in self.lengths]
        T = max(ends) + S
        return self.keys[..., :T, :], self.values[..., :T, :]

    def _relayout(self, starts: list[int], capacity: int, keys: mx.array, values: mx.array) -> None:
        """Move every row to `starts` in a new buffer of `capacity` columns (dropping what no row needs)."""
        like_k = keys if self.keys is None else self.keys
        like_v = values if self.values is None else self.values
        B, H = len(self.lengths), like_k.shape[1]
        k = mx.zeros((B, H, capacity, like_k.shape[3]), like_k.dtype)
        v = mx.zeros((B, H, capacity, like_v.shape[3]), like_v.dtype)
        if self.keys is not None:
            for i, (L, old, new) in enumerate(zip(self.lengths, self.starts, starts)):
                a = max(old, new)
                if L > a:
                    k[i : i + 1, :, a - new : L - new, :] = self.keys[i : i + 1, :, a - old : L - old, :]
                    v[i : i + 1, :, a - new : L - new, :] = self.values[i : i + 1, :, a - old : L - old, :]
        self.keys, self.values, self.starts = k, v, list(starts)

    # -- rows ----------------------------------------------------------------------

    def take(self, rows: Sequence[int]) -> None:
        """Keep `rows` (in that order), their starts and branch marks included."""
        rows = list(rows)
        self.starts = [self.starts[i] for i in rows]
        super().take(rows)

    def row_state(self, i: int) -> tuple:
        """(keys, values, length) of row i's last min(length, M) keys, [1, H, K, D] copies (None if empty)."""
        L = self.lengths[i]
        if L == 0:
            return None, None, 0
        K = min(L, self.max_size)
        c = L - K - self.starts[i]
        return self.keys[i : i + 1, :, c : c + K, :] * 1, self.values[i : i + 1, :, c : c + K, :] * 1, L

    def add_row(self, keys: mx.array | None, values: mx.array | None, length: int) -> None:
        """Append a row holding positions length-K..length-1 (`keys` [1, H, K, D]) or nothing; outside a branch.

        The row is aligned to end where the others end, when it fits there.
        """
        if self.marks is not None:
            raise BranchError("add_row() with a branch open: commit or roll it back first")
        end = max(self._ends(self.starts), default=0)
        if keys is None:
            self.lengths.append(0)
            self.starts.append(-end)  # its next write lands where the others' do
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys, mx.zeros((1, *self.keys.shape[1:]), self.keys.dtype)])
                self.values = mx.concatenate([self.values, mx.zeros((1, *self.values.shape[1:]), self.values.dtype)])
            return
        K = keys.shape[2]
        col = max(end - K, 0)
        if self.keys is None:
            B = len(self.lengths)
            size = col + K + self._slack
            self.keys = mx.zeros((B, keys.shape[1], size, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((B, values.shape[1], size, values.shape[3]), values.dtype)
        elif col + K > self.keys.shape[2]:
            extra = col + K - self.keys.shape[2] + self._slack
            pad = lambda a: mx.concatenate([a, mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)], axis=2)
            self.keys, self.values = pad(self.keys), pad(self.values)
        row_k = mx.zeros((1, *self.keys.shape[1:]), self.keys.dtype)
        row_v = mx.zeros((1, *self.values.shape[1:]), self.values.dtype)
        row_k[..., col : col + K, :] = keys
        row_v[..., col : col + K, :] = values
        self.keys = mx.concatenate([self.keys, row_k])
        self.values = mx.concatenate([self.values, row_v])
        self.lengths.append(length)
        self.starts.append(length - K - col)

    # -- mlx-lm's batch-cache calls (BatchGenerator) -------------------------------------

    @classmethod
    def merge(cls, caches) -> "BatchWindowLayer":
        """One row per single-sequence window cache (its committed state), as mlx-lm's merge.

        Raises:
            ValueError: the caches have different windows, or a ring misses keys.
            UnsupportedModelError: a cache keeps attention sinks (keep > 0).
        """
        sizes = {c.max_size for c in caches}
        if len(sizes) != 1:
            raise ValueError(f"merge(): windows of different sizes {sorted(sizes)}; merge caches of one layer")
        rows = [temporal_window(c.state) for c in caches]  # all checked before anything is built
        out = cls(sizes.pop())
        for keys, values, length in rows:
            out.add_row(keys, values, length)
        return out

    def extract(self, idx: int):
        """Row `idx` as a single-sequence `WindowLayer` (its own copies); outside a branch."""
        from ..layers.window import WindowLayer

        if self.marks is not None:
            raise BranchError(f"extract({idx}) with a branch open: commit or roll it back first")
        keys, values, length = self.row_state(idx)
        layer = WindowLayer(self.max_size)
        layer.load(keys, values, length, 0 if keys is None else keys.shape[2])
        return layer

    def filter(self, batch_indices) -> None:
        """Keep the rows at `batch_indices`, as mlx-lm's batch caches."""
        rows = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.take(rows)

    def extend(self, other: "BatchWindowLayer") -> None:
        """Append `other`'s rows; outside a branch on both."""
        if other.marks is not None:
            raise BranchError("extend() with a branch open on the other cache: commit or roll it back first")
        for i in range(len(other.lengths)):
            self.add_row(*other.row_state(i))

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def check(self) -> None:
        where = f"BatchWindowLayer(lengths={self.lengths}, starts={self.starts}, marks={self.marks})"
        if len(self.starts) != len(self.lengths) or any(L < 0 for L in self.lengths):
            raise InvariantError(f"{where}: one start and a non-negative length per row")
        if self.marks is not None and (
            len(self.marks) != len(self.lengths) or any(m > L for m, L in zip(self.marks, self.lengths))
        ):
            raise InvariantError(f"{where}: a branch begins past its row's end")
        if any(s > self._floor(i) for i, s in enumerate(self.starts)):
            raise InvariantError(f"{where}: a row dropped keys its window still needs (max_size {self.max_size})")
        if self.keys is None:
            if any(self.lengths):
                raise InvariantError(f"{where}: tokens counted but no buffer")
            return
        if self.keys.shape[0] != len(self.lengths) or max(self._ends(self.starts), default=0) > self.keys.shape[2]:
            raise InvariantError(f"{where}: buffer {self.keys.shape} does not hold the rows")
