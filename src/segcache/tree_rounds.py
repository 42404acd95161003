"""A runtime's tree rounds: verify a tree of drafts in one forward, keep one root path.

`Runtime` takes these from `TreeRounds` (docs/tree.md); they use its branch stack and
token ledger as its own methods do. Nothing here is on a chain forward's path.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .adapters.tree import rope_modules, verify_tree
from .errors import BranchError, UnsupportedOperationError
from .layers.tree import Tree
from .tokens import token_ids


class TreeRounds:
    """`forward_tree`, `keep_path` and `takes_trees` of a `Runtime`."""

    _ropes = None  # the model's rope modules (adapters/tree.py), found when first asked (takes_trees)

    @property
    def takes_trees(self) -> bool:
        """Whether `forward_tree` runs here: every layer's kind verifies trees (docs/tree.md)."""
        self._ropes = rope_modules(self.model) if self._ropes is None else self._ropes
        return all(layer.takes_trees for layer in self.cache) and bool(self._ropes)

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> mx.array:
        """Verify a tree of drafts in one forward in a branch just opened; logits [1, N, vocab].

        Node i (`tokens[i]`, parent `parents[i]`, the root 0: -1) sees the committed tokens and
        its ancestors at position offset + depth (docs/tree.md); then `commit(path)`. Raises,
        changing nothing, ValueError (not a tree of one token per node), BranchError (the
        innermost branch holds tokens) or UnsupportedOperationError (not `takes_trees`).
        """
        self._own_layers("forward_tree")
        self._sync()
        tree, ids = Tree(parents), token_ids(tokens)
        if len(ids) != tree.size:
            raise ValueError(f"forward_tree(): {len(ids)} tokens for {tree.size} nodes")
        if not self._branches or self.offset != self._branches[-1].base_offset:
            raise BranchError("forward_tree() needs a branch just opened (rt.fork()) that holds nothing yet")
        if not self.takes_trees:
            raise UnsupportedOperationError("forward_tree(): a layer of this model verifies no trees; verify chains")
        logits = verify_tree(self.model, self._ropes, self.cache, tree, self.offset, ids)
        if self.drafters:
            self.drafters.invalidate()  # a drafter segment (the MTP head's) is fed chains only: it never saw the tree
        self._ledger.append(ids)
        self._branches[-1].tree = tree
        return logits

    def keep_path(self, path: Sequence[int] | int) -> int:
        """The innermost branch, holding a tree (`forward_tree`), becomes the chain of the root
        `path` (node indices; an int n: nodes 0..n-1) and stays open; returns its length.
        Raises BranchError (changing nothing): no tree pending, or not a root path of it.
        """
        inner = self._innermost(None, "keep_path")
        if inner.tree is None:
            raise BranchError("keep_path() with no tree pending: it follows forward_tree()")
        path = inner.tree.check_path(path)
        ids = self._ledger.ids(self.offset)
        for layer in self.cache:
            layer.take_path(path)
        self._ledger.truncate(inner.base_offset)
        self._ledger.append([ids[inner.base_offset + i] for i in path])
        inner.tree = None
        return len(path)
