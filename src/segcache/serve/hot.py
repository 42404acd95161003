"""The runtimes of recent conversations, kept live: a next turn continues from one in O(1).

    turn k ends ──> keep(rt)      rt holds prompt + reply (published); it supersedes the
                                  entries of its domain whose tokens it extends; its
                                  store pages become views of its buffer (store/sharing.py)
    turn k+1   ──> take(ids, d)   the entry of domain d whose tokens are the longest prefix
                                  of ids: a copy-on-write clone of it (no page is read or
                                  concatenated); the request's session feeds only the rest

A resume from the store reads every page of the prefix and concatenates them
into a fresh buffer, a copy that grows with the context; mlx_lm.server keeps
the cache object itself. Here the hot runtime is never written: a request runs
on a clone (new array objects over the same buffers), so whatever the request
does, fails or is cancelled, the entry stays as it was, and only a request
that ended well puts its own runtime in its place (`keep`). The clone's first
forward copies the K/V buffer once (MLX cannot write a buffer another array
views), the one copy per turn that mlx_lm.server's deep copy of its cache
also makes.

Isolation: an entry belongs to the domain of the request that made it (its
runtime's `cache_salt`, serve/isolation.py), and `take` looks only at the
entries of the asking request's domain, so no request continues from another
domain's conversation.

Bounds: at most `max_count` entries and `max_bytes` of their layers' arrays
(counted beside the store's RAM budget; the K/V buffers are shared with the
store's RAM pages, so the store's count and this one overlap), least recently
used dropped first; a runtime larger than the budget is not kept.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..errors import InvariantError
from ..store.sharing import share_rows

log = logging.getLogger("segcache.serve")


@dataclass
class _Entry:
    """A hot runtime: its domain, the tokens it holds (read once) and its bytes."""

    domain: Optional[str]
    tokens: list[int]
    runtime: object
    nbytes: int


def runtime_nbytes(rt) -> int:
    """Bytes of every array a runtime's layers hold (K/V buffers at their capacity)."""
    arrays = []
    for layer in rt.cache:
        _flatten(layer.state, arrays)
    return sum(a.nbytes for a in {id(a): a for a in arrays}.values())


def _flatten(x, out: list) -> None:
    if isinstance(x, mx.array):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _flatten(y, out)


class HotRuntimes:
    """Recent conversations' runtimes by isolation domain, bounded by count and bytes.

    Args:
        max_count: entries at most (0: keep none).
        max_bytes: bytes of the entries' arrays at most.
        share: let the store's RAM records of a kept runtime's rows hold views of its
            buffers (`store.sharing.share_rows`) rather than copies.

    Invariants (check()): entries in least-recently-used order, at most `max_count` of
    them, `used` == the sum of their bytes <= `max_bytes`; every entry's runtime has no
    open branch, holds exactly its `tokens` and belongs to its `domain`.
    """

    def __init__(self, max_count: int = 8, max_bytes: int = 256 << 20, *, share: bool = True):
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"HotRuntimes(max_count={max_count}, max_bytes={max_bytes}): both must be >= 0")
        self.max_count, self.max_bytes, self.share = max_count, max_bytes, share
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # oldest use first
        self._next = 0  # the next entry's number
        self.used = 0  # bytes of the entries' arrays
        self.hits = self.misses = self.kept = self.dropped = self.shared = 0  # counters for logs and tests

    @property
    def count(self) -> int:
        """Entries held (no `__len__`: an empty set must not read as a missing one)."""
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0

    def take(self, ids: list[int], domain: Optional[str]):
        """A copy-on-write clone of the runtime in `domain` holding the longest prefix of `ids`
        (at most all of them), or None. The entry itself is left as it is."""
        if not self._entries:
            return None
        best, n = None, 0
        for key, e in self._entries.items():
            t = e.tokens
            if e.domain == domain and n < len(t) <= len(ids) and ids[: len(t)] == t:
                best, n = key, len(t)
        if best is None:
            self.misses += 1
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        return self._entries[best].runtime.clone()

    def keep(self, rt, domain: Optional[str]) -> bool:
        """Keep `rt` (a request's runtime once it ended, published; nobody writes into it again)
        for `domain`; the entries of that domain whose tokens it extends are dropped. Returns
        whether it was kept (not: no room for it, an open branch, token ids unknown)."""
        if not self.enabled or rt.depth or rt.cache_salt != domain:
            return False
        tokens = rt.committed_tokens
        nbytes = runtime_nbytes(rt)
        if not tokens or None in tokens or nbytes > self.max_bytes:
            return False
        for key in [k for k, e in self._entries.items() if e.domain == domain and tokens[: len(e.tokens)] == e.tokens]:
            self._drop(key)  # superseded: this one holds all of it and more
        self._entries[self._next] = _Entry(domain, tokens, rt, nbytes)
        self._next += 1
        self.used += nbytes
        self.kept += 1
        while len(self._entries) > self.max_count or self.used > self.max_bytes:
            self._drop(next(iter(self._entries)))
        if self.share:
            try:
                self.shared += share_rows(rt)
            except Exception as exc:  # sharing saves memory only: never fail a request over it
                log.warning("sharing a hot runtime's rows with the prefix store failed: %s", exc)
        return True

    def ended(self, rt, domain: Optional[str], outcome: str) -> bool:
        """A request's row left with `outcome` (serve/choice.py): its runtime is kept if it ended
        well, never when it failed or was cancelled (the entry it came from stays as it was)."""
        return outcome not in ("failed", "cancelled") and self.keep(rt, domain)

    def clear(self) -> None:
        """Drop every entry (memory pressure, or the store closing)."""
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.used -= e.nbytes
        self.dropped += 1

    def stats(self) -> dict:
        return {"hot_entries": len(self._entries), "hot_bytes": self.used, "hot_hits": self.hits,
                "hot_misses": self.misses, "hot_kept": self.kept, "hot_dropped": self.dropped,
                "hot_shared_records": self.shared}

    def check(self) -> None:
        """Verify the invariants (see the class docstring)."""
        if len(self._entries) > self.max_count or self.used > self.max_bytes:
            raise InvariantError(f"{len(self._entries)} hot runtimes of {self.used} bytes, over "
                                 f"{self.max_count} / {self.max_bytes}")
        if self.used != sum(e.nbytes for e in self._entries.values()):
            raise InvariantError(f"hot runtimes count {self.used} bytes, their entries sum to another")
        for e in self._entries.values():
            rt = e.runtime
            if rt.depth or rt.committed_tokens != e.tokens or rt.cache_salt != e.domain:
                raise InvariantError(f"a hot runtime holds {len(rt.committed_tokens)} tokens ({rt.depth} "
                                     f"branches) in domain {rt.cache_salt!r}, its entry {len(e.tokens)} in {e.domain!r}")
