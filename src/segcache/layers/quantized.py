"""Quantized full-attention KV segment: mlx-lm's `QuantizedKVCache` plus a branch stack.

`generate_step(..., kv_bits=b)` swaps each `KVLayer` of `rt.cache` for what
`to_quantized` returns; segcache returns this kind, and the runtime adopts it
at its next operation (`Runtime._own_layers`). Quantization is per row (groups
run along the head dimension), so a row's bytes depend only on that token's
keys and values, and the buffer is append-only exactly as `KVLayer`'s:

    (w_q, scales, biases) for keys and values, each [B, H, T, ...]
            [ committed ........ | branch 1 ..... | branch 2 ... | free ]
            0                    marks[0]         marks[1]       offset  capacity

so a branch is its starting offset, `commit(n)` and `rollback` move `offset`,
and the committed rows are the bytes mlx-lm's `QuantizedKVCache` holds when fed
exactly the kept tokens. Rows a rolled back branch wrote lie past `offset`.

For the prefix store a quantized layer is a "pages" kind of its own layout
(`["kv_quantized", group_size, bits]`, part of the store identity, so records
of other bit widths and group sizes never meet): a page holds the quantized
rows as they are, six arrays (keys and values, each packed elements, scales
and biases), so it is smaller than the unquantized page by about bits / 16 (for
16-bit K/V) and resumes without requantizing.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from ..errors import BranchError, InvariantError, UnsupportedOperationError
from .compat import MlxCompat
from .offset_branches import OffsetBranches
from .protocol import PAGES

# the record names of the six quantized parts: keys then values, each (packed, scales, biases)
PARTS = ("kq", "ks", "kb", "vq", "vs", "vb")


def _views(parts):
    """New array objects over the same data, one per quantized component."""
    return None if parts is None else tuple(a[...] for a in parts)


class QuantizedKVLayer(MlxCompat, OffsetBranches, QuantizedKVCache):
    """mlx-lm's `QuantizedKVCache` (same update path, same quantized SDPA) plus a branch stack."""

    takes_trees = True  # OffsetBranches.tree_begin / take_path (rows quantize one by one)

    def __init__(self, group_size: int = 64, bits: int = 8):
        super().__init__(group_size=group_size, bits=bits)

    @classmethod
    def of(cls, keys, values, offset: int, group_size: int, bits: int) -> "QuantizedKVLayer":
        """A layer holding `offset` tokens of unquantized `keys`/`values` ([B, H, T, D], T >= offset),
        quantized as mlx-lm's `KVCache.to_quantized` does (the whole buffer, one call)."""
        layer = cls(group_size=group_size, bits=bits)
        layer.offset = offset
        if keys is not None:
            layer.keys = tuple(mx.quantize(keys, group_size=group_size, bits=bits))
            layer.values = tuple(mx.quantize(values, group_size=group_size, bits=bits))
        return layer

    def kv_form(self) -> tuple[int, int]:
        """(group_size, bits): this layer holds quantized K/V (layers.compat)."""
        return self.group_size, self.bits

    def clone(self) -> "QuantizedKVLayer":
        """An independent layer holding the committed tokens (shares the buffers until a write)."""
        other = QuantizedKVLayer(self.group_size, self.bits)
        other.keys, other.values = _views(self.keys), _views(self.values)
        other.offset = self.committed_offset
        return other

    # -- the rest of mlx-lm's cache protocol (layers.compat) -------------------------

    @property
    def state(self):
        """(keys, values, offset, group_size, bits) of the committed tokens (`save_prompt_cache`)."""
        n = self.committed_offset
        if self.marks and self.keys is not None:
            cut = lambda parts: tuple(a[..., :n, :] for a in parts)
            return cut(self.keys), cut(self.values), n, self.group_size, self.bits
        return self.keys, self.values, n, self.group_size, self.bits

    @state.setter
    def state(self, v) -> None:
        if self.marks:
            raise BranchError("setting state with an open branch: commit or roll it back first")
        keys, values, self.offset, self.group_size, self.bits = v
        self.keys = None if keys is None else tuple(keys)
        self.values = None if values is None else tuple(values)

    @classmethod
    def from_state(cls, state) -> "QuantizedKVLayer":
        """A layer holding `state` (mlx-lm's `load_prompt_cache` calls this)."""
        layer = cls(group_size=int(state[3]), bits=int(state[4]))
        layer.state = state
        return layer._checked()

    @classmethod
    def merge(cls, caches):
        raise UnsupportedOperationError(
            "QuantizedKVLayer.merge() (mlx-lm's BatchGenerator): quantized KV is not batched "
            "(mlx-lm's QuantizedKVCache is not either); merge the layers before quantizing them"
        )

    # -- persistence protocol (layers.protocol) ------------------------------------

    resumes_from = PAGES

    def layout(self) -> list:
        return ["kv_quantized", self.group_size, self.bits]

    def export_rows(self, start: int, end: int, *, share: bool = False) -> dict[str, mx.array]:
        """Copies of the committed quantized rows of positions [start, end), token axis 2
        (with `share`, views of the buffers: see `KVLayer.export_rows`).

        Raises:
            ValueError: the range is empty or reaches past the committed tokens.
        """
        if not 0 <= start < end <= self.committed_offset:
            raise ValueError(f"export_rows({start}, {end}): need 0 <= start < end <= {self.committed_offset}")
        parts = (*self.keys, *self.values)
        if share:
            return {name: a[..., start:end, :] for name, a in zip(PARTS, parts)}
        return {name: a[..., start:end, :] * 1 for name, a in zip(PARTS, parts)}  # own buffers: pin nothing

    def spec(self, probe, tokens: int) -> dict:
        return {name: (dtype, (*shape[:2], tokens, *shape[3:])) for name, (dtype, shape) in probe.items()}

    def state_from(self, arrays, meta, tokens: int) -> tuple:
        """The six parts from their row chunks, with room for the next step's rows (as `KVLayer`)."""
        chunks = [arrays.get(name) for name in PARTS]
        if any(not c for c in chunks) or len({len(c) for c in chunks}) != 1:
            raise ValueError(f"quantized K/V state lacks some of {PARTS} or their chunks do not pair up")
        for row in zip(*chunks):
            if any(a.ndim != 4 for a in row) or len({a.shape[:3] for a in row}) != 1:
                raise ValueError(f"quantized K/V chunks of shapes {[a.shape for a in row]} do not line up")
        firsts = [c[0] for c in chunks]
        for c, first in zip(chunks, firsts):
            if any(a.shape[:2] != first.shape[:2] or a.shape[3] != first.shape[3] or a.dtype != first.dtype for a in c):
                raise ValueError("quantized K/V chunks differ in heads, width or dtype")
        held = sum(a.shape[2] for a in chunks[0])
        if held != tokens:
            raise ValueError(f"quantized K/V chunks hold {held} tokens, not {tokens}")
        B, H = firsts[0].shape[:2]
        parts = tuple(mx.concatenate([*c, mx.zeros((B, H, self.step, c[0].shape[3]), c[0].dtype)], axis=2) for c in chunks)
        return parts[:3], parts[3:], tokens

    def load(self, keys: tuple, values: tuple, offset: int) -> None:
        """Replace the cache by the first `offset` rows of the quantized `keys` / `values` (3 parts each).

        The layer takes the arrays as its buffers and writes the next rows in place.

        Raises:
            BranchError: a branch is open.
            ValueError: the parts do not line up or hold fewer than `offset` rows.
        """
        if self.marks:
            raise BranchError("load() with an open branch: commit or roll it back first")
        parts = (*keys, *values)
        if len(parts) != 6 or any(a.ndim != 4 for a in parts) or len({a.shape[:3] for a in parts}) != 1:
            raise ValueError(f"load(): quantized parts of shapes {[getattr(a, 'shape', a) for a in parts]}")
        if not 0 < offset <= parts[0].shape[2]:
            raise ValueError(f"load(): {offset} tokens for buffers of {parts[0].shape[2]} rows")
        self.keys, self.values, self.offset = tuple(keys), tuple(values), offset

    def check(self) -> None:
        where = f"QuantizedKVLayer(offset={self.offset}, marks={self.marks}, bits={self.bits})"
        self.check_marks(where)
        if self.keys is None or self.values is None:
            if self.offset != 0 or (self.keys is None) != (self.values is None):
                raise InvariantError(f"{where}: tokens counted but no buffer")
            return
        shapes = {a.shape[:3] for a in (*self.keys, *self.values)}
        if len(self.keys) != 3 or len(self.values) != 3 or len(shapes) != 1:
            raise InvariantError(f"{where}: quantized parts do not line up: {sorted(shapes)}")
        if self.offset > self.keys[0].shape[2]:
            raise InvariantError(f"{where}: buffer of {self.keys[0].shape[2]} rows does not hold the offset")
