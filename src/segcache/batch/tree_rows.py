"""A BatchRuntime's tree rounds: a tree of drafts per row in one forward, a root path kept per row.

    br.fork()
    logits = br.forward_trees([[y_a, d, e, f], [y_b, g]], [[-1, 0, 0, 1], [-1, 0]])   # [B, N, V]
    br.keep_paths([[0, 2], [0, 1]])      # row a holds [y_a, e], row b [y_b, g]: chains, branch open
    br.commit([2, 1])                    # each row keeps some of its chain (the decoder's settle)

Rows carry trees of different sizes: every row's is padded to the largest with
nodes under its root (token 0), which none of its paths reach; a chain is a
tree whose nodes are one branch, a row that drafted nothing a tree of its
pending token alone. Row b's node i stands at position lengths[b] + depth and
sees its row's committed tokens and its ancestors (layers/tree.py:
`rows_tree_mask`; the GDN recurrence one step per depth over every row's
nodes of that depth, adapters/gated_delta.py). The forward seals the branch
(rows of different lengths follow it); `keep_paths` makes each row's branch
the chain of its path, as `Runtime.keep_path` does for one row, and the
batch's commit then keeps any prefix of it. Nothing here is on a chain
forward's path.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..adapters.tree import rope_modules, verify_trees
from ..errors import BranchError, UnsupportedOperationError
from ..layers.tree import Tree, padded


class TreeRows:
    """`takes_trees`, `forward_trees` and `keep_paths` of a `BatchRuntime`.

    Invariant: `_trees` is None, or the open branch (sealed) holds exactly the trees'
    padded nodes on every row (`_trees[i]`: row i's own tree, unpadded) and nothing else.
    """

    _ropes = None  # the model's rope modules (adapters/tree.py), found when first asked
    _trees: list | None = None

    @property
    def takes_trees(self) -> bool:
        """Whether `forward_trees` runs here: every layer's kind verifies a tree per row."""
        self._ropes = rope_modules(self.model) if self._ropes is None else self._ropes
        return bool(self._ropes) and all(getattr(layer, "takes_row_trees", False) for layer in self.cache)

    def forward_trees(self, tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]) -> mx.array:
        """One forward of a tree of drafts per row (node 0 its pending token) in a branch just
        opened; logits [B, N, V] (row i's valid at [:len(tokens[i])]); then `keep_paths`.

        Raises (changing nothing): ValueError (not one tree of one token per node per row),
        BranchError (no branch, or it holds tokens) or UnsupportedOperationError (not
        `takes_trees`).
        """
        trees = [Tree(p) for p in parents]
        if len(tokens) != len(self.rows) or not self.rows or any(len(t) != tr.size for t, tr in zip(tokens, trees)):
            raise ValueError(f"forward_trees(): one tree per row ({len(self.rows)} rows), one token per node")
        if not self.branch_open or any(r.branch_length for r in self.rows):
            raise BranchError("forward_trees() needs a branch just opened (fork()) that holds nothing yet")
        if not self.takes_trees:
            kinds = sorted({type(layer).__name__ for layer in self.cache if not getattr(layer, "takes_row_trees", False)})
            raise UnsupportedOperationError(f"forward_trees(): {kinds or 'no rope module'} verify no trees; verify chains")
        ids, shaped = padded(tokens, [t.parents for t in trees])
        logits = verify_trees(self.model, self._ropes, self.cache, shaped, self.lengths, ids)
        for row, t in zip(self.rows, ids):
            row.tokens.extend(int(v) for v in t)
        self.sealed = True  # rows of different lengths follow: the branch takes a commit next
        self._trees = trees
        return logits

    def keep_paths(self, paths: Sequence[Sequence[int]]) -> list[int]:
        """Row i's branch, holding its tree (`forward_trees`), becomes the chain of the root path
        `paths[i]` (node indices; empty: nothing) and stays open; returns the paths' lengths.

        Raises:
            BranchError: no tree pending, or a path is not a root path of its row's tree; nothing changed.
        """
        trees = self._trees
        N = max((t.size for t in trees), default=0) if trees is not None else 0
        if trees is None or not self.branch_open or any(r.branch_length != N for r in self.rows) \
                or len(trees) != len(self.rows):
            raise BranchError("keep_paths() with no tree pending: it follows forward_trees()")
        if len(paths) != len(self.rows):
            raise BranchError(f"keep_paths(): one path per row ({len(self.rows)} rows)")
        paths = [tree.check_path(list(p)) for tree, p in zip(trees, paths)]
        for layer in self.cache:
            layer.take_paths(paths)
        for row, path in zip(self.rows, paths):
            row.tokens[row.base :] = [row.tokens[row.base + i] for i in path]
        self._trees = None
        return [len(p) for p in paths]
