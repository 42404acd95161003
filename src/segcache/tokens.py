"""TokenLedger: the token id at each cached position of a Runtime, read lazily.

    positions   0 ............ len(ids) ............ recorded ........ offset
                [ ids: ints, None ][ chunks: unread ] [ fed directly ]

`Runtime.forward` records its ids here; a token array (the next token of a
decode loop, still being computed) is kept unread, because reading it would
wait for the device every step. Positions the model reached through
`rt.cache` without `forward` (mlx-lm's `generate_step` does that) have no
known id: they read as None, so nothing can ever publish a state under an id
it was not computed from.

Every runtime path goes through one of these methods: `append` (forward),
`sync` (catch up with direct calls), `truncate` (commit / rollback),
`copy` (clone), `reset` (restore from a store), `ids` (read).
"""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx

from .errors import InvariantError


class TokenLedger:
    """Token ids of positions 0..recorded-1; unread arrays wait in order after the read ones."""

    def __init__(self, ids: list[int | None] | None = None):
        # Invariants (check()): len(_ids) + _unread == recorded <= the cache's
        # offset; _unread == sum of the chunk lengths; every chunk non-empty and
        # either a list of ints or a 1-D integer mx.array (unread).
        self._ids: list[int | None] = list(ids or ())
        self._chunks: list[list[int] | mx.array] = []
        self._unread = 0

    @property
    def recorded(self) -> int:
        """Positions with an entry (an id, None, or an unread id)."""
        return len(self._ids) + self._unread

    @property
    def unread(self) -> int:
        """Recorded positions whose ids wait unread (arrays, and lists queued after them)."""
        return self._unread

    def append(self, chunk: list[int] | mx.array) -> None:
        """Record the ids a forward fed after the recorded positions; an array stays unread."""
        if self._chunks or isinstance(chunk, mx.array):
            self._chunks.append(chunk)  # after unread ids, lists wait too (order)
            self._unread += len(chunk)
        else:
            self._ids.extend(chunk)

    def sync(self, offset: int) -> None:
        """Catch up with calls on the cache that bypassed the runtime; reads nothing.

        Positions recorded..offset-1 were fed directly: their ids are unknown
        (None). Positions past `offset` were trimmed through mlx-lm's protocol
        (`trim_prompt_cache`): forgotten. A trim that direct calls refilled
        since leaves no trace in `offset`: the runtime first truncates to the
        lowest offset its layers report a trim left (`Runtime._sync`).
        """
        gap = offset - self.recorded
        if gap > 0:
            self.append([None] * gap)
        elif gap < 0:
            self.truncate(offset)

    def truncate(self, n: int) -> None:
        """Forget every position from `n` on (a rollback or a partial commit); reads nothing."""
        if n >= self.recorded:
            return
        if n <= len(self._ids):
            del self._ids[n:]
            self._chunks.clear()
            self._unread = 0
            return
        left = n - len(self._ids)  # positions to keep among the unread chunks
        kept = []
        for chunk in self._chunks:
            if left <= 0:
                break
            kept.append(chunk if len(chunk) <= left else chunk[:left])
            left -= len(chunk)
        self._chunks = kept
        self._unread = n - len(self._ids)

    def reset(self, ids: list[int]) -> None:
        """Hold exactly `ids` (the runtime's state was replaced by a stored prefix).

        Private to the runtime (Runtime.restore); the caller validated `ids`.
        """
        self._ids = list(ids)
        self._chunks = []
        self._unread = 0

    def copy(self, n: int) -> "TokenLedger":
        """An independent ledger of the first `n` positions (unread arrays shared: immutable)."""
        other = TokenLedger(self._ids[:n])
        other._chunks = list(self._chunks)
        other._unread = self._unread
        other.truncate(n)
        return other

    def ids(self, n: int) -> list[int | None]:
        """The ids of positions 0..n-1 (None where unknown); reads the pending arrays once."""
        if self._chunks:
            arrays = [c for c in self._chunks if isinstance(c, mx.array)]
            if arrays:
                mx.eval(arrays)
            for chunk in self._chunks:
                self._ids.extend(chunk.tolist() if isinstance(chunk, mx.array) else chunk)
            self._chunks.clear()
            self._unread = 0
        out = self._ids[:n]
        if len(out) < n:
            out.extend([None] * (n - len(out)))
        return out

    def peek(self, n: int) -> list[int | None]:
        """What `ids(n)` returns, leaving this ledger as it is (for tests: observing
        the runtime must not change which paths its next steps take)."""
        return self.copy(self.recorded).ids(n)

    def check(self, offset: int) -> None:
        """Verify the invariants against the cache's `offset`.

        Raises:
            InvariantError: naming the first violation found.
        """
        if self.recorded > offset:
            raise InvariantError(f"{self.recorded} token ids recorded for {offset} cached tokens")
        if self._unread != sum(len(c) for c in self._chunks):
            raise InvariantError(f"{self._unread} unread token ids counted, the chunks hold another number")
        for chunk in self._chunks:
            if len(chunk) == 0:
                raise InvariantError("an empty chunk of unread ids")
            if isinstance(chunk, mx.array) and (chunk.ndim != 1 or not mx.issubdtype(chunk.dtype, mx.integer)):
                raise InvariantError(f"an unread chunk of {chunk.dtype} {chunk.shape}, expected 1-D integers")

    def __repr__(self) -> str:
        return f"TokenLedger(read={len(self._ids)}, unread={self._unread})"


def token_array(tokens: mx.array) -> mx.array:
    """`tokens` as a 1-D integer array, checked by shape and dtype only (values stay unread)."""
    if tokens.ndim == 2 and tokens.shape[0] == 1:
        tokens = tokens[0]
    if tokens.ndim != 1 or tokens.size == 0 or not mx.issubdtype(tokens.dtype, mx.integer):
        raise ValueError(
            f"tokens must be a non-empty 1-D integer array (or shape [1, S]); got {tokens.dtype} {tokens.shape}"
        )
    return tokens


def token_ids(tokens) -> list[int]:
    """`tokens` (a list or an integer array) as a non-empty list of non-negative ints, or ValueError."""
    if isinstance(tokens, mx.array):
        tokens = token_array(tokens).tolist()
    ids = list(tokens) if isinstance(tokens, Iterable) else None
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"tokens must be a non-empty sequence of non-negative ints; got {tokens!r:.80}")
    return ids
