"""Stop strings over streamed text: emit what cannot be part of a stop, hold back the rest.

    buffer = "...the answer is 4\\nUS"      stops = ["\\nUSER:"]
                                ^^^^ held back: a prefix of "\\nUSER:"
    next segment "ER: " completes the stop: emit "...is 4", finish with "stop"

The stop text itself is never returned (OpenAI's rule). The stop that
completes first wins: with stops ["a", "\\naa"], "\\na" already stops at "a".
"""

from __future__ import annotations

from typing import Sequence


class StopText:
    """Filters a stream of text segments through stop strings.

    Invariant: `_held` is the longest suffix of the text seen that is a proper
    prefix of some stop string, and holds no complete stop string.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, segment: str) -> str:
        """Take the next segment; returns the text now safe to emit (sets `stopped` on a stop)."""
        if self.stopped:
            return ""
        if not self.stops:
            return segment
        text = self._held + segment
        # The stop that completes first ends the text, as it would token by token
        # (ties: the longer one); so the result does not depend on the segmentation.
        hits = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            end, at = min(hits)
            self.stopped = True
            self.matched = text[at:end]
            self._held = ""
            return text[:at]
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of a generation that did not stop on a string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
