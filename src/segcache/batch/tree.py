"""A tree round of the decoder: verify a row's tree of drafts in one forward, walk it, keep a path.

    fork ─ forward_tree([y] + tree nodes, parents) ─ greedy walk from the root:
           a child whose token is the target's choice at its parent, while one is ─
           keep_path(root .. last node) ─ the round goes on as a chain round of that path

After `keep_path` the row's branch holds exactly the chain [y, d1..dn] of
the accepted path (Runtime.keep_path), so everything after it (emitting
d1..dn and the target's token after them, settling fewer, the drafter's
bookkeeping, the gate) is the chain round's, unchanged. The walk is greedy
decoding's own rule: dn is accepted iff it equals the argmax after d1..dn-1,
so the output is plain greedy's token for token. A seeded row (`KeyedMatch`)
walks the target's own draws, each node drawn with the keys of its depth:
plain seeded decoding's tokens. A sampling row without keys
(`ExactSpeculative`) accepts by recursive rejection over siblings
(`sampling.tree_speculative_accept`): its tokens are distributed as plain
sampling's. Logits processors (penalties, a grammar) see each node's own
history: every leaf's path is processed as a chain verify would process it.

Where a tree cannot be verified the round verifies the tree's first branch
as a chain (the drafter's chain): rows of a batch, a row with an opaque
mlx-lm sampler (the sampler match), a model whose layers verify no trees
(those two said once per model, as a warning).
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from ..acceptors import ExactSpeculative, GreedyMatch, KeyedMatch
from ..layers.tree import Tree
from ..processors import normalize
from .drafting import Draft
from .rows import OneRow

_warned: set = set()  # (why, id of the model) of each fallback to chains said so far


def takes_tree(batch, states: list, draft: Draft) -> bool:
    """Whether this step's tree can be verified as one (else its chain is)."""
    if draft.trees is None:
        return False
    if not isinstance(batch, OneRow) or len(states) != 1:
        _say_once(("batch", id(batch.model)), "draft_tree: batched rows verify chains so far (docs/tree.md)")
        return False
    s = states[0]
    tokens, parents = draft.trees[0]
    if not tokens or Tree([-1] + list(parents)).is_chain():
        return False  # a tree of one branch: the chain round is the same round
    if not isinstance(s.acceptor, (GreedyMatch, ExactSpeculative, KeyedMatch)):
        return False
    if not batch.runtime.takes_trees:
        kinds = sorted({type(layer).__name__ for layer in batch.runtime.cache if not layer.takes_trees})
        _say_once(("layers", id(batch.model)), f"draft_tree: this model's layers {kinds or '(no rope module found)'} "
                  "verify no trees; its rounds verify chains (docs/tree.md)")
        return False
    return True


def _say_once(what: tuple, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, stacklevel=4)


def verify_tree(batch: OneRow, states: list, pending: list[int], draft: Draft) -> tuple:
    """One row's tree round, the branch forked: (rows, proposals, drafts, accepted) as the
    decoder's chain verify gives them, for the accepted path as if it had been the chain.

    `drafts` is the path's tokens followed by the chain's past it, so a row's figures count
    the chain's width drafted and the path's length accepted.
    """
    tokens, parents = draft.trees[0]
    tree = Tree([-1] + list(parents))
    nodes = [pending[0]] + list(tokens)
    logits = batch.runtime.forward_tree(nodes, tree.parents)[0]  # raw [N, V]: processors need the model's own
    processors = states[0].processors
    if processors is None:
        logprobs = normalize(logits)
    else:  # each node as plain decoding after its own path (`process` changes no state)
        rows = [None] * tree.size
        for leaf in sorted(set(range(tree.size)) - set(tree.parents)):
            path = tree.path(leaf)
            out = processors.process(logits[mx.array(path)], states[0].history, [nodes[i] for i in path[1:]])
            for j, i in enumerate(path):
                rows[i] = out[j] if rows[i] is None else rows[i]
        logprobs = mx.stack(rows)
    mx.eval(logprobs)
    path, token = states[0].acceptor.accept_tree(logprobs, tree.parents, nodes)
    batch.runtime.keep_path(path)
    accepted = [nodes[i] for i in path[1:]]
    n = len(accepted)
    proposals = draft.proposals()
    chain = proposals[0][: draft.widths[0]]
    drafts = accepted + chain[n:] if chain[:n] != accepted else chain
    return [logprobs[mx.array(path)]], proposals, [drafts], [(n, token)]
