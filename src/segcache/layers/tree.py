"""A tree of draft nodes verified in one forward, and the masks its layers build.

    node      0 ── 1 ── 3            parents  [-1, 0, 0, 1, 2, 4]
               └── 2 ── 4 ── 5       depths   [ 0, 1, 1, 2, 2, 3]

Node 0 is the round's pending token (the last emitted, not yet fed); every
other node is a draft whose parent comes before it (parents[i] < i), so the
nodes are in an order where a prefix of any root path is a prefix of indices
along it. Node i stands at position P + depths[i] (P the tokens before the
tree) and attends to the committed prefix and to its ancestors, itself
included:

    keys      [ prefix: the K keys the layer returns before the tree | nodes 0 .. N-1 ]
    node i    old key j visible iff depths[i] + K - j < W   (no window: always)
              node a visible iff a is an ancestor-or-self of i and depths[i] - depths[a] < W

which is what a chain forward of i's root path (one block) gives each of its
tokens. A path is committed as that chain (`take_path` on every layer kind
that takes trees); a kind without the hook makes the model verify chains.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..errors import BranchError


class Tree:
    """The shape of a verify tree: each node's parent (node 0, the root, has -1).

    Raises:
        ValueError: not a tree in topological order (parents[0] == -1, 0 <= parents[i] < i).
    """

    def __init__(self, parents: Sequence[int]):
        parents = tuple(int(p) for p in parents)
        if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
            raise ValueError(
                f"parents {list(parents)!r:.80}: node 0 is the root (-1) and every other node's "
                "parent is an earlier node (0 <= parents[i] < i)"
            )
        self.parents = parents
        depths = [0]
        for p in parents[1:]:
            depths.append(depths[p] + 1)
        self.depths = tuple(depths)

    @property
    def size(self) -> int:
        return len(self.parents)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to `node`, both included."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def check_path(self, path: Sequence[int] | int) -> list[int]:
        """`path` as a list if it is a root path of this tree (or empty); an int n: nodes 0..n-1.

        Raises:
            BranchError: it is not; naming why.
        """
        if isinstance(path, int) and not isinstance(path, bool):
            if not 0 <= path <= self.size:
                raise BranchError(f"commit(n={path}): the branch holds a tree of {self.size} nodes")
            path = range(path)
        path = list(path)
        if not path:
            return path
        ok = path[0] == 0 and all(
            isinstance(b, int) and not isinstance(b, bool) and 0 < b < self.size and self.parents[b] == a
            for a, b in zip(path, path[1:])
        )
        if not ok:
            raise BranchError(
                f"commit(path={path!r:.80}): a path starts at node 0 and steps from each node to one of its "
                f"children (parents {list(self.parents)!r:.80}); nothing changed"
            )
        return path

    def levels(self) -> list[list[int]]:
        """The nodes of each depth, shallowest first (a node's parent is in the level before)."""
        out: list[list[int]] = [[] for _ in range(max(self.depths) + 1)]
        for i, d in enumerate(self.depths):
            out[d].append(i)
        return out

    def ancestors(self) -> list[list[bool]]:
        """row i: which nodes are ancestors of i, i included."""
        rows = []
        for i, p in enumerate(self.parents):
            row = list(rows[p]) if p >= 0 else [False] * self.size
            row[i] = True
            rows.append(row)
        return rows

    def positions(self, offset: int) -> mx.array:
        """Each node's position, offset + depth, [N] int32."""
        return mx.array([offset + d for d in self.depths], dtype=mx.int32)

    def conv_windows(self, width: int) -> list[list[int]]:
        """Per node, the rows of [tail (width-1 rows) | nodes] its causal conv reads, oldest first:
        its width-1 nearest ancestors (the tail's rows above the root) and itself."""
        tail = width - 1

        def up(row: int) -> int:  # the row fed just before `row` on its root path
            if row < tail:
                return row - 1
            parent = self.parents[row - tail]
            return tail + parent if parent >= 0 else tail - 1

        out = []
        for i in range(self.size):
            rows = [tail + i]
            while len(rows) < width:
                rows.append(up(rows[-1]))
            out.append(rows[::-1])
        return out


def tree_mask(tree: Tree, before: int, window: int | None = None) -> mx.array:
    """The [N, before + N] boolean mask of a tree forward (see the module docstring).

    Args:
        tree: the tree.
        before: keys the layer returns ahead of the tree's own (a KV layer: its
            offset; a window: the min(offset, max_size - 1) it keeps).
        window: the attention window (None: full attention).
    """
    depths = mx.array(tree.depths, dtype=mx.int32)[:, None]
    nodes = mx.array(tree.ancestors())
    if window is not None:
        nodes = nodes & (depths - depths.T < window)
    if not before:
        return nodes
    old = mx.ones((tree.size, before), dtype=mx.bool_)
    if window is not None:
        old = depths + before - mx.arange(before)[None] < window
    return mx.concatenate([old, nodes], axis=1)


def rows_tree_mask(trees: Sequence[Tree], lengths: Sequence[int], positions: mx.array,
                   window: int | None = None, lowest: mx.array | None = None) -> mx.array:
    """The [B, 1, N, T] boolean mask of a batched tree forward: row b's tree (all of N nodes,
    written at positions lengths[b] .. lengths[b] + N - 1 of its columns) over its keys.

    Args:
        trees: one tree per row, all of N nodes.
        lengths: the tokens each row held before the tree.
        positions: [B, T], the position each key column of row b holds (a KV row: its column;
            a window row: its start + column; columns past the nodes see nothing).
        window: the attention window (None: full attention).
        lowest: [B], a row's oldest position a block's queries may see (a window's), or None.

    Node i of row b (at lengths[b] + depth) sees an old key at p < lengths[b] (within the
    window: depth + lengths[b] - p < W) and node a's key iff a is an ancestor-or-self of i
    (within the window: depth(i) - depth(a) < W): what a chain forward of i's path gives it.
    """
    B, N = len(trees), trees[0].size
    depths = mx.array([t.depths for t in trees], dtype=mx.int32)  # [B, N]
    anc = mx.array([t.ancestors() for t in trees])  # [B, N, N]
    rel = positions - mx.array(list(lengths), dtype=mx.int32)[:, None]  # [B, T]: node index past the old keys
    T = rel.shape[1]
    node = mx.clip(rel, 0, N - 1)
    seen = mx.take_along_axis(anc, mx.broadcast_to(node[:, None, :], (B, N, T)), axis=2)
    nodes = ((rel >= 0) & (rel < N))[:, None, :] & seen
    old = (rel < 0)[:, None, :]
    if lowest is not None:
        old = old & (positions >= lowest[:, None])[:, None, :]
    if window is not None:
        old = old & (depths[:, :, None] - rel[:, None, :] < window)
        nodes = nodes & (depths[:, :, None] - mx.take_along_axis(depths, node, axis=1)[:, None, :] < window)
    return (old | nodes)[:, None]


def padded(tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]) -> tuple[list, list[Tree]]:
    """Every row's tree padded to the largest one's size with nodes under the root (token 0),
    which no path of the row's own tree reaches: (token lists, Trees)."""
    N = max(len(p) for p in parents)
    ids = [list(t) + [0] * (N - len(t)) for t in tokens]
    return ids, [Tree(list(p) + [0] * (N - len(p))) for p in parents]


class RowTrees:
    """Mixin for batched attention kinds (KV, window): a tree per row in one forward
    (`rows_tree_mask`), and each row's path copied down to where its branch began.

    The kind gives `_tree_mask(trees, window_size)` and `_column(i, position)` (the column
    of row i holding that position)."""

    takes_row_trees = True

    def tree_begin(self, trees: list[Tree]) -> None:
        """Before a batched tree forward: the model's mask is the trees'. An instance attribute,
        so the class's `make_mask` (every chain forward's) is untouched; `tree_end` removes it."""
        self.make_mask = lambda N, return_array=False, window_size=None, **_: self._tree_mask(trees, window_size)

    def tree_end(self) -> None:
        vars(self).pop("make_mask", None)

    def take_paths(self, paths: list[list[int]]) -> None:
        """The open branch, holding a tree per row, becomes row i's chain of `paths[i]`: its nodes'
        rows copied down to where the branch began (node j of the path to the branch's j-th)."""
        for i, (mark, path) in enumerate(zip(self.marks, paths)):
            if path != list(range(len(path))):
                base = self._column(i, mark)
                idx = path_index(base, path)
                for name in ("keys", "values"):
                    buf = getattr(self, name)
                    buf[i : i + 1, :, base : base + len(path), :] = buf[i : i + 1, :, idx, :]
        self.lengths = [m + len(p) for m, p in zip(self.marks, paths)]


def path_index(base: int, path: Sequence[int]) -> mx.array:
    """The buffer rows of `path`'s nodes for a tree fed from row `base`."""
    return mx.array([base + i for i in path], dtype=mx.int32)
