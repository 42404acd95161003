"""A prompt's token ids where it extends a recent one: only the text past their shared part is encoded.

An agent's next turn renders the whole conversation again, and its text is the
last turn's text up to about the last answer, then the new messages. Encoding
a 52k-token conversation costs ~70 ms on a CPU core, every turn, before the
prefill can begin (mlx_lm.server pays it too). The shared part's tokens are
the recent prompt's own wherever the tokenizer cuts there whatever follows:

    recent  [ .......... shared text ..........|\\nfoo ... ]       its ids and offsets, kept
    new     [ .......... shared text ......\\n|bar ..........]
                                              ^ q: a newline, then an ASCII letter, both shared
    ids  =  recent ids of the tokens ending by q  +  encode(new[q:])

Why q is such a cut, for the tokenizers `splittable` accepts (byte-level BPE:
a normalizer that is none, NFC or NFKC; pre-tokenizers that are regex splits
and a byte-level step; added tokens without "\\n" that strip nothing):

- added tokens are split out first; none spans q (none holds a newline);
- normalization composes a character only with the combining marks after it:
  an ASCII letter at q composes with nothing before it;
- the split regexes end a piece at a newline that an ASCII letter follows
  (checked on the tokenizer's own pre-tokenizer with `PROBE`), and the pieces
  before q depend only on the text up to q; the pieces after q are those of
  `new[q:]` alone (no lookbehind);
- BPE merges only inside a piece.

A recent prompt's tokens are cut at q only where one of them ends exactly at
q. In indented code q is the last line that starts with a letter (a newline
before spaces is no such cut: GPT-2's pattern joins it to them), found within
`MAX_LOOKS` newlines back, so the tail encoded again may be a few lines long. Every splice is what a whole encode gives; the first one and every
`CHECK_EVERY`-th are compared with a whole encode anyway, and a difference
turns splicing off for the tokenizer (logged), which then encodes whole.
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import string
import threading
from dataclasses import dataclass
from typing import Optional

from ..errors import InvariantError

log = logging.getLogger("segcache.serve")

RECENT = 8  # encoded prompts kept (the oldest out): a few conversations' last turns
MIN_SHARED = 2048  # characters shared at least for a splice (shorter: encoding whole costs little)
CHECK_EVERY = 64  # a splice compared with a whole encode: the first, then every this many
MAX_LOOKS = 4096  # newlines tried, back from the shared part's end, before encoding whole
LETTERS = frozenset(string.ascii_letters)
# Pieces the pre-tokenizer must end at each "\n" an ASCII letter follows (after words, spaces,
# punctuation, digits, newlines, contractions, non-ASCII letters and marks).
PROBE = "a\nb c.\nd 1\ne  \nf\n\ng it's\nh \u00e9\ni e\u0301\nj ,\n\nk\t\nl\r\nm x\nNo}\nq\"\nr"


def common_chars(a: str, b: str) -> int:
    """The length of the longest common prefix of two strings (slices compared in C, halving)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def splittable(hf) -> Optional[str]:
    """None when a splice is what a whole encode gives for this (transformers) tokenizer, by the
    module's argument; else why not."""
    if not getattr(hf, "is_fast", False):
        return "not a fast tokenizer (no offsets)"
    try:
        spec = json.loads(hf.backend_tokenizer.to_str())
        pre = hf.backend_tokenizer.pre_tokenizer
    except Exception as exc:  # not a `tokenizers` backend we can read
        return f"its tokenizer cannot be read ({type(exc).__name__})"
    if (spec.get("model") or {}).get("type") != "BPE":
        return f"a {(spec.get('model') or {}).get('type')} model, not BPE"
    norm = spec.get("normalizer")
    if norm is not None and norm.get("type") not in ("NFC", "NFKC"):
        return f"its normalizer ({norm.get('type')}) may join text across a cut"
    p = spec.get("pre_tokenizer") or {}
    steps = p.get("pretokenizers", []) if p.get("type") == "Sequence" else [p]
    for s in steps:
        kind = s.get("type")
        if kind == "Split" and (s.get("behavior") != "Isolated" or s.get("invert")):
            return "a split pre-tokenizer that does not isolate its pieces"
        if kind == "ByteLevel" and s.get("add_prefix_space"):
            return "a byte-level pre-tokenizer that adds a prefix space"
        if kind not in ("Split", "ByteLevel"):
            return f"a {kind} pre-tokenizer"
    if not steps or steps[-1].get("type") != "ByteLevel":
        return "not a byte-level tokenizer"
    for tok in getattr(hf, "added_tokens_decoder", {}).values():
        if "\n" in tok.content or tok.lstrip or tok.rstrip:
            return f"the added token {tok.content!r} holds a newline or strips spaces"
    try:
        ends = {end for _, (_, end) in pre.pre_tokenize_str(PROBE)}
    except Exception as exc:
        return f"its pre-tokenizer cannot be probed ({type(exc).__name__})"
    cuts = {i + 1 for i, c in enumerate(PROBE[:-1]) if c == "\n" and PROBE[i + 1] in LETTERS}
    if not cuts <= ends:
        return "its pre-tokenizer does not end a piece at a newline before a letter"
    return None


@dataclass
class _Encoded:
    text: str
    ids: list[int]
    ends: list[int]  # where each token ends in `text` (sorted)


class Reencoder:
    """Encodes prompts as `hf(text, add_special_tokens=False)` does, splicing onto a recent one.

    Args:
        hf: the transformers tokenizer (mlx-lm's wrapper holds it as `_tokenizer`).
        recent: encoded prompts kept for splicing onto.
        check_every: compare the first splice and every this many with a whole encode.
        min_shared: characters a prompt shares with a recent one at least, for a splice.

    Invariants (check()): every kept encoding is a whole encode's (ids and sorted ends) of its
    text, and no text is kept twice; `reason` is None iff splicing is on.
    """

    def __init__(self, hf, *, recent: int = RECENT, check_every: int = CHECK_EVERY, min_shared: int = MIN_SHARED):
        self.hf = hf
        self.reason = splittable(hf)  # None: splices are made
        self.check_every, self.min_shared = check_every, min_shared
        self._recent: collections.deque[_Encoded] = collections.deque(maxlen=recent)
        self._lock = threading.Lock()
        self.spliced = self.checked = 0  # counters (tests, logs)

    def encode(self, text: str) -> tuple[list[int], Optional[list[int]]]:
        """(ids, where each token ends in `text`); ends None where the tokenizer's offsets do not
        follow the text (then nothing is kept for a later splice)."""
        with self._lock:
            same = next((e for e in self._recent if e.text == text), None)
            if same is not None:  # the same prompt again (a retry, a token count before the request)
                return list(same.ids), list(same.ends)
            got = self._splice(text) if self.reason is None else None
            if got is None:
                got = self._whole(text)
            if got[1] is not None:
                self._recent.append(_Encoded(text, *got))
            return got

    def check(self) -> None:
        """Verify the invariants (see the class docstring): encodes every kept text whole."""
        texts = [e.text for e in self._recent]
        if len(set(texts)) != len(texts):
            raise InvariantError("a prompt's encoding is kept twice")
        for e in self._recent:
            if (e.ids, e.ends) != self._whole(e.text) or e.ends != sorted(e.ends):
                raise InvariantError(f"a kept encoding of {len(e.text)} characters is not its whole encode")

    def _whole(self, text: str) -> tuple[list[int], Optional[list[int]]]:
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ends = [end for _, end in enc["offset_mapping"]]
        return list(enc["input_ids"]), ends if ends == sorted(ends) else None

    def _splice(self, text: str) -> Optional[tuple[list[int], list[int]]]:
        best, shared = None, 0
        for e in self._recent:
            n = common_chars(e.text, text)
            if n > shared:
                best, shared = e, n
        if best is None or shared < self.min_shared:
            return None
        q = _cut(text, shared)
        if q is None:
            return None
        k = bisect.bisect_right(best.ends, q)
        if k == 0 or best.ends[k - 1] != q:  # no token of the recent prompt ends at q
            return None
        tail_ids, tail_ends = self._whole(text[q:])
        if tail_ends is None:
            return None
        got = best.ids[:k] + tail_ids, best.ends[:k] + [q + e for e in tail_ends]
        self.spliced += 1
        if self.spliced == 1 or self.spliced % self.check_every == 0:
            self.checked += 1
            whole = self._whole(text)
            if whole != got:
                self.reason = "a splice differed from the whole encode"
                log.warning("a prompt's tokens spliced onto a recent prompt's differ from its whole encode "
                            "(at character %d of %d): this tokenizer's prompts are encoded whole from now on",
                            q, len(text))
                return whole
        return got


def _cut(text: str, shared: int) -> Optional[int]:
    """The last q with text[q - 1] a newline and text[q] an ASCII letter, q < shared; None if none
    within MAX_LOOKS newlines."""
    i = shared - 1
    for _ in range(MAX_LOOKS):
        i = text.rfind("\n", 0, i)
        if i < 0:
            return None
        if text[i + 1] in LETTERS:
            return i + 1
    return None
