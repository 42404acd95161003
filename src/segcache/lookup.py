"""Prompt lookup drafting: propose the tokens that followed the last n-gram before.

    history:  ... a b c x y z ... a b c | ?
                  ^^^^^ earlier match   ^^^^^ suffix (n = 3)
    draft:              x y z ...        (up to k tokens after the match)

The suffix of the history is looked up as an n-gram, longest first (3 down
to 1); the most recent earlier occurrence wins, and the k tokens after it are
the draft (copying on past the end of the history, as a repeat would). Drafts cost no model call, so any acceptance is a gain; a wrong
draft costs only the extra verify width.

An index from n-gram to its start positions keeps `draft` O(n) instead of a
scan of the whole history per round.

`draft_tree` proposes several matches at once, as a tree (layers/tree.py):
the continuations of the suffix's earlier occurrences, longest n-gram first
and most recent first within one n, merged as a trie under the pending token,
so continuations that share a prefix share its nodes:

    history  ... a b x y ... a b x z ... a b q ... | a b
    tree     (pending) ─ x ─ z ...        the first branch is `draft`'s chain
                        │   └ y ...
                        └ q ...
"""

from __future__ import annotations

from typing import Iterable


class PromptLookup:
    """Incremental n-gram index over a token history.

    Args:
        max_ngram: longest suffix tried.
        min_ngram: shortest suffix tried.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []
        # n-gram -> its start positions, ascending. The latest start of the
        # suffix n-gram is the suffix itself, so a match is one before it.
        self._starts: dict[tuple, list[int]] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the history and index the n-grams they complete."""
        for tok in tokens:
            self.history.append(tok)
            end = len(self.history)
            for n in range(self.min_ngram, self.max_ngram + 1):
                start = end - n
                if start < 0:
                    break
                self._starts.setdefault(tuple(self.history[start:end]), []).append(start)

    def draft(self, k: int) -> list[int]:
        """The `k` tokens that followed the longest recent match of the history's suffix.

        Returns an empty list when no suffix of `min_ngram`..`max_ngram` tokens
        occurred before.
        """
        return self.match(k)[1]

    def match(self, k: int) -> tuple[int, list[int]]:
        """`draft(k)` and the length of the suffix it matched: (n, tokens); (0, []) without a match."""
        size = len(self.history)
        if k <= 0:
            return 0, []
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            match = next(self._matches(n), -1)
            if match >= 0:
                # Copy on from the match. Past the end of the history the copy
                # reads its own output (match + n <= size - 1, so that is always
                # defined): a repeating stretch is drafted k tokens deep, not
                # cut short by the distance to the end.
                out = self.history[match + n : match + n + k]
                while len(out) < k:
                    out.append(out[match + n + len(out) - size])
                return n, out
        return 0, []

    def _matches(self, n: int):
        """Start positions of earlier occurrences of the history's last n tokens, most recent first."""
        size = len(self.history)
        starts = self._starts.get(tuple(self.history[size - n :]), ())
        return (s for s in reversed(starts) if s != size - n)

    def draft_tree(self, depth: int, budget: int, matches: int = 16) -> tuple[list[int], list[int]]:
        """Up to `budget` draft nodes, each at most `depth` below the pending token, as a tree.

        The first branch is `draft(depth)`, the chain; the other nodes are chosen best
        first from the continuations of up to `matches` earlier occurrences per n-gram
        length: a node's weight is the sum over the continuations through it of 4^n
        (n its n-gram's length), an estimate of how often it follows, and the heaviest
        nodes are kept (a parent weighs at least its children, so the kept nodes form a
        tree).

        Returns:
            (tokens, parents) of the draft nodes 1..len(tokens): node j's parent is
            parents[j-1] (0: the pending token), always an earlier node. Empty when
            nothing matched.
        """
        size = len(self.history)
        trie: dict[tuple, float] = {}  # a path of tokens below the pending one -> its weight
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            for start, _ in zip(self._matches(n), range(matches)):
                continuation = self.history[start + n : start + n + depth]
                for j in range(1, len(continuation) + 1):
                    key = tuple(continuation[:j])
                    trie[key] = trie.get(key, 0.0) + 4.0**n
        chain = self.draft(depth)
        forced = [tuple(chain[:j]) for j in range(1, min(len(chain), budget) + 1)]
        rest = sorted((key for key in trie if key not in set(forced)), key=lambda key: (-trie[key], len(key)))
        kept = set(forced)
        for key in rest:
            if len(kept) == budget:
                break
            if len(key) == 1 or key[:-1] in kept:
                kept.add(key)
        order = sorted(kept, key=lambda key: (len(key), forced.index(key) if key in forced else len(forced)))
        node = {(): 0}
        tokens, parents = [], []
        for key in order:
            tokens.append(key[-1])
            parents.append(node[key[:-1]])
            node[key] = len(tokens)
        return tokens, parents
