"""A tree round of the decoder: verify every row's tree of drafts in one forward, walk each, keep a path per row.

    fork ─ forward_trees([y_i] + tree nodes_i, parents_i per row) ─ per row a walk from the root:
           a child whose token is the target's choice at its parent, while one is ─
           keep_paths(root .. last node per row) ─ the round goes on as a chain round of those paths

After `keep_paths` each row's branch holds exactly the chain [y, d1..dn] of
its accepted path (Runtime.keep_path for a lone row, batch/tree_rows.py for a
batch), so everything after it (emitting d1..dn and the target's token after
them, settling fewer, the drafter's bookkeeping, the gate) is the chain
round's, unchanged. The walk is greedy decoding's own rule: dn is accepted
iff it equals the argmax after d1..dn-1, so the output is plain greedy's
token for token. A seeded row (`KeyedMatch`) walks the target's own draws,
each node drawn with the keys of its depth: plain seeded decoding's tokens.
A sampling row without keys (`ExactSpeculative`) accepts by recursive
rejection over siblings (`sampling.tree_speculative_accept`): its tokens are
distributed as plain sampling's. Logits processors (penalties, a grammar)
see each node's own history: every leaf's path is processed as a chain
verify would process it.

In a batch, rows without a tree (or whose acceptor walks none: an opaque
mlx-lm sampler) verify their chain as a tree of one branch in the same
forward, accepted by their own chain rule; their branch keeps the whole
chain, as a chain round's does. Where no row can walk a tree, or the model's
layers verify none (said once per model, as a warning), the round is a chain
round of every row's chain (the tree's first branch).
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from ..acceptors import ExactSpeculative, GreedyMatch, KeyedMatch
from ..layers.tree import Tree
from ..processors import normalize
from .drafting import Draft, each_row

_warned: set = set()  # (why, id of the model) of each fallback to chains said so far


def _walks(state, tree) -> bool:
    """Whether this row's tree is verified as one (a tree of more than one branch, an acceptor
    that walks trees)."""
    if tree is None or not tree[0] or Tree([-1] + list(tree[1])).is_chain():
        return False  # no tree, or one of one branch: the chain round is the same round
    return isinstance(state.acceptor, (GreedyMatch, ExactSpeculative, KeyedMatch))


def takes_tree(batch, states: list, draft: Draft) -> bool:
    """Whether this step is a tree round (some row's tree verified as one), else a chain round."""
    if draft.trees is None or not any(_walks(s, t) for s, t in zip(states, draft.trees)):
        return False
    if not batch.takes_trees:
        layers = getattr(batch, "cache", None) or batch.runtime.cache  # a batch's layers, or a lone row's
        kinds = sorted({type(layer).__name__ for layer in layers
                        if not (getattr(layer, "takes_trees", False) or getattr(layer, "takes_row_trees", False))})
        _say_once(("layers", id(batch.model)), f"draft_tree: this model's layers {kinds or '(no rope module found)'} "
                  "verify no trees; its rounds verify chains (docs/tree.md)")
        return False
    return True


def _say_once(what: tuple, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, stacklevel=4)


def _processed(state, tree: Tree, nodes: list, logits: mx.array) -> mx.array:
    """The row's logprobs at its nodes [N, V]: the model's normalized, or its processors' output with
    each node seen as plain decoding after its own path (`process` changes no state)."""
    processors = state.processors
    if processors is None:
        return normalize(logits)
    if tree.is_chain():
        return processors.process(logits, state.history, nodes[1:])
    rows = [None] * tree.size
    for leaf in sorted(set(range(tree.size)) - set(tree.parents)):
        path = tree.path(leaf)
        out = processors.process(logits[mx.array(path)], state.history, [nodes[i] for i in path[1:]])
        for j, i in enumerate(path):
            rows[i] = out[j] if rows[i] is None else rows[i]
    return mx.stack(rows)


def verify_tree(batch, states: list, pending: list[int], draft: Draft) -> tuple:
    """Every row's tree round, the branch forked: (rows, proposals, drafts, accepted) as the
    decoder's chain verify gives them, for each accepted path as if it had been the chain.

    A tree row's `drafts` is its path's tokens followed by the chain's past it, so its figures
    count the chain's width drafted and the path's length accepted.
    """
    proposals = draft.proposals()
    chains = [p[:w] for p, w in zip(proposals, draft.widths)]
    trees = draft.trees
    walks = [_walks(s, t) for s, t in zip(states, trees)]
    plans = []  # per row: its Tree and its nodes ([pending] + drafts)
    for i, (w, chain) in enumerate(zip(walks, chains)):
        if w:
            tokens, parents = trees[i]
            plans.append((Tree([-1] + list(parents)), [pending[i]] + list(tokens)))
        else:
            plans.append((Tree(list(range(-1, len(chain)))), [pending[i]] + chain))
    logits = batch.forward_trees([n for _, n in plans], [t.parents for t, _ in plans])  # raw: processors need the model's own
    logprobs = each_row(states, lambda i, s: _processed(s, plans[i][0], plans[i][1], logits[i, : plans[i][0].size]))
    choices = each_row(states, lambda i, s: () if walks[i] else s.acceptor.choices(logprobs[i]))
    mx.eval(logprobs, *[c for cs in choices for c in cs])  # one sync

    def accept(i, s):
        tree, nodes = plans[i]
        if walks[i]:
            path, token = s.acceptor.accept_tree(logprobs[i], tree.parents, nodes)
            return path, (len(path) - 1, token)
        n, token = s.acceptor.accept(logprobs[i], chains[i], draft.q[i] if draft.q else None, choices[i])
        return list(range(tree.size)), (n, token)  # a chain row's branch keeps its chain, as a chain round's

    # every row's acceptance before any row's state moves: a failure leaves all as they were
    walked = each_row(states, accept)
    batch.keep_paths([path for path, _ in walked])
    rows, drafts = [], []
    for i, (path, (n, _)) in enumerate(walked):
        if walks[i]:
            got = [plans[i][1][j] for j in path[1:]]
            rows.append(logprobs[i][mx.array(path)])
            drafts.append(got + chains[i][n:] if chains[i][:n] != got else chains[i])
        else:
            rows.append(logprobs[i])
            drafts.append(chains[i])
    return rows, proposals, drafts, [a for _, a in walked]
