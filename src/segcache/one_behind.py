"""A drafter's cache that stays one position behind its target, as a drafter segment.

    target   tokens 0 .. n-1, a state s[p] per position (from the target's tap)
    kv       the drafter's K/V of s[0 .. held-1]                  one behind: held = max(n - 1, 0)
    tail     s[n-1], [1, 1, H]                                    not fed yet (fed with the next forward)

The MTP head (mtp/state.py: its pairs (hidden[p], token[p+1])) and the DFlash drafter
(dflash/segment.py: the context K/V of the projected tapped layers at p) keep this shape,
so the prefix store saves both the same way (store/drafter_records.py: pages of K/V rows,
the tail as a checkpoint's boundary state). A forward of S tokens feeds [tail, s[0 .. S-2]]
(the first forward has no tail: S - 1 states) and keeps s[S-1] as the new tail. A branch
forks the K/V layer with the target's layers and keeps the states its forwards produced;
the K/V of row p depend on rows 0 .. p only, so `commit(n)` keeps the rows of the n kept
tokens and takes the tail from the n-th kept state: what feeding only those tokens makes.

A stale segment (its runtime's state replaced without it, or lent to a drafter's rows)
holds nothing and ignores forwards until `load`. A subclass says how states are read from
the tap (`states`), how fed states become K/V rows (`feed`) and what the store needs to know
of a record (`probe`).
"""

from __future__ import annotations

import copy

import mlx.core as mx

from .errors import BranchError, InvariantError
from .layers.kv import KVLayer


class _Level:
    """One open branch: the state at its fork, and the states its forwards produced."""

    __slots__ = ("held", "tail", "states")

    def __init__(self, held: int, tail):
        self.held, self.tail, self.states = held, tail, []


class OneBehindSegment:
    """K/V rows of every position but the last, and the last position's state, one row.

    Args:
        tap: the target's tap, whose `last` holds the states of the runtime's last forward.
    """

    name = ""  # the segment's kind in a Runtime's drafters
    label = "drafter segment"  # how errors name it

    def __init__(self, tap):
        self.tap = tap
        # Invariant (not stale): kv.offset == held == max(n - 1, 0) and tail is None iff n == 0,
        # n the runtime's tokens; kv has one mark per open level, at that level's held.
        self.kv = KVLayer()
        self.held = 0
        self.tail: mx.array | None = None  # [1, 1, H]: s[n - 1]
        self.stale = False
        self._levels: list[_Level] = []

    # -- what a subclass says ------------------------------------------------------------

    def states(self, h: mx.array) -> mx.array:
        """The per-position states [1, S, H] of a forward's tap output `h` [1, S, ...]."""
        return h

    def feed(self, states: mx.array, tokens) -> None:
        """Append the K/V rows of `states` [1, F, H] (F >= 1) at row `held`; `tokens` are the F
        tokens that follow them (a list or an [F] array)."""
        raise NotImplementedError

    def probe(self) -> tuple:
        """(the specs of one row's K/V export, the spec of one state) for `spec`."""
        raise NotImplementedError

    # -- fed by the runtime ----------------------------------------------------------------

    @property
    def offset(self) -> int | None:
        """Target tokens the state accounts for (None while stale)."""
        return None if self.stale else self.held + (self.tail is not None)

    def forwarded(self, tokens) -> None:
        """The runtime forwarded `tokens` (a list or an [S] array): feed what they complete."""
        if not self.stale:
            self.extend(self.tap.last, tokens)  # the tap holds this forward's output

    def extend(self, h: mx.array | None, tokens) -> None:
        """The target went on by `tokens` (a list or an [S] array) whose tap output is `h` [1, S, ...]
        (a forward elsewhere, e.g. a padded batch's row). Without `h` (a forward the tap did not
        see) the segment goes stale."""
        if self.stale:
            return
        count = tokens.shape[0] if isinstance(tokens, mx.array) else len(tokens)
        if h is None or h.shape[:2] != (1, count):
            self.invalidate()  # nothing to feed from
            return
        s = self.states(h)
        if self.tail is None:
            fed, fed_tokens = s[:, :-1], tokens[1:]
        else:
            fed, fed_tokens = mx.concatenate([self.tail, s[:, :-1]], axis=1), tokens
        if fed.shape[1]:
            self.feed(fed, fed_tokens)
        self.held = self.kv.offset
        self.tail = s[:, -1:]
        if self._levels:
            self._levels[-1].states.append(s)

    @property
    def state(self):
        """The arrays a prefill evaluates with the layers'."""
        return () if self.stale or self.kv.keys is None else (self.kv.keys, self.kv.values, self.tail)

    # -- branches ----------------------------------------------------------------------------

    def fork(self) -> None:
        if self.stale:
            return
        self.kv.fork()
        self._levels.append(_Level(self.held, self.tail))

    def commit(self, n: int) -> None:
        if self.stale:
            return
        level = self._levels.pop()
        base = level.held + (level.tail is not None)
        kept = max(base + n - 1, 0)
        self.kv.commit(kept - level.held)
        self.held = kept
        if n == 0:
            self.tail = level.tail
        else:
            s = mx.concatenate(level.states, axis=1) if len(level.states) > 1 else level.states[0]
            self.tail = s[:, n - 1 : n]
            if self._levels:
                self._levels[-1].states.append(s[:, :n])

    def rollback(self) -> None:
        if self.stale:
            return
        level = self._levels.pop()
        self.kv.rollback()
        self.held, self.tail = level.held, level.tail

    def clone(self):
        other = copy.copy(self)  # the subclass's own references (its drafter, the tap) shared
        other.kv = self.kv.clone()
        first = self._levels[0] if self._levels else None
        other.held = first.held if first else self.held
        other.tail = first.tail if first else self.tail
        other._levels = []
        return other

    def mark(self):
        """The state before one forward: objects and counts, no buffer reference (the next
        write stays in place)."""
        levels = list(self._levels)
        return (self.kv, self.kv.savepoint(), self.held, self.tail, self.stale, levels,
                len(levels[-1].states) if levels else 0)

    def back(self, mark) -> None:
        """Undo the forward since `mark` (it failed), a stale turn included."""
        self.kv, kv_point, self.held, self.tail, self.stale, self._levels, chunks = mark
        self.kv.restore(kv_point)
        if self._levels:
            del self._levels[-1].states[chunks:]

    def savepoint(self):
        view = None if self.kv.keys is None else (self.kv.keys[...], self.kv.values[...])
        return self.mark(), view, [(lv.held, lv.tail, list(lv.states)) for lv in self._levels]

    def restore(self, point) -> None:
        mark, view, levels = point
        self.back(mark)
        if view is not None:
            self.kv.keys, self.kv.values = view
        self._levels = []
        for held, tail, states in levels:
            lv = _Level(held, tail)
            lv.states = states
            self._levels.append(lv)

    # -- stale, lent, loaded -------------------------------------------------------------------

    def invalidate(self) -> None:
        """Hold nothing until `load` (the runtime's state was replaced without this segment's)."""
        self.kv = KVLayer()
        self.held, self.tail, self.stale, self._levels = 0, None, True, []

    def lend(self) -> tuple:
        """Hand the state to a drafter's rows: (keys [1, h, held, D] or None, values, held, tail
        [1, 1, H] or None); the segment is stale afterwards (the decoder's rounds keep the state).

        Raises:
            BranchError: a branch is open. InvariantError: the segment is stale.
        """
        if self._levels:
            raise BranchError(f"lend() of the {self.label} with a branch open")
        if self.stale:
            raise InvariantError(f"lend() of a stale {self.label}")
        keys = values = None
        if self.held:
            keys, values = self.kv.keys[..., : self.held, :], self.kv.values[..., : self.held, :]
        out = (keys, values, self.held, self.tail)
        self.invalidate()
        return out

    def load(self, keys: mx.array | None, values: mx.array | None, held: int, tail: mx.array | None) -> None:
        """Take a stored state: the first `held` rows of `keys`/`values` (a buffer it writes on in
        place) and the boundary's state `tail` [1, 1, H].

        Raises:
            BranchError: a branch is open. ValueError: the parts do not agree; nothing changed.
        """
        if self._levels:
            raise BranchError(f"load() of the {self.label} with a branch open")
        if held < 0 or (held and (keys is None or values is None or tail is None)):
            raise ValueError(f"load(): {held} rows with tail {None if tail is None else tail.shape}")
        kv = KVLayer()
        if held:
            kv.load(keys, values, held)
        self.kv, self.held, self.tail, self.stale = kv, held, tail, False

    def export_rows(self, start: int, end: int) -> dict:
        """Own copies of rows [start, end) (`KVLayer.export_rows`: "k", "v")."""
        return self.kv.export_rows(start, end)

    def boundary(self) -> mx.array:
        """An own copy of the state at the last position (what a checkpoint there keeps)."""
        if self.stale or self.tail is None:
            raise InvariantError(f"boundary() of a {self.label} holding no token")
        return self.tail * 1

    def spec(self, pairs: int, boundary: bool = True) -> dict:
        """What a stored record of `pairs` rows (and with `boundary` a boundary state) may hold
        ("k", "v": the K/V rows, "hidden": [1, 1, H])."""
        kv, hidden = self.probe()
        out = {"hidden": hidden} if boundary else {}
        if pairs:
            out.update({n: (d, (*shape[:2], pairs, *shape[3:])) for n, (d, shape) in kv.items()})
        return out

    def rows_from(self, chunks: dict, pairs: int) -> tuple:
        """Stored row chunks {"k": [...], "v": [...]} of `pairs` rows -> (keys, values) of a buffer
        with free slots past them (`KVLayer.state_from`), or (None, None) for no row.

        Raises:
            ValueError: the chunks do not line up or hold another count.
        """
        if not pairs:
            return None, None
        keys, values, _ = self.kv.state_from(chunks, {}, pairs)
        return keys, values

    # -- invariants ---------------------------------------------------------------------------

    def check(self, offset: int, bases: list[int]) -> None:
        if self.stale:
            if self._levels or self.held or self.tail is not None:
                raise InvariantError(f"a stale {self.label} holds state")
            return
        self.kv.check()
        if self.kv.offset != self.held or self.held != max(offset - 1, 0) or (self.tail is None) != (offset == 0):
            raise InvariantError(f"the {self.label} holds {self.held} rows (kv {self.kv.offset}), tail "
                                 f"{None if self.tail is None else self.tail.shape}, for {offset} tokens")
        if self.kv.branch_offsets() != [lv.held for lv in self._levels]:
            raise InvariantError(f"the {self.label}'s kv marks {self.kv.branch_offsets()}, levels at "
                                 f"{[lv.held for lv in self._levels]}")
        if [lv.held for lv in self._levels] != [max(b - 1, 0) for b in bases]:
            raise InvariantError(f"the {self.label}'s levels at {[lv.held for lv in self._levels]} rows, "
                                 f"runtime branches at {bases} tokens")
