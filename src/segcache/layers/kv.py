"""Full-attention KV segment: one append-only buffer, branches are offsets.

    buffer  [ committed ........ | branch 1 ..... | branch 2 ... | free ]
            0                    marks[0]         marks[1]       offset  capacity

A branch never copies or references the buffer: it remembers where it began
(`marks`). Tokens a branch appends land past every mark, where no committed
reader looks, so `rollback` and `commit(n)` only move `offset`. Writes stay in
place because nothing else holds the buffer (a clone holds its own view, which
costs one copy of the buffer at the first write on each side, never one per
token). The branch stack is `OffsetBranches`, shared with the quantized kind.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import BranchError, InvariantError
from .compat import MlxCompat
from .offset_branches import OffsetBranches
from .protocol import PAGES
from .quantized import QuantizedKVLayer


class KVLayer(MlxCompat, OffsetBranches, KVCache):
    """mlx-lm's `KVCache` (same update path, same logits) plus a branch stack."""

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
        mlx-lm's `KVCache.merge` makes them (`batch.layers.BatchKVLayer.merge`).
        """
        from ..batch.layers import BatchKVLayer

        return BatchKVLayer.merge(caches)

    # -- persistence protocol (layers.protocol) ------------------------------------

    resumes_from = PAGES

    def layout(self) -> list:
        return ["kv"]

    def export_rows(self, start: int, end: int) -> dict[str, mx.array]:
        """Copies of the committed keys and values of positions [start, end).

        The copies own their data, so a store that keeps them neither pins
        the live buffer nor makes the next in-place write copy it.

        Raises:
            ValueError: the range is empty or reaches past the committed tokens.
        """
        if not 0 <= start < end <= self.committed_offset:
            raise ValueError(f"export_rows({start}, {end}): need 0 <= start < end <= {self.committed_offset}")
        return {"k": _copy(self.keys[..., start:end, :]), "v": _copy(self.values[..., start:end, :])}

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
