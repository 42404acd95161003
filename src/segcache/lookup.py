"""Prompt lookup drafting: propose the tokens that followed the last n-gram before.

    history:  ... a b c x y z ... a b c | ?
                  ^^^^^ earlier match   ^^^^^ suffix (n = 3)
    draft:              x y z ...        (up to k tokens after the match)

The suffix of the history is looked up as an n-gram, longest first (3 down
to 1); the most recent earlier occurrence wins, and the k tokens after it are
the draft (copying on past the end of the history, as a repeat would). Drafts cost no model call, so any acceptance is a gain; a wrong
draft costs only the extra verify width.

An index from n-gram to its last two start positions keeps `draft` O(n)
instead of a scan of the whole history per round.
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
        # n-gram -> (latest start, the start before it or -1). The latest start
        # of the suffix n-gram is the suffix itself, so a match is the one before.
        self._starts: dict[tuple, tuple[int, int]] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the history and index the n-grams they complete."""
        for tok in tokens:
            self.history.append(tok)
            end = len(self.history)
            for n in range(self.min_ngram, self.max_ngram + 1):
                start = end - n
                if start < 0:
                    break
                gram = tuple(self.history[start:end])
                latest = self._starts.get(gram, (-1, -1))[0]
                self._starts[gram] = (start, latest)

    def draft(self, k: int) -> list[int]:
        """The `k` tokens that followed the longest recent match of the history's suffix.

        Returns an empty list when no suffix of `min_ngram`..`max_ngram` tokens
        occurred before.
        """
        size = len(self.history)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            latest, previous = self._starts.get(tuple(self.history[size - n :]), (-1, -1))
            match = previous if latest == size - n else latest
            if match >= 0:
                # Copy on from the match. Past the end of the history the copy
                # reads its own output (match + n <= size - 1, so that is always
                # defined): a repeating stretch is drafted k tokens deep, not
                # cut short by the distance to the end.
                out = self.history[match + n : match + n + k]
                while len(out) < k:
                    out.append(out[match + n + len(out) - size])
                return out
        return []
