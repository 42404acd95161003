"""The MTP head's attention cache as a drafter segment of a Runtime (drafter_segments.py).

    target   tokens 0 .. n-1, hidden[0 .. n-1]                   (the runtime's layers)
    kv       pairs (hidden[p], token[p+1]) for p < held           one behind: held = max(n - 1, 0)
    tail     hidden[n-1], [1, 1, H]                               not fed yet (its token comes next)

Every forward of S tokens through the runtime feeds the head the pairs it
completes: (tail, t_0), (h_0, t_1), ..., (h_{S-2}, t_{S-1}) in one head call
(the first forward has no tail: S - 1 pairs), and keeps h_{S-1} as the new
tail; the hidden states come from the target's tap (mtp/tap.py) of that very
forward. A branch forks the head's KV layer with the target's layers and keeps
the hidden states its forwards produced, so `commit(n)` keeps the pairs of the
n kept tokens and takes the tail from the n-th kept state, exactly what feeding
only those tokens would have made (the K/V of a pair depend on that pair and
the pairs before it, nothing later).

A stale segment (the runtime's state was replaced by a `restore` the store did
not accompany with the head's, or a decoder took the head's state for its rows:
`lend`) holds nothing and ignores forwards until `load`.

The store saves `kv`'s rows as pages and the tail as the boundary's hidden
state (store/drafter_records.py), under an identity naming the head's weights.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from ..errors import BranchError, InvariantError
from ..layers.kv import KVLayer
from ..store.identity import weights_fingerprint
from ..spec import spec_of
from .module import MTPHead, _text_parts
from .tap import install
from .weights import head_named


class _Level:
    """One open branch: the state at its fork, and the hidden states its forwards produced."""

    __slots__ = ("held", "tail", "hidden")

    def __init__(self, held: int, tail):
        self.held, self.tail, self.hidden = held, tail, []


class HeadSegment:
    """The MTP head's attention cache and unfed hidden state, one row, as a drafter segment.

    Args:
        head: the target's `MTPHead` (a drafter runs `head.for_drafting()`; so does this).
    """

    name = "mtp"

    def __init__(self, head: MTPHead):
        self.head = head.for_drafting()
        self.tap = install(self.head.model)
        # Invariant (not stale): kv.offset == held == max(n - 1, 0) and tail is None iff n == 0,
        # n the runtime's tokens; kv has one mark per open level, at that level's held.
        self.kv = KVLayer()
        self.held = 0
        self.tail: mx.array | None = None  # [1, 1, H]: hidden[n - 1]
        self.stale = False
        self._levels: list[_Level] = []

    @property
    def offset(self) -> int | None:
        """Target tokens the state accounts for (None while stale)."""
        return None if self.stale else self.held + (self.tail is not None)

    @property
    def identity(self) -> bytes:
        """What names the head in the store: its weights and layers (another head is a miss)."""
        return head_identity(self.head)

    # -- fed by the runtime ------------------------------------------------------

    def forwarded(self, tokens) -> None:
        """The runtime forwarded `tokens` (a list or an [S] array): feed the pairs they complete."""
        if not self.stale:
            self.extend(self.tap.last, tokens)  # the tap holds this forward's [1, S, H]

    def extend(self, h: mx.array | None, tokens) -> None:
        """The target went on by `tokens` (a list or an [S] array) whose hidden states are `h`
        [1, S, H] (a forward elsewhere, e.g. a padded batch's row): feed the pairs they complete.
        Without `h` (a forward the tap did not see) the segment goes stale."""
        if self.stale:
            return
        toks = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)
        if h is None or h.shape[:2] != (1, toks.shape[0]):
            self.invalidate()  # nothing to feed from
            return
        if self.tail is None:
            hidden, fed = h[:, :-1], toks[1:]
        else:
            hidden, fed = mx.concatenate([self.tail, h[:, :-1]], axis=1), toks
        if fed.shape[0]:
            self.head(hidden, fed[None], [self.kv] * self.head.num_layers)  # depth 0: layer 0's cache
        self.held = self.kv.offset
        self.tail = h[:, -1:]
        if self._levels:
            self._levels[-1].hidden.append(h)

    @property
    def state(self):
        """The arrays a prefill evaluates with the layers'."""
        return () if self.stale or self.kv.keys is None else (self.kv.keys, self.kv.values, self.tail)

    # -- branches ----------------------------------------------------------------

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
            hidden = mx.concatenate(level.hidden, axis=1) if len(level.hidden) > 1 else level.hidden[0]
            self.tail = hidden[:, n - 1 : n]
            if self._levels:
                self._levels[-1].hidden.append(hidden[:, :n])

    def rollback(self) -> None:
        if self.stale:
            return
        level = self._levels.pop()
        self.kv.rollback()
        self.held, self.tail = level.held, level.tail

    def clone(self) -> "HeadSegment":
        other = object.__new__(HeadSegment)
        other.head, other.tap, other.stale = self.head, self.tap, self.stale
        other.kv = self.kv.clone()
        first = self._levels[0] if self._levels else None
        other.held = first.held if first else self.held
        other.tail = first.tail if first else self.tail
        other._levels = []
        return other

    def mark(self):
        """The state before one forward: objects and counts, no buffer reference (the head's next
        write stays in place)."""
        levels = list(self._levels)
        return (self.kv, self.kv.savepoint(), self.held, self.tail, self.stale, levels,
                len(levels[-1].hidden) if levels else 0)

    def back(self, mark) -> None:
        """Undo the forward since `mark` (it failed), a stale turn included."""
        self.kv, kv_point, self.held, self.tail, self.stale, self._levels, chunks = mark
        self.kv.restore(kv_point)
        if self._levels:
            del self._levels[-1].hidden[chunks:]

    def savepoint(self):
        view = None if self.kv.keys is None else (self.kv.keys[...], self.kv.values[...])
        return self.mark(), view, [(lv.held, lv.tail, list(lv.hidden)) for lv in self._levels]

    def restore(self, point) -> None:
        mark, view, levels = point
        self.back(mark)
        if view is not None:
            self.kv.keys, self.kv.values = view
        self._levels = []
        for held, tail, hidden in levels:
            lv = _Level(held, tail)
            lv.hidden = hidden
            self._levels.append(lv)

    # -- stale, lent, loaded -----------------------------------------------------------

    def invalidate(self) -> None:
        """Hold nothing until `load` (the runtime's state was replaced without the head's)."""
        self.kv = KVLayer()
        self.held, self.tail, self.stale, self._levels = 0, None, True, []

    def lend(self) -> tuple:
        """Hand the state to a drafter's rows (HeadRows): (keys [1, h, held, D] or None, values, tail [1, 1, H]
        or None); the segment is stale afterwards (the decoder's rounds keep the head's state from then on).

        Raises:
            BranchError: a branch is open.
        """
        if self._levels:
            raise BranchError("lend() of the MTP head's segment with a branch open")
        if self.stale:
            raise InvariantError("lend() of a stale MTP head segment")
        keys = values = None
        if self.held:
            keys, values = self.kv.keys[..., : self.held, :], self.kv.values[..., : self.held, :]
        out = (keys, values, self.tail)
        self.invalidate()
        return out

    def load(self, keys: mx.array | None, values: mx.array | None, held: int, tail: mx.array | None) -> None:
        """Take a stored state: the first `held` pairs of `keys`/`values` (a buffer it writes on in
        place) and the boundary's hidden state `tail` [1, 1, H].

        Raises:
            BranchError: a branch is open. ValueError: the parts do not agree; nothing changed.
        """
        if self._levels:
            raise BranchError("load() of the MTP head's segment with a branch open")
        if held < 0 or (held and (keys is None or values is None or tail is None)):
            raise ValueError(f"load(): {held} pairs with tail {None if tail is None else tail.shape}")
        kv = KVLayer()
        if held:
            kv.load(keys, values, held)
        self.kv, self.held, self.tail, self.stale = kv, held, tail, False

    def export_rows(self, start: int, end: int) -> dict:
        """Own copies of pairs [start, end) (`KVLayer.export_rows`: "k", "v")."""
        return self.kv.export_rows(start, end)

    def boundary(self) -> mx.array:
        """An own copy of the hidden state at the last position (what a checkpoint there keeps)."""
        if self.stale or self.tail is None:
            raise InvariantError("boundary() of an MTP head segment holding no token")
        return self.tail * 1

    def spec(self, pairs: int, boundary: bool = True) -> dict:
        """What a stored record of `pairs` pairs (and with `boundary` a boundary state) may hold
        ("k", "v": the head's K/V rows, "hidden": [1, 1, H]), from one probe of the target and the head."""
        probe = _PROBES.get(self.head)
        if probe is None:
            probe = _PROBES[self.head] = _probe(self.head)
        kv, hidden = probe
        out = {"hidden": hidden} if boundary else {}
        if pairs:
            out.update({n: (d, (*shape[:2], pairs, *shape[3:])) for n, (d, shape) in kv.items()})
        return out

    def rows_from(self, chunks: dict, pairs: int) -> tuple:
        """Stored row chunks {"k": [...], "v": [...]} of `pairs` pairs -> (keys, values) of a buffer
        with free slots past them (`KVLayer.state_from`), or (None, None) for no pair.

        Raises:
            ValueError: the chunks do not line up or hold another count.
        """
        if not pairs:
            return None, None
        keys, values, _ = self.kv.state_from(chunks, {}, pairs)
        return keys, values

    # -- invariants -------------------------------------------------------------------

    def check(self, offset: int, bases: list[int]) -> None:
        if self.stale:
            if self._levels or self.held or self.tail is not None:
                raise InvariantError("a stale MTP head segment holds state")
            return
        self.kv.check()
        if self.kv.offset != self.held or self.held != max(offset - 1, 0) or (self.tail is None) != (offset == 0):
            raise InvariantError(f"MTP head holds {self.held} pairs (kv {self.kv.offset}), tail "
                                 f"{None if self.tail is None else self.tail.shape}, for {offset} tokens")
        if self.kv.branch_offsets() != [lv.held for lv in self._levels]:
            raise InvariantError(f"MTP head kv marks {self.kv.branch_offsets()}, levels at "
                                 f"{[lv.held for lv in self._levels]}")
        want = [max(b - 1, 0) for b in bases]
        if [lv.held for lv in self._levels] != want:
            raise InvariantError(f"MTP head levels at {[lv.held for lv in self._levels]} pairs, runtime branches "
                                 f"at {bases} tokens")


_PROBES: "weakref.WeakKeyDictionary[MTPHead, tuple]" = weakref.WeakKeyDictionary()


def _probe(head: MTPHead) -> tuple:
    """The specs of one pair's K/V and of one hidden state: the target's final norm of one token's
    embedding (the dtype and width its backbone hands the output head; not through the tap, which
    may be collecting a prefill's states), fed to the head with a token."""
    _, text_model, _, _ = _text_parts(head.model)
    hidden = install(head.model).norm(text_model.embed_tokens(mx.array([[0]], dtype=mx.uint32)))
    kv = KVLayer()
    head(hidden, mx.array([[0]], dtype=mx.uint32), [kv] * head.num_layers)
    return spec_of(kv.export_rows(0, 1)), spec_of({"hidden": hidden})["hidden"]


def head_identity(head: MTPHead) -> bytes:
    """The head's name in the store (`MTPHead.identity`)."""
    return head.identity


def segment(model, value) -> HeadSegment:
    """`Runtime(model, mtp=value)`: a `HeadSegment`, or a head as `head_named` reads `value` (an
    MTPHead, True, or a path)."""
    if isinstance(value, HeadSegment):
        if value.head.model is not model:
            raise ValueError("mtp=: the segment's head is another model's")
        return value
    return HeadSegment(head_named(model, value))
