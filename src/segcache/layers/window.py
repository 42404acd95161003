"""Sliding-window attention segment: mlx-lm's ring buffer plus snapshots.

The ring overwrites its oldest entries in place, so a branch cannot share it
by offset alone. `fork` keeps the pre-branch ring as new array objects over
the same data (free until the first in-place write, which then copies the
ring once: at most `max_size` tokens, never the context) and records the K/V
rows the branch appends. `commit(n)` restores the snapshot and re-appends the
first n recorded rows in the same chunks, which reproduces the exact layout
mlx-lm would have reached feeding those chunks.

`BatchWindowLayer` is the same kind over B rows (layers/rows.py): what
`BatchRuntime` builds for a sliding-window layer (registry.py) and what
`WindowLayer.merge` makes for mlx-lm's BatchGenerator. Each query is limited to
its row's window, and compaction keeps about `max_size` keys per row over a
long generation. Row i's keys are in temporal order; column c holds position starts[i] + c:

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

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from ..errors import BranchError, InvariantError, UnsupportedModelError, UnsupportedOperationError
from .compat import MlxCompat, QuantizeRefused
from .protocol import CHECKPOINT
from .rows import RowLengths, ints
from .snapshots import SnapshotBranches
from .tree import RowTrees, Tree, rows_tree_mask, tree_mask


@dataclass
class _WindowMark:
    keys: mx.array | None  # ring before the branch; own array objects, never written
    values: mx.array | None
    offset: int
    idx: int
    # K/V the branch appended, one (keys, values) per update call, in call order.
    records: list[tuple[mx.array, mx.array]] = field(default_factory=list)

    @property
    def appended(self) -> int:
        return sum(k.shape[2] for k, _ in self.records)


def _view(a: mx.array | None) -> mx.array | None:
    return None if a is None else a[...]


class WindowLayer(MlxCompat, QuantizeRefused, SnapshotBranches, RotatingKVCache):
    """mlx-lm's `RotatingKVCache` (same ring layout, same logits) plus a branch stack."""

    kv_refused = True  # a ring has no quantized form (QuantizeRefused; layers.compat)

    def __init__(self, max_size: int, keep: int = 0):
        super().__init__(max_size=max_size, keep=keep)
        # marks[i]: the ring as it was when open branch i began, and what i appended.
        self.marks: list[_WindowMark] = []

    def update_and_fetch(self, keys, values):
        if self.marks:
            self.marks[-1].records.append((keys, values))
        return super().update_and_fetch(keys, values)

    # -- tree verify (layers/tree.py) ----------------------------------------------

    @property
    def takes_trees(self) -> bool:
        return self.keep == 0  # attention sinks would sit apart from the window's positions in the mask

    def tree_begin(self, tree: Tree) -> None:
        """Before a tree forward (one block): the mask is the tree's over the min(offset, M - 1)
        keys a block keeps, limited to the window, as `make_mask` would give the block's chain."""
        before = min(self.max_size - 1, self.offset)
        self.make_mask = lambda N, window_size=None, return_array=False, **_: tree_mask(
            tree, before, window_size or self.max_size)

    def tree_end(self) -> None:
        vars(self).pop("make_mask", None)

    def take_path(self, path: list[int]) -> None:
        """The innermost branch, which holds a tree (one chunk), becomes the chain of `path`: the
        ring restored and the path's rows re-appended as one chunk, the layout its chain reaches."""
        mark = self.marks[-1]
        (keys, values), = mark.records
        self._restore(mark)
        mark.records = []
        if path:
            idx = mx.array(path, dtype=mx.int32)
            self.update_and_fetch(keys[..., idx, :], values[..., idx, :])

    def _snapshot(self) -> _WindowMark:
        return _WindowMark(_view(self.keys), _view(self.values), self.offset, self._idx)

    def _commit_prefix(self, mark: _WindowMark, n: int) -> None:
        self._restore(mark)
        for k, v in _first_tokens(mark.records, n):
            self.update_and_fetch(k, v)  # records into the enclosing branch, if any

    def _restore(self, mark: _WindowMark) -> None:
        self.keys, self.values = mark.keys, mark.values
        self.offset, self._idx = mark.offset, mark.idx

    def clone(self) -> "WindowLayer":
        """An independent layer holding the committed window (shares data until a write)."""
        other = WindowLayer(self.max_size, self.keep)
        if self.marks:
            base = self.marks[0]
            keys, values, other.offset, other._idx = base.keys, base.values, base.offset, base.idx
        else:
            keys, values, other.offset, other._idx = self.keys, self.values, self.offset, self._idx
        other.keys, other.values = _view(keys), _view(values)
        return other

    # -- the rest of mlx-lm's cache protocol (layers.compat) -------------------------

    @classmethod
    def merge(cls, caches):
        """mlx-lm's `RotatingKVCache.merge`: a batched layer with one row per cache's committed window.

        Returns a `BatchWindowLayer` (per-row lengths, no left padding); its
        `extract(i)` gives row i back as a WindowLayer.

        Raises:
            ValueError: windows of different sizes.
            UnsupportedModelError: a cache keeps attention sinks (keep > 0).
        """
        return BatchWindowLayer.merge(caches)

    @property
    def state(self):
        """mlx-lm's (keys, values, offset, keep, max_size, idx), of the committed ring."""
        if self.marks:
            m = self.marks[0]
            return m.keys, m.values, m.offset, self.keep, self.max_size, m.idx
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v) -> None:
        if self.marks:
            raise BranchError("setting state with an open branch: commit or roll it back first")
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v

    @classmethod
    def from_state(cls, state) -> "WindowLayer":
        """A layer holding `state` (mlx-lm's `load_prompt_cache` calls this)."""
        layer = cls(max_size=state[4], keep=state[3])
        layer.state = state
        return layer._checked()

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens, as mlx-lm's `RotatingKVCache.trim`, while the ring has not wrapped.

        Inside a branch the branch's records lose their last `n` rows too, so a
        full commit keeps exactly the ring mlx-lm's trim leaves and a partial
        commit re-appends only rows that were kept.

        Raises:
            UnsupportedOperationError: the ring has wrapped (`is_trimmable()` is
                False: the trimmed positions' predecessors are overwritten).
            BranchError: the trim would reach below the innermost open branch.
            Nothing changed in either case.
        """
        n = min(self.offset, n)
        if not self.is_trimmable():
            raise UnsupportedOperationError(
                f"trim({n}) on a sliding window of {self.max_size} that holds {self.offset} tokens: the ring has "
                "wrapped, so earlier tokens are overwritten (is_trimmable() is False, as in mlx-lm)"
            )
        if self.marks and n > self.offset - self.marks[-1].offset:
            raise BranchError(
                f"trim({n}) reaches below the innermost open branch (it holds "
                f"{self.offset - self.marks[-1].offset} tokens): roll the branch back instead"
            )
        super().trim(n)
        if self.marks:
            mark = self.marks[-1]
            mark.records = _first_tokens(mark.records, mark.appended - n)
        self._note_trim()
        return n

    # -- persistence protocol (layers.protocol) ------------------------------------

    resumes_from = CHECKPOINT

    def layout(self) -> list:
        return ["window", self.max_size, self.keep]

    def export_state(self) -> tuple[dict, dict]:
        """The committed ring in its exact layout (slots and rotation index), as copies.

        A later step attends exactly as mlx-lm would only from that layout.
        The copies own their data: they never pin or alias the live ring.
        """
        if self.marks:
            m = self.marks[0]
            keys, values, idx = m.keys, m.values, m.idx
        else:
            keys, values, idx = self.keys, self.values, self._idx
        if keys is None:
            return {}, {"idx": 0}
        return {"k": keys * 1, "v": values * 1}, {"idx": int(idx)}

    def spec(self, probe, tokens: int) -> dict:
        # After an S-token step the ring holds up to max_size + S - 1 slots (S <= tokens).
        ring = range(1, self.max_size + tokens)
        return {name: (dtype, (*shape[:2], ring, *shape[3:])) for name, (dtype, shape) in probe.items()}

    def state_from(self, arrays, meta, tokens: int) -> tuple:
        keys, values, idx = arrays.get("k"), arrays.get("v"), meta.get("idx")
        if tokens == 0 and keys is None and values is None:
            return None, None, 0, 0
        ok = (
            keys is not None and values is not None and keys.ndim == 4 and keys.shape[:3] == values.shape[:3]
            and isinstance(idx, int) and not isinstance(idx, bool) and 0 <= idx <= keys.shape[2]
            and tokens >= min(idx, keys.shape[2]) and tokens > 0
        )
        if not ok:
            raise ValueError(f"inconsistent ring snapshot for {tokens} tokens (index {idx!r})")
        return keys[...], values[...], tokens, idx  # own array objects: the ring is written in place

    def load(self, keys: mx.array | None, values: mx.array | None, offset: int, idx: int) -> None:
        """Replace the ring by an exported one taken after `offset` tokens.

        Raises:
            BranchError: a branch is open.
            ValueError: the snapshot is inconsistent (what `check()` would reject).
        """
        if self.marks:
            raise BranchError("load() with an open branch: commit or roll it back first")
        arrays = {} if keys is None else {"k": keys, "v": values}
        keys, values, offset, idx = self.state_from(arrays, {"idx": idx}, offset)
        self.keys, self.values, self.offset, self._idx = keys, values, int(offset), int(idx)

    def check(self) -> None:
        where = f"WindowLayer(offset={self.offset}, idx={self._idx}, depth={len(self.marks)})"
        if self.offset < 0 or self._idx < 0:
            raise InvariantError(f"{where}: negative offset or ring index")
        if self.keys is not None:
            if self.keys.shape[:3] != self.values.shape[:3] or self._idx > self.keys.shape[2]:
                raise InvariantError(f"{where}: ring shapes {self.keys.shape} do not hold the index")
        elif self.offset != 0:
            raise InvariantError(f"{where}: tokens counted but no ring")
        self._check_marks(where)


def _first_tokens(chunks, n):
    """The chunks cut to their first n tokens in total, keeping chunk boundaries."""
    out = []
    for k, v in chunks:
        if n <= 0:
            break
        take = min(n, k.shape[2])
        out.append((k[..., :take, :], v[..., :take, :]) if take < k.shape[2] else (k, v))
        n -= take
    return out


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


class BatchWindowLayer(RowTrees, RowLengths):
    """Sliding-window attention over B rows (mlx-lm's cache protocol for the model).

    Args:
        max_size: the window, as `RotatingKVCache(max_size)`.
        rows: empty rows to start with.
        keep: the native cache's attention sinks; only 0 is batched.

    Raises:
        UnsupportedModelError: keep > 0.
    """

    step = 256
    keep = 0
    # A right-padded forward outside a branch (`prepare` / `finalize`) keeps each row exact:
    # pads land past the row's end, so only its length moves.
    pads_rows = True

    def __init__(self, max_size: int, rows: int = 0, *, keep: int = 0):
        if keep:
            raise UnsupportedModelError(f"a sliding window with keep={keep} (attention sinks) is not batched")
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

    def _tree_mask(self, trees: list, window_size=None) -> mx.array:
        """A batched tree forward's mask (layers/tree.py) over the columns `make_mask` would give
        the block (after the compaction its `update_and_fetch` makes)."""
        N = trees[0].size
        plan = self._plan(N)
        starts = self.starts if plan is None else plan[0]
        T = max(self._ends(starts)) + N
        positions = mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(T, dtype=mx.int32)[None]
        lowest = mx.maximum(mx.array(self.lengths, dtype=mx.int32) - (self.max_size - 1), 0)
        return rows_tree_mask(trees, self.lengths, positions, window_size or self.max_size, lowest)

    def _column(self, i: int, position: int) -> int:
        return position - self.starts[i]

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

    def row_from(self, state) -> tuple:
        """The arguments of `add_row` for a row holding a `WindowLayer`'s committed `state`
        (None: an empty row), its ring in temporal order. Changes nothing.

        Raises:
            UnsupportedModelError: the ring keeps attention sinks.
            ValueError: the ring misses keys.
        """
        return (None, None, 0) if state is None else temporal_window(state)

    def row_load(self, i: int, tokens: int) -> tuple:
        """The arguments of `WindowLayer.load` for row i (which holds `tokens` tokens)."""
        keys, values, length = self.row_state(i)
        return keys, values, length, 0 if keys is None else keys.shape[2]

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

    @property
    def state(self):
        """(keys, values): what a batch forward's caller evaluates (as `BatchKVLayer.state`)."""
        return self.keys, self.values

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

    def extract(self, idx: int) -> WindowLayer:
        """Row `idx` as a single-sequence `WindowLayer` (its own copies); outside a branch."""
        if self.marks is not None:
            raise BranchError(f"extract({idx}) with a branch open: commit or roll it back first")
        layer = WindowLayer(self.max_size)
        layer.load(*self.row_load(idx, self.lengths[idx]))
        return layer

    def filter(self, batch_indices) -> None:
        """Keep the rows at `batch_indices`, as mlx-lm's batch caches."""
        self.take(ints(batch_indices))

    def extend(self, other: "BatchWindowLayer") -> None:
        """Append `other`'s rows; outside a branch on both."""
        if other.marks is not None:
            raise BranchError("extend() with a branch open on the other cache: commit or roll it back first")
        for i in range(len(other.lengths)):
            self.add_row(*other.row_state(i))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a right-padded forward: row i feeds `lengths[i]` real tokens, then pads.

        The forward writes every row's S columns where the row ends, as always; a
        real query attends only positions before it (and within the window), so
        the pads after a row's last real token reach nothing it computes, and
        `finalize` sets the row's length to its real tokens: the next forward
        writes over the pads. The columns a row keeps (its last max_size keys)
        are then exactly those of its real tokens.

        Raises:
            BranchError: a branch is open.
            UnsupportedOperationError: left padding (rows are never shifted).
        """
        if self.marks is not None:
            raise BranchError("prepare() with an open branch: commit or roll it back first")
        self._right_padded(left_padding, lengths)

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
