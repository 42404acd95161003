"""Chunked Gated DeltaNet prefill: the recurrence in matrix products, chunk by chunk.

mlx-lm's `gated_delta_ops` runs the gated delta rule one token at a time
(on the CPU and CUDA there is no fused kernel). Per value head, with the
state S as a [Dk, Dv] matrix (mlx-lm keeps its transpose, [Dv, Dk]):

    S_t = g_t S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - g_t S_{t-1}^T k_t),   o_t = S_t^T q_t

Within a chunk of C tokens starting from S_0, with G_t = g_1 ... g_t (a
cumulative product, taken as exp of a cumulative sum of log g), unrolling
gives (rows are time; the WY / UT form of flash-linear-attention):

    D = U - W S_0                       U = T diag(beta) V,  W = T diag(beta G) K
    T = (I + strict_lower(diag(beta) (G_t/G_i) K K^T))^-1        (unit lower triangular)
    O = diag(G) Q S_0 + P D             P = lower_incl((G_t/G_i) Q K^T)
    S_C = G_C S_0 + K'^T D              K' = diag(G_C/G) K

Everything but S_0 is independent across chunks, so it is computed for many
chunks at once (batched matrix products); only D and S_C run once per chunk,
in order (two products each, batched over heads). Chunks are processed in
groups so the extra memory stays O(group * C^2) per head, whatever the
prompt length.

A masked step (mlx-lm keeps the old state there) becomes g = 1, beta = 0: the
state passes through unchanged. Outputs at masked positions are padding;
mlx-lm's own are not meaningful there either, and they are not compared.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn
from mlx_lm.models import gated_delta as gd

from .gated_delta import conv_inputs, heads, reduce_shards

CHUNK = 64  # tokens per chunk (flash-linear-attention's choice; the matrices are C x C)
GROUP = 16  # chunks computed together: bounds the extra memory, keeps the products large
# log g below this is taken as this: exp(-80) ~ 2e-35 is a reset in fp32 already, and a
# floor keeps cumulative sums finite (g == 0 would give -inf - -inf = nan).
LOG_G_FLOOR = -80.0


def _unit_lower_inverse(L: mx.array, products: bool | None = None) -> mx.array:
    """(I + L)^-1 for strictly lower triangular L [..., C, C], C a power of two.

    On the CPU, LAPACK's triangular inverse (mx.linalg, CPU only; 8x faster
    than the products below at C = 64). Elsewhere: L is nilpotent (L^C = 0), so
    (I + L)^-1 = sum_j (-L)^j = (I - L)(I + L^2)(I + L^4)... : 2 log2(C) - 1
    batched matrix products, which any device runs (`products`: force either way).
    """
    C = L.shape[-1]
    eye = mx.eye(C, dtype=L.dtype)
    if products is None:
        products = mx.default_device() != mx.cpu
    if not products:
        return mx.linalg.tri_inv(eye + L, upper=False, stream=mx.cpu)
    inv = eye - L
    power = L
    for _ in range(int(math.log2(C)) - 1):
        power = power @ power
        inv = inv + inv @ power
    return inv


def _chunk_group(q, k, v, log_g, beta, S):
    """Outputs of a group of m chunks and the state after them.

    Shapes (Hk key heads, r = Hv // Hk value heads per key head; q and k
    broadcast over r): q, k [B, Hk, 1, m, C, Dk]; v [B, Hk, r, m, C, Dv];
    log_g, beta [B, Hk, r, m, C]; S [B, Hk, r, Dk, Dv].
    """
    C = q.shape[-2]
    cum = mx.cumsum(log_g, axis=-1)  # log G_t, inclusive
    diff = cum[..., :, None] - cum[..., None, :]  # log(G_t / G_i), row t, column i
    rows = mx.arange(C)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    # Mask before exp: above the diagonal diff is positive and could overflow.
    decay = mx.exp(mx.where(incl, diff, -mx.inf))
    kT = k.swapaxes(-1, -2)

    L = mx.where(strict, beta[..., None] * decay * (k @ kT), 0.0)
    T = _unit_lower_inverse(L)
    G = mx.exp(cum)
    U = T @ (beta[..., None] * v)  # [.., C, Dv]
    W = T @ ((beta * G)[..., None] * k)  # [.., C, Dk]
    P = decay * (q @ kT)  # inclusive of the diagonal
    last = cum[..., -1:]
    KdT = (k * mx.exp(last - cum)[..., None]).swapaxes(-1, -2)  # rows decayed to the chunk's end
    G_end = mx.exp(last)[..., None]  # [.., m, 1, 1]

    # Only this loop is sequential: two products per chunk, batched over heads.
    starts, deltas = [], []
    for j in range(q.shape[3]):
        starts.append(S)
        D = mx.addmm(U[:, :, :, j], W[:, :, :, j], S, alpha=-1.0)  # U - W S_0
        deltas.append(D)
        S = mx.addmm(G_end[:, :, :, j] * S, KdT[:, :, :, j], D)  # G_C S_0 + K'^T D
    O = (G[..., None] * q) @ mx.stack(starts, axis=3) + P @ mx.stack(deltas, axis=3)
    return O, S


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    chunk: int = CHUNK,
    group: int = GROUP,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a block, chunked; the contract of `gated_delta_ops`.

    Args:
        q, k: [B, T, Hk, Dk], normalized as mlx-lm's `normalize_qk` leaves them.
        v: [B, T, Hv, Dv], Hv a multiple of Hk.
        g: [B, T, Hv] decays in (0, 1] (vector gating, [B, T, Hv, Dk], falls back to
            `gated_delta_ops`).
        beta: [B, T, Hv].
        state: [B, Hv, Dv, Dk] or None (zeros).
        mask: [B, T] bool or None; a False step leaves the state unchanged.
        chunk: tokens per chunk, a power of two.
        group: chunks computed together.

    Returns:
        (y [B, T, Hv, Dv] in q's dtype, state [B, Hv, Dv, Dk]). Computed in fp32;
        agrees with `gated_delta_ops` within float rounding, not bit for bit.
    """
    if g.ndim != 3:
        return gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    if chunk < 2 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 2, got {chunk}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    r = Hv // Hk
    chunk = min(chunk, 1 << max(T - 1, 1).bit_length())  # a short block pads to a power of two, not 64
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    state_dtype = (state[:0, :0, :0, :0] * g[:0, :0, :0, None]).dtype  # what gated_delta_ops returns
    f32, out_dtype = mx.float32, q.dtype

    log_g = mx.maximum(mx.log(g.astype(f32)), LOG_G_FLOOR)
    beta = beta.astype(f32)
    if mask is not None:
        log_g = mx.where(mask[..., None], log_g, 0.0)
        beta = mx.where(mask[..., None], beta, 0.0)

    # Pad to whole chunks with identity steps (g = 1, beta = 0); their outputs are dropped.
    n = -(-T // chunk)
    pad = n * chunk - T
    q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    if pad:
        q, k, v, log_g, beta = (
            mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, log_g, beta)
        )

    # Value head h belongs to key head h // r (mlx-lm repeats q and k r times).
    q = q.reshape(B, n, chunk, Hk, 1, Dk).transpose(0, 3, 4, 1, 2, 5)
    k = k.reshape(B, n, chunk, Hk, 1, Dk).transpose(0, 3, 4, 1, 2, 5)
    v = v.reshape(B, n, chunk, Hk, r, Dv).transpose(0, 3, 4, 1, 2, 5)
    log_g = log_g.reshape(B, n, chunk, Hk, r).transpose(0, 3, 4, 1, 2)
    beta = beta.reshape(B, n, chunk, Hk, r).transpose(0, 3, 4, 1, 2)
    S = state.astype(f32).reshape(B, Hk, r, Dv, Dk).swapaxes(-1, -2)

    outs = []
    for a in range(0, n, group):
        part = slice(a, min(n, a + group))
        O, S = _chunk_group(q[:, :, :, part], k[:, :, :, part], v[:, :, :, part], log_g[..., part, :], beta[..., part, :], S)
        outs.append(O)
    O = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    y = O.transpose(0, 3, 4, 1, 2, 5).reshape(B, n * chunk, Hv, Dv)
    if pad:
        y = y[:, :T]
    state = S.swapaxes(-1, -2).reshape(B, Hv, Dv, Dk)
    return y.astype(out_dtype), state.astype(state_dtype)


# -- the module forward outside branches ------------------------------------------

GDN_PREFILL = ("auto", "chunked", "native")
# Blocks shorter than this keep mlx-lm's path (bench/hotpath.py --crossover measures
# where the chunked forward starts to win; see docs/benchmarks.md).
CHUNKED_FROM = 8


def default_gdn_prefill() -> str:
    """"native" on Metal (mlx-lm's fused kernel), "chunked" elsewhere (CPU, CUDA).

    Off Metal mlx-lm's recurrence is a per-token loop of small operations;
    the chunked form runs in matrix products (bench/hotpath.py). On Metal the
    fused kernel has not been measured against it: only a Mac can.
    """
    on_metal = mx.default_device() == mx.gpu and mx.metal.is_available()
    return "native" if on_metal else "chunked"


def chunked_threshold(gdn_prefill: str) -> int | None:
    """The smallest block the chunked forward takes under `gdn_prefill`, or None (never)."""
    if gdn_prefill not in GDN_PREFILL:
        raise ValueError(f"gdn_prefill must be one of {GDN_PREFILL}, got {gdn_prefill!r}")
    if gdn_prefill == "auto":
        gdn_prefill = default_gdn_prefill()
    return CHUNKED_FROM if gdn_prefill == "chunked" else None


def takes_chunked(module, inputs: mx.array, cache) -> bool:
    """Whether this (non-branch) forward of `module` on a RecurrentLayer runs chunked."""
    return (
        cache.chunked_from is not None
        and inputs.shape[1] >= cache.chunked_from
        and not module.training
    )


def _depthwise_conv(conv: nn.Conv1d, x: mx.array) -> mx.array:
    """`conv(x)` for mlx-lm's depthwise, unpadded GDN conv, as K shifted multiply-adds.

    MLX's CPU grouped convolution runs one group at a time: with 8,192
    channels it cost more than the recurrence itself (~0.7 ms per token per
    layer at Qwen3-Next's sizes). The sum is the same; its rounding may differ.
    """
    w = conv.weight  # [C, K, 1]: out channels, taps, in channels per group
    C = w.shape[0]
    if w.shape[2] != 1 or conv.groups != C or x.shape[-1] != C:
        return conv(x)
    y = _shifted_sum(x, w[:, :, 0].T)
    if "bias" in conv:
        y = y + conv.bias
    return y


@mx.compile
def _shifted_sum(x: mx.array, taps: mx.array) -> mx.array:
    """sum_j x[:, j : j + L] * taps[j], L = T - K + 1 (one fused pass when compiled)."""
    K = taps.shape[0]
    L = x.shape[1] - K + 1
    y = x[:, 0:L] * taps[0]
    for j in range(1, K):
        y = y + x[:, j : j + L] * taps[j]
    return y


def _through_cuts(q, k, v, g, beta, state, mask, conv_input, cuts, n_keep: int, kept: dict):
    """The chunked recurrence restarted at each cut (positions in (0, T), ascending), as forwards
    that stopped there run it: the same chunks from the same states. The conv tail and state at
    each cut go to `kept[cut]`; returns (y over all T, the state after T).

    Only the recurrence is split: every other operation of the layer is per token (projections,
    the causal conv over [tail | rows], norms), so one forward over T gives each position what
    the split forwards give, up to the rounding of products over more rows."""
    T = q.shape[1]
    ys = []
    for a, b in zip((0, *cuts), (*cuts, T)):
        piece = slice(a, b)
        y, state = chunked_gated_delta(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], state,
                                       None if mask is None else mask[:, piece])
        ys.append(y)
        if b < T:  # conv_input is [tail | rows]: its rows b .. b+n_keep-1 are the tail after b tokens
            kept[b] = (mx.contiguous(conv_input[:, b : b + n_keep, :]), state)
    return mx.concatenate(ys, axis=1), state


def chunked_forward(module, project, inputs: mx.array, mask, cache) -> mx.array:
    """mlx-lm's Gated DeltaNet `__call__` with the chunked recurrence in place of its loop.

    Everything else is the module's own computation in the same order (the
    projections through the family's `project`, conv over the cached tail,
    silu, split, normalize_qk, compute_g, sigmoid(b), the mask where mlx-lm
    applies it, the gated norm, out_proj), and the cache is updated as
    mlx-lm's module updates it.
    """
    B, S, _ = inputs.shape
    qkv, z, b, a, conv_input = conv_inputs(module, project, inputs, mask, cache)
    n_keep = module.conv_kernel_size - 1
    if cache.lengths is not None:
        ends = mx.clip(cache.lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(_depthwise_conv(module.conv1d, conv_input))

    q, k, v = heads(module, conv_out)
    beta = mx.sigmoid(b)
    g = gd.compute_g(module.A_log, a, module.dt_bias)
    if cache.cuts and cache.lengths is None:
        out, state = _through_cuts(q, k, v, g, beta, cache[1], mask, conv_input, cache.cuts, n_keep, cache.cut_states)
    else:
        out, state = chunked_gated_delta(q, k, v, g, beta, cache[1], mask)
    cache[1] = state
    cache.advance(S)

    out = module.norm(out, z)
    return reduce_shards(module, module.out_proj(out.reshape(B, S, -1)))
