"""mlx-lm's KV cache quantization (`kv_bits`, `kv_group_size`, `quantized_kv_start`) as a Runtime setting.

mlx-lm's `generate_step` calls `maybe_quantize_kv_cache` after every model call
(each prefill chunk, each decode step, each speculative step): every cache that
has a `to_quantized` and holds `quantized_kv_start` tokens or more is replaced
by its quantized form, whose later rows are quantized as they are written.
Rows computed before that moment saw full-precision attention, rows after it
quantized attention, so *where* the switch happens changes the numbers.

A Runtime with a `KVQuantization` makes the same switch at the same moments:
after every `forward` outside a branch and at the commit that closes the
outermost branch (a switch inside a branch would turn rows that may still be
rolled back into committed quantized rows). Plain generation therefore feeds
mlx-lm's chunks and switches where mlx-lm's `generate_step` does: greedy text is
identical. Speculative rounds switch at the first commit at or past the start
rather than at the exact token.

Only full-attention KV layers switch (mlx-lm's `KVCache`); recurrent layers have
nothing to quantize (mlx-lm skips `ArraysCache` too), and a sliding-window layer
has no quantized form (mlx-lm's `RotatingKVCache.to_quantized` raises), so a
Runtime refuses the setting on a model that has one.
"""

from __future__ import annotations

from dataclasses import dataclass

# mlx_lm.generate.DEFAULT_QUANTIZED_KV_START (mlx_lm.server's too)
DEFAULT_START = 5000
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class KVQuantization:
    """When and how a Runtime quantizes its full-attention KV layers.

    Attributes:
        bits: bits per quantized element (mlx-lm's `kv_bits`).
        group_size: elements sharing one scale and bias (`kv_group_size`).
        start: layers switch once they hold this many tokens (`quantized_kv_start`).

    Raises:
        ValueError: MLX cannot quantize with these bits and group size, or start < 0.
    """

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE
    start: int = DEFAULT_START

    def __post_init__(self) -> None:
        for name in ("bits", "group_size", "start"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"kv quantization: {name} must be an int, got {value!r}")
        if self.start < 0:
            raise ValueError(f"quantized_kv_start must be >= 0, got {self.start}")
        import mlx.core as mx

        try:  # ask MLX itself which (bits, group size) it quantizes with
            mx.quantize(mx.zeros((1, self.group_size)), group_size=self.group_size, bits=self.bits)
        except ValueError as exc:
            raise ValueError(
                f"kv_bits={self.bits} with kv_group_size={self.group_size}: MLX cannot quantize with these "
                f"({exc}); e.g. kv_bits 4 or 8 with kv_group_size 32, 64 or 128"
            ) from None

    @classmethod
    def of(cls, kv_bits, kv_group_size=DEFAULT_GROUP_SIZE, quantized_kv_start=DEFAULT_START):
        """The setting for mlx-lm's three arguments; None when `kv_bits` is None (no quantization)."""
        if kv_bits is None:
            return None
        return cls(kv_bits, kv_group_size, quantized_kv_start)

    def describe(self) -> str:
        return f"kv_bits={self.bits}, kv_group_size={self.group_size}, quantized_kv_start={self.start}"
