"""Full-attention KV segment: one append-only buffer, branches are offsets.

    buffer  [ committed ........ | branch 1 ..... | branch 2 ... | free ]
            0                    marks[0]         marks[1]       offset  capacity

A branch never copies or references the buffer: it remembers where it began
(`marks`). Tokens a branch appends land past every mark, where no committed
reader looks, so `rollback` and `commit(n)` only move `offset`. Writes stay in
place because nothing else holds the buffer (a clone holds its own view, which
costs one copy of the buffer at the first write on each side, never one per
token). The branch stack is `OffsetBranches`, shared with the quantized kind.

`BatchKVLayer` is the same kind over B rows (layers/rows.py), as mlx-lm keeps
`BatchKVCache` beside `KVCache`: what `BatchRuntime` builds for a full-attention
layer (registry.py) and what `KVLayer.merge` makes for mlx-lm's
BatchGenerator. Its rows keep their lengths in one buffer, [0, lengths[i]),
instead of mlx-lm's left padding, so rows never shift; its branches are the
rows' lengths at the fork, and a ragged `commit_rows` only moves lengths.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import BranchError, InvariantError, UnsupportedOperationError
from .compat import MlxCompat
from .offset_branches import OffsetBranches
from .protocol import PAGES
from .quantized import QuantizedKVLayer
from .rows import RowLengths, ints
from .tree import RowTrees, rows_tree_mask
from .window import WindowLayer


class KVLayer(MlxCompat, OffsetBranches, KVCache):
    """mlx-lm's `KVCache` (same update path, same logits) plus a branch stack."""

    takes_trees = True  # OffsetBranches.tree_begin / take_path

    def clone(self) -> "KVLayer":
        """An independent layer holding the committed tokens (shares the buffer until a write)."""
        other = KVLayer()
        if self.keys is not None:
            # New array objects over the same data: a write through either side
            # never reaches the other (MLX copies a shared buffer on write).
            other.keys, other.values = self.keys[...], self.values[...]
        other.offset = self.committed_offset
        return other

    # -- the rest of mlx-lm's cache protocol (layers.compat) -------------------------

    @property
    def state(self):
        """(keys, values, offset) of the committed tokens: what `save_prompt_cache` writes.

        Rows of an open branch lie past the committed offset and are left out.
        """
        n = self.committed_offset
        if self.marks and self.keys is not None:
            return self.keys[..., :n, :], self.values[..., :n, :], n
        return self.keys, self.values, n

    @state.setter
    def state(self, v) -> None:
        if self.marks:
            raise BranchError("setting state with an open branch: commit or roll it back first")
        self.keys, self.values, self.offset = v

    @classmethod
    def from_state(cls, state) -> "KVLayer":
        """A layer holding `state` (mlx-lm's `load_prompt_cache` calls this)."""
        layer = cls()
        layer.state = state
        return layer._checked()

    kv_switches = True  # mlx-lm's kv_bits swaps it for to_quantized's layer (layers.compat)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVLayer:
        """These tokens as a `QuantizedKVLayer`, as mlx-lm's `KVCache.to_quantized` quantizes them.

        mlx-lm's `kv_bits` puts the result in place of this layer in `rt.cache`;
        the runtime adopts it at its next operation (`replaced_by` names it), and
        branches on it as on this layer. This layer is left as it was.

        Raises:
            BranchError: a branch is open (its rows would become committed quantized
                rows with no mark); nothing was swapped.
        """
        if self.marks:
            raise BranchError(
                f"to_quantized(bits={bits}) (mlx-lm's kv_bits) with {len(self.marks)} open branch(es): "
                "commit or roll them back first (e.g. quantized_kv_start before the first fork); nothing was swapped"
            )
        quantized = QuantizedKVLayer.of(self.keys, self.values, self.offset, group_size, bits)
        self.replaced_by = quantized
        return quantized

    @classmethod
    def merge(cls, caches):
        """mlx-lm's `KVCache.merge` (BatchGenerator): a `BatchKVLayer`, one row per cache.

        Rows keep their lengths (no left padding); `extract(i)` gives row i back as
        a `KVLayer`. Windows that dropped no token merge as full-attention rows, as
        mlx-lm's `KVCache.merge` makes them (`BatchKVLayer.merge`).
        """
        return BatchKVLayer.merge(caches)

    # -- persistence protocol (layers.protocol) ------------------------------------

    resumes_from = PAGES

    def layout(self) -> list:
        return ["kv"]

    def export_rows(self, start: int, end: int, *, share: bool = False) -> dict[str, mx.array]:
        """Copies of the committed keys and values of positions [start, end).

        The copies own their data, so a store that keeps them neither pins
        the live buffer nor makes the next in-place write copy it. With `share`,
        views of the buffer instead (no copy): for a layer nobody writes into
        again (a hot runtime, which only clones of it extend), whose buffer is
        held anyway, so copies would hold the same rows twice.

        Raises:
            ValueError: the range is empty or reaches past the committed tokens.
        """
        if not 0 <= start < end <= self.committed_offset:
            raise ValueError(f"export_rows({start}, {end}): need 0 <= start < end <= {self.committed_offset}")
        k, v = self.keys[..., start:end, :], self.values[..., start:end, :]
        return {"k": k, "v": v} if share else {"k": _copy(k), "v": _copy(v)}

    def spec(self, probe, tokens: int) -> dict:
        return {name: (dtype, (*shape[:2], tokens, *shape[3:])) for name, (dtype, shape) in probe.items()}

    def state_from(self, arrays, meta, tokens: int) -> tuple:
        """Keys and values from their row chunks, with room for the next step's rows.

        The buffer gets `step` free slots past `tokens`, so the first forward after
        a resume writes in place instead of copying the whole context again.
        """
        chunks_k, chunks_v = arrays.get("k"), arrays.get("v")
        if not chunks_k or not chunks_v or len(chunks_k) != len(chunks_v):
            raise ValueError("K/V state lacks its keys or values")
        first = chunks_k[0]
        for k, v in zip(chunks_k, chunks_v):
            if k.ndim != 4 or k.shape[:2] != first.shape[:2] or k.shape[3] != first.shape[3] or v.shape[:3] != k.shape[:3]:
                raise ValueError(f"K/V chunks of shapes {k.shape} / {v.shape} do not line up")
        if sum(k.shape[2] for k in chunks_k) != tokens:
            raise ValueError(f"K/V chunks hold {sum(k.shape[2] for k in chunks_k)} tokens, not {tokens}")
        B, H, _, _ = first.shape
        keys = mx.concatenate([*chunks_k, mx.zeros((B, H, self.step, first.shape[3]), first.dtype)], axis=2)
        v0 = chunks_v[0]
        values = mx.concatenate([*chunks_v, mx.zeros((B, H, self.step, v0.shape[3]), v0.dtype)], axis=2)
        return keys, values, tokens

    def load(self, keys: mx.array, values: mx.array, offset: int | None = None) -> None:
        """Replace the cache by the first `offset` tokens (all if None) of `keys`/`values` ([B, H, T, D]).

        The layer takes the arrays as its buffer and writes the next tokens past
        `offset` in place, so pass arrays nobody else holds.

        Raises:
            BranchError: a branch is open (loading would drop it).
            ValueError: the shapes do not agree.
        """
        if self.marks:
            raise BranchError("load() with an open branch: commit or roll it back first")
        offset = keys.shape[2] if offset is None and keys.ndim == 4 else offset
        if keys.ndim != 4 or keys.shape[:3] != values.shape[:3] or not 0 < offset <= keys.shape[2]:
            raise ValueError(f"load(): keys {keys.shape} and values {values.shape} for {offset} tokens")
        self.keys, self.values, self.offset = keys, values, offset

    def check(self) -> None:
        where = f"KVLayer(offset={self.offset}, marks={self.marks})"
        self.check_marks(where)
        if self.keys is None:
            if self.offset != 0:
                raise InvariantError(f"{where}: tokens counted but no buffer")
            return
        if self.offset > self.keys.shape[2] or self.keys.shape[:3] != self.values.shape[:3]:
            raise InvariantError(
                f"{where}: buffer shapes {self.keys.shape} / {self.values.shape} do not hold the offset"
            )


def _copy(a: mx.array) -> mx.array:
    """A copy with its own buffer (x * 1 is exact for every float, -0 and inf included)."""
    return a * 1


class BatchKVLayer(RowTrees, RowLengths):
    """Full attention over B rows with per-row lengths (mlx-lm's cache protocol for the model)."""

    step = 256
    # A right-padded forward outside a branch (`prepare` / `finalize`) keeps each row exact:
    # pads land past the row's end, where no real query looks, and only its length moves.
    pads_rows = True

    def __init__(self, rows: int = 0):
        self.keys = None  # [B, H, T, D]; row i valid on [0, lengths[i])
        self.values = None
        self.lengths: list[int] = [0] * rows
        # marks[i]: row i's length when the open branch began (None: no branch).
        self.marks: list[int] | None = None

    # -- the protocol the model speaks ----------------------------------------------

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs) -> mx.array | None:
        if N == 1 and window_size is None and not return_array and len(set(self.lengths)) == 1:
            # one query per row, every row at one length: it sees every key `update_and_fetch`
            # returns, so no mask (as mlx-lm's KVCache for one token): the unmasked attention
            # (a lone row's decode step: ~3% of its CPU time here)
            return None
        T = max(self.lengths) + N
        q = mx.array(self.lengths, dtype=mx.int32)[:, None, None] + mx.arange(N)[None, :, None]
        keys = mx.arange(T)[None, None, :]
        mask = keys <= q
        if window_size is not None:  # as mlx-lm's KVCache given a window: the last window_size keys
            mask = mask & (keys > q - window_size)
        return mask[:, None]  # [B, 1, N, T]

    def _tree_mask(self, trees: list, window_size=None) -> mx.array:
        """A batched tree forward's mask (layers/tree.py): column t of row i holds position t."""
        T = max(self.lengths) + trees[0].size
        positions = mx.broadcast_to(mx.arange(T, dtype=mx.int32)[None], (len(trees), T))
        return rows_tree_mask(trees, self.lengths, positions, window_size)

    def _column(self, i: int, position: int) -> int:
        return position

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

    def row_from(self, state) -> tuple:
        """The arguments of `add_row` for a row holding a `KVLayer`'s committed `state`
        (None: an empty row). Changes nothing."""
        if state is None or not state[2]:
            return None, None
        keys, values, n = state
        return keys[..., :n, :], values[..., :n, :]

    def row_load(self, i: int, tokens: int) -> tuple:
        """The arguments of `KVLayer.load` for row i (which holds `tokens` tokens)."""
        return (*self.row_state(i), tokens)

    def add_row(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Append a row holding `keys`/`values` ([1, H, L, D]) or nothing; outside a branch."""
        L = 0 if keys is None else keys.shape[2]
        if keys is not None and not self.lengths:
            # the first row: its arrays as they are (MLX never writes an array another one reads: the
            # first forward grows them into a buffer of this layer's own). Padding and concatenating
            # cost three copies of the row: 100-135 ms at 52k tokens, before a lone request's first token.
            self.keys, self.values = keys, values
        elif keys is not None:
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

    def extract(self, idx: int) -> KVLayer:
        """Row `idx` as a `KVLayer` holding its own copy of the row's tokens.

        Raises:
            BranchError: a branch is open (its rows are not settled).
        """
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
        self.take(ints(batch_indices))

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
        self._right_padded(left_padding, lengths)

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


def _settled_rows(cache):
    """(keys, values) of a single-sequence KV cache's tokens, [1, H, L, D], or None if it holds none."""
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

