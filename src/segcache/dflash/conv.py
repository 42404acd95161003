"""DFlash2's grouped dynamic causal convolution, around each drafter layer's attention and MLP.

Over the block's positions t = 0 .. L-1 (the pending token, then the masks), one channel
group g of `group_size` channels at a time:

    out[t, g] = sum over o < K of (base[o, g] + taps[t, o, g]) * x[t - o, g]     x[t - o] = 0 for t < o

`base` [K, H] is a learned kernel per channel; `taps` [L, K, G] are computed from the layer's
input at t (one scalar per offset and group, shared by the group's channels). The reach is
the block only: position 0 sees no committed context, so the drafter's context cache (the
context K/V, segment.py) needs nothing more for DFlash2, and a row's convolution never sees
another row's positions. One `kernel_projection` gives the taps of both convolutions of a
pair from the same input: `before` convolves that input and keeps the second taps, `after`
convolves the sublayer's output with them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def convolve(x: mx.array, taps: mx.array, base: mx.array, group_size: int) -> mx.array:
    """The causal convolution of `x` [B, L, H] over its positions with kernel `base` [K, H] plus the
    per-position, per-group `taps` [B, L, K, G] (G = H / group_size)."""
    B, L, H = x.shape
    K = base.shape[0]
    G = H // group_size
    grouped = x.reshape(B, L, G, group_size)
    padded = mx.pad(grouped, [(0, 0), (K - 1, 0), (0, 0), (0, 0)]) if K > 1 else grouped
    kernel = base.astype(x.dtype).reshape(K, G, group_size)
    out = None
    for o in range(K):
        shifted = padded[:, K - 1 - o : K - 1 - o + L]  # x[t - o] at t
        term = (kernel[o] + taps[:, :, o, :, None]) * shifted
        out = term if out is None else out + term
    return out.reshape(B, L, H)


class GroupedDynamicCausalConv(nn.Module):
    """Two convolutions of reach `kernel_size` with dynamic taps per `group_size` channels (the
    published names: `base_kernel` [2, K, H], `kernel_projection` H -> 2 * K * groups)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def before(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(the first convolution of `x` [B, L, H], the second's taps [B, L, K, G]): both taps from `x`."""
        taps = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return convolve(x, taps[..., 0, :, :], self.base_kernel[0], self.group_size), taps[..., 1, :, :]

    def after(self, y: mx.array, taps: mx.array) -> mx.array:
        """The second convolution, of the sublayer's output `y` [B, L, H] with `taps` from `before`."""
        return convolve(y, taps, self.base_kernel[1], self.group_size)
