"""The Gated DeltaNet forward inside a branch, shared by the model families.

It computes what mlx-lm's module computes, in the same order with the same
functions (so the outputs and the cache are bit-identical: tests pin this
against the unpatched module), and hands the recurrence's inputs to the
`RecurrentLayer`. Outside a branch the adapted module calls mlx-lm's own
`__call__` instead, so the optimized kernel path is untouched.

A family supplies only `project(module, inputs) -> (qkv, z, b, a)`: the
conv input rows [B, S, C], the gate z [B, S, Hv, Dv] and the b, a logits.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as gd

from ..errors import BranchError
from ..layers.recurrent import RecurrentLayer, Steps


def _recurrence(module, k: mx.array):
    """The function `gated_delta_update` dispatches to for these shapes and device."""
    use_kernel = not module.training
    if (
        not use_kernel
        or mx.default_device() != mx.gpu
        or not mx.metal.is_available()
        or k.shape[-1] < 32
        or k.shape[-1] % 32 != 0
    ):
        return gd.gated_delta_ops
    return gd.gated_delta_kernel


def _replay(recurrence, inputs: dict, state):
    _, state = recurrence(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], state, inputs["mask"]
    )
    return state


def conv_inputs(module, project, inputs: mx.array, mask, cache):
    """(qkv, z, b, a, conv input) as mlx-lm's module derives them: [cached tail | masked qkv rows]."""
    B = inputs.shape[0]
    qkv, z, b, a = project(module, inputs)
    if cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, module.conv_kernel_size - 1, module.conv_dim), dtype=inputs.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    return qkv, z, b, a, mx.concatenate([conv_state, qkv], axis=1)


def heads(module, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """q, k, v per head from the conv output, q and k normalized as mlx-lm's module does."""
    B, S, _ = conv_out.shape
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [module.key_dim, 2 * module.key_dim], -1),
            [module.num_k_heads, module.num_k_heads, module.num_v_heads],
            [module.head_k_dim, module.head_k_dim, module.head_v_dim],
        )
    ]
    q, k = gd.normalize_qk(q, k, inv_scale=module.head_k_dim**-0.5, eps=1e-6)
    return q, k, v


def reduce_shards(module, out: mx.array) -> mx.array:
    """The module's output summed over its tensor-parallel group, as mlx-lm's sharded module does.

    A sharded module (`Model.shard()`: qwen3_5) holds a slice of the heads and
    of the conv channels; its `out_proj` gives this rank's partial sum, and
    mlx-lm's `__call__` ends with an `all_sum` over `sharding_group`. The
    recurrence and everything a branch records stay per rank: each rank's
    segments hold its slice.
    """
    group = getattr(module, "sharding_group", None)
    return out if group is None else mx.distributed.all_sum(out, group=group)


def branch_forward(module, project, inputs: mx.array, mask, cache: RecurrentLayer) -> mx.array:
    """One GDN forward inside a branch; records its `Steps` in `cache`."""
    if cache.lengths is not None or cache.left_padding is not None:
        raise BranchError("batched (padded) recurrent caches cannot be forwarded inside a branch")
    if cache.tree is not None:
        return tree_forward(module, project, inputs, mask, cache)
    B, S, _ = inputs.shape
    qkv, z, b, a, conv_input = conv_inputs(module, project, inputs, mask, cache)
    cache[0] = mx.contiguous(conv_input[:, -(module.conv_kernel_size - 1) :, :])
    conv_out = nn.silu(module.conv1d(conv_input))

    q, k, v = heads(module, conv_out)
    state = cache[1]

    # As gated_delta_update does, but keeping g and beta: the replay must see
    # the very values the forward used.
    beta = mx.sigmoid(b)
    g = gd.compute_g(module.A_log, a, module.dt_bias)
    if state is None:
        state = mx.zeros((B, module.num_v_heads, module.head_v_dim, module.head_k_dim), dtype=mx.float32)
    recurrence = _recurrence(module, k)
    recorded = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "mask": mask}

    if cache.strategy == "states":
        # Past the layer's budget the same per-token loop runs (same outputs)
        # but keeps no states: commit then replays from the last kept one.
        keep = cache.keeps_states(S, state.nbytes)
        outs, states = [], []
        for t in range(S):
            step_mask = None if mask is None else mask[:, t : t + 1]
            y, state = recurrence(
                q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1],
                g[:, t : t + 1], beta[:, t : t + 1], state, step_mask,
            )
            outs.append(y)
            if keep:
                states.append(state)
        out = outs[0] if S == 1 else mx.concatenate(outs, axis=1)
        states = states if keep else None
    else:
        out, state = recurrence(q, k, v, g, beta, state, mask)
        states = None

    cache.record(Steps(qkv, recorded, partial(_replay, recurrence), states))
    cache[1] = state
    cache.advance(S)

    out = module.norm(out, z)
    return reduce_shards(module, module.out_proj(out.reshape(B, S, -1)))


def tree_forward(module, project, inputs: mx.array, mask, cache: RecurrentLayer) -> mx.array:
    """A tree of N nodes per row in one forward (layers/tree.py; one row's `Tree`, or a list of
    one per row): node i's conv reads its ancestors' rows and its recurrence starts from its
    parent's state: one step per depth, the nodes of that depth (of every row) as rows of it
    (the function `gated_delta_update` would dispatch to, T = 1 per call: the ops path on CPU,
    the kernel on Metal; rows never mix). Records one `Steps` with the trees' parents;
    `take_path` / `take_paths` make it a chain."""
    trees = cache.tree if isinstance(cache.tree, list) else [cache.tree]
    B, N, _ = inputs.shape
    if B != len(trees) or mask is not None:
        raise BranchError(f"a tree forward takes one unpadded row per tree ({B} rows, {len(trees)} trees)")
    width = module.conv_kernel_size
    qkv, z, b, a, conv_input = conv_inputs(module, project, inputs, None, cache)
    batch = mx.arange(B)[:, None, None]
    windows = conv_input[batch, mx.array([t.conv_windows(width) for t in trees], dtype=mx.int32)]  # [B, N, width, C]
    conv_out = nn.silu(module.conv1d(windows.reshape(B * N, width, -1))).reshape(B, N, -1)
    q, k, v = heads(module, conv_out)
    beta = mx.sigmoid(b)
    g = gd.compute_g(module.A_log, a, module.dt_bias)
    before = cache[1]
    if before is None:
        before = mx.zeros((B, module.num_v_heads, module.head_v_dim, module.head_k_dim), dtype=mx.float32)
    recurrence = _recurrence(module, k)
    outs = [[None] * N for _ in range(B)]
    states = [[None] * B for _ in range(N)]  # node i: each row's state after it
    levels = [t.levels() for t in trees]
    for depth in range(max(len(lv) for lv in levels)):  # the nodes of one depth as rows of one step
        nodes = [(r, i) for r, lv in enumerate(levels) if depth < len(lv) for i in lv[depth]]
        at = mx.array([r for r, _ in nodes], dtype=mx.int32), mx.array([i for _, i in nodes], dtype=mx.int32)
        rows = lambda x: x[at][:, None]  # [B, N, ...] -> [m, 1, ...]: node j of the level is row j
        start = mx.concatenate([before[r : r + 1] if trees[r].parents[i] < 0 else states[trees[r].parents[i]][r]
                                for r, i in nodes])
        y, state = recurrence(rows(q), rows(k), rows(v), rows(g), rows(beta), start, None)
        for j, (r, i) in enumerate(nodes):
            outs[r][i], states[i][r] = y[j : j + 1], state[j : j + 1]
    keep = cache.keeps_states(N, before.nbytes)
    recorded = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "mask": None}
    cache.record(Steps(qkv, recorded, partial(_replay, recurrence), states if keep else None,
                       tuple(t.parents for t in trees)))
    # the live slots as after each row's last node's path (take_path / take_paths set the kept paths')
    tails = [(list(range(width - 1)) + [width - 1 + i for i in t.path(N - 1)])[-(width - 1):] for t in trees]
    cache[0] = mx.contiguous(conv_input[mx.arange(B)[:, None], mx.array(tails, dtype=mx.int32)])
    cache[1] = mx.concatenate(states[-1])
    cache.advance(N)
    out = mx.concatenate([mx.concatenate(row, axis=1) for row in outs])
    out = module.norm(out, z)
    return reduce_shards(module, module.out_proj(out.reshape(B, N, -1)))
