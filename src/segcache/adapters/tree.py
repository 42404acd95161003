"""A model's attention during a tree forward: each node rotated at its own position.

Attention modules call `self.rope(x, offset=cache.offset)`, which rotates the
block's tokens at offset, offset + 1, ...; a tree's node i stands at
offset + depth(i) (layers/tree.py). For the forward only, each attention
module's `rope` is a `TreeRope` over the model's own: the nodes move to the
batch axis and mlx's rope takes one offset per row, so node i is rotated by
the same function at the same position as in a chain forward of its path.
Nothing changes outside a tree forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..layers.tree import Tree


class TreeRope(nn.Module):
    """Stands in for a rope module: x [B, H, N, D] rotated node by node, row b's node i at
    `positions`[b * N + i]."""

    def __init__(self, rope: nn.Module, positions: mx.array):
        super().__init__()
        self.inner = rope
        self.positions = positions

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        B, H, N, D = x.shape
        if B == 1:
            return self.inner(x.transpose(2, 1, 0, 3), offset=self.positions).transpose(2, 1, 0, 3)
        nodes = x.transpose(0, 2, 1, 3).reshape(B * N, H, 1, D)  # every row's nodes on the batch axis
        out = self.inner(nodes, offset=self.positions)
        return out.reshape(B, N, H, D).transpose(0, 2, 1, 3)


def rope_modules(model) -> list:
    """The modules of `model` holding a rope module as `rope` (its attention layers)."""
    return [m for _, m in model.named_modules() if isinstance(m.get("rope"), nn.Module)]


@contextmanager
def tree_mode(ropes: list, layers: list, trees, positions: mx.array):
    """While open: every layer builds the trees' mask (or runs its recurrence per node) and every
    module of `ropes` rotates the nodes at `positions` (offset + depth; of every row, row-major).
    `trees`: what the layers' `tree_begin` takes (a `Tree`; a batch's kinds: one per row).
    Everything is put back on exit."""
    swapped, begun = [], []
    try:
        for layer in layers:
            layer.tree_begin(trees)
            begun.append(layer)
        for module in ropes:
            own = module["rope"]
            module.rope = TreeRope(own, positions)
            swapped.append((module, own))
        yield
    finally:
        for module, own in swapped:
            module.rope = own
        for layer in begun:
            layer.tree_end()


def verify_tree(model, ropes: list, layers: list, tree: Tree, offset: int, ids: list[int]) -> mx.array:
    """The model's forward of the tree's tokens `ids` on `layers` (holding `offset` tokens) in
    tree mode; a forward that fails half-way leaves every layer as it was."""
    saved = [layer.savepoint() for layer in layers]
    try:
        with tree_mode(ropes, layers, tree, tree.positions(offset)):
            return model(mx.array(ids, dtype=mx.uint32)[None], cache=layers)
    except BaseException:
        for layer, point in zip(layers, saved):
            layer.restore(point)
        raise


def verify_trees(model, ropes: list, layers: list, trees: list[Tree], lengths: list[int],
                 ids: list[list[int]]) -> mx.array:
    """The model's forward of B rows' trees (row b's tokens `ids[b]`, all of one size, on batched
    `layers` where row b holds lengths[b] tokens) in tree mode: logits [B, N, V]."""
    positions = mx.concatenate([t.positions(n) for t, n in zip(trees, lengths)])
    with tree_mode(ropes, layers, trees, positions):
        return model(mx.array(ids, dtype=mx.uint32), cache=layers)
