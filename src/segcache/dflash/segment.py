"""A DFlash drafter's context cache as a drafter segment of a Runtime (drafter_segments.py).

    target   tokens 0 .. n-1; ctx[p] = the drafter's fc + norm of the tapped layers at p
    kv       every drafter layer's context K/V of ctx[0 .. held-1]      one behind: held = max(n - 1, 0)
    tail     ctx[n-1], [1, 1, H]                                      projected at the next draft

One behind like the MTP head's segment (mtp/state.py), so the prefix store keeps it the
same way (store/drafter_records.py: pages of K/V rows, the boundary's `tail` at a
checkpoint). A forward of S tokens through the runtime appends the K/V of [tail, ctx of
its first S-1 positions] at positions held.. and keeps its last ctx as the tail; the
layer outputs come from the target's tap (dflash/tap.py) of that very forward. K/V of
position p depend on ctx[p] and p only, so a branch's `commit(n)` keeps the first rows
of what its forwards appended, and the tail is the n-th kept ctx: exactly what feeding
only the kept tokens makes. The block's own K/V never enter the cache.

A stale segment (its runtime's state replaced without it, or lent to a drafter's rows)
holds nothing and ignores forwards until `load`.
"""

from __future__ import annotations

import hashlib
import weakref

import mlx.core as mx

from ..errors import BranchError, InvariantError
from ..layers.kv import KVLayer
from ..spec import spec_of
from ..store.identity import weights_fingerprint
from .model import Drafter, _target_parts
from .tap import install


class _Level:
    """One open branch: the state at its fork, and the ctx its forwards produced."""

    __slots__ = ("held", "tail", "ctx")

    def __init__(self, held: int, tail):
        self.held, self.tail, self.ctx = held, tail, []


class ContextSegment:
    """The drafter's context K/V and unprojected last ctx, one row, as a drafter segment.

    Args:
        drafter: the `Drafter` bound to the runtime's model.
    """

    name = "dflash"

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.tap = install(drafter.model, drafter.cfg.target_layer_ids)
        # Invariant (not stale): kv.offset == held == max(n - 1, 0) and tail is None iff n == 0,
        # n the runtime's tokens; kv has one mark per open level, at that level's held.
        self.kv = KVLayer()
        self.held = 0
        self.tail: mx.array | None = None  # [1, 1, H]: ctx[n - 1]
        self.stale = False
        self._levels: list[_Level] = []

    @property
    def offset(self) -> int | None:
        return None if self.stale else self.held + (self.tail is not None)

    @property
    def identity(self) -> bytes:
        """What names the drafter in the store: its weights, layers and taps."""
        return drafter_identity(self.drafter)

    # -- fed by the runtime ------------------------------------------------------

    def forwarded(self, tokens) -> None:
        if not self.stale:
            self.extend(self.tap.last, tokens)

    def extend(self, h: mx.array | None, tokens) -> None:
        """The target went on by `tokens` whose tapped layer outputs are `h` [1, S, m*H]; without
        `h` (a forward the tap did not see) the segment goes stale."""
        if self.stale:
            return
        S = tokens.shape[0] if isinstance(tokens, mx.array) else len(tokens)
        if h is None or h.shape[:2] != (1, S):
            self.invalidate()
            return
        ctx = self.drafter.context(h)
        fed = ctx[:, :-1] if self.tail is None else mx.concatenate([self.tail, ctx[:, :-1]], axis=1)
        if fed.shape[1]:
            k, v = self.drafter.context_kv(fed, self.held)
            self.kv.update_and_fetch(k, v)
        self.held = self.kv.offset
        self.tail = ctx[:, -1:]
        if self._levels:
            self._levels[-1].ctx.append(ctx)

    @property
    def state(self):
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
            ctx = mx.concatenate(level.ctx, axis=1) if len(level.ctx) > 1 else level.ctx[0]
            self.tail = ctx[:, n - 1 : n]
            if self._levels:
                self._levels[-1].ctx.append(ctx[:, :n])

    def rollback(self) -> None:
        if self.stale:
            return
        level = self._levels.pop()
        self.kv.rollback()
        self.held, self.tail = level.held, level.tail

    def clone(self) -> "ContextSegment":
        other = object.__new__(ContextSegment)
        other.drafter, other.tap, other.stale = self.drafter, self.tap, self.stale
        other.kv = self.kv.clone()
        first = self._levels[0] if self._levels else None
        other.held = first.held if first else self.held
        other.tail = first.tail if first else self.tail
        other._levels = []
        return other

    def mark(self):
        levels = list(self._levels)
        return (self.kv, self.kv.savepoint(), self.held, self.tail, self.stale, levels,
                len(levels[-1].ctx) if levels else 0)

    def back(self, mark) -> None:
        self.kv, kv_point, self.held, self.tail, self.stale, self._levels, chunks = mark
        self.kv.restore(kv_point)
        if self._levels:
            del self._levels[-1].ctx[chunks:]

    def savepoint(self):
        view = None if self.kv.keys is None else (self.kv.keys[...], self.kv.values[...])
        return self.mark(), view, [(lv.held, lv.tail, list(lv.ctx)) for lv in self._levels]

    def restore(self, point) -> None:
        mark, view, levels = point
        self.back(mark)
        if view is not None:
            self.kv.keys, self.kv.values = view
        self._levels = []
        for held, tail, ctx in levels:
            lv = _Level(held, tail)
            lv.ctx = ctx
            self._levels.append(lv)

    # -- stale, lent, loaded -----------------------------------------------------------

    def invalidate(self) -> None:
        self.kv = KVLayer()
        self.held, self.tail, self.stale, self._levels = 0, None, True, []

    def lend(self) -> tuple:
        """Hand the state to a drafter's rows: (keys [1, L*h, held, D] or None, values, held, tail
        [1, 1, H] or None); the segment is stale afterwards.

        Raises:
            BranchError: a branch is open. InvariantError: the segment is stale.
        """
        if self._levels:
            raise BranchError("lend() of the DFlash segment with a branch open")
        if self.stale:
            raise InvariantError("lend() of a stale DFlash segment")
        keys = values = None
        if self.held:
            keys, values = self.kv.keys[..., : self.held, :], self.kv.values[..., : self.held, :]
        out = (keys, values, self.held, self.tail)
        self.invalidate()
        return out

    def load(self, keys, values, held: int, tail) -> None:
        """Take a stored state: the first `held` context rows of `keys`/`values` and the boundary's
        ctx `tail` [1, 1, H].

        Raises:
            BranchError: a branch is open. ValueError: the parts do not agree; nothing changed.
        """
        if self._levels:
            raise BranchError("load() of the DFlash segment with a branch open")
        if held < 0 or (held and (keys is None or values is None)) or (held and tail is None):
            raise ValueError(f"load(): {held} rows with tail {None if tail is None else tail.shape}")
        kv = KVLayer()
        if held:
            kv.load(keys, values, held)
        self.kv, self.held, self.tail, self.stale = kv, held, tail, False

    def export_rows(self, start: int, end: int) -> dict:
        return self.kv.export_rows(start, end)

    def boundary(self) -> mx.array:
        if self.stale or self.tail is None:
            raise InvariantError("boundary() of a DFlash segment holding no token")
        return self.tail * 1

    def spec(self, pairs: int, boundary: bool = True) -> dict:
        """What a stored record of `pairs` context rows (and with `boundary` the last ctx) may hold."""
        probe = _PROBES.get(self.drafter)
        if probe is None:
            probe = _PROBES[self.drafter] = _probe(self.drafter)
        kv, hidden = probe
        out = {"hidden": hidden} if boundary else {}
        if pairs:
            out.update({n: (d, (*shape[:2], pairs, *shape[3:])) for n, (d, shape) in kv.items()})
        return out

    def rows_from(self, chunks: dict, pairs: int) -> tuple:
        if not pairs:
            return None, None
        keys, values, _ = self.kv.state_from(chunks, {}, pairs)
        return keys, values

    # -- invariants -------------------------------------------------------------------

    def check(self, offset: int, bases: list[int]) -> None:
        if self.stale:
            if self._levels or self.held or self.tail is not None:
                raise InvariantError("a stale DFlash segment holds state")
            return
        self.kv.check()
        if self.kv.offset != self.held or self.held != max(offset - 1, 0) or (self.tail is None) != (offset == 0):
            raise InvariantError(f"DFlash context holds {self.held} rows (kv {self.kv.offset}), tail "
                                 f"{None if self.tail is None else self.tail.shape}, for {offset} tokens")
        if self.kv.branch_offsets() != [lv.held for lv in self._levels]:
            raise InvariantError(f"DFlash kv marks {self.kv.branch_offsets()}, levels at "
                                 f"{[lv.held for lv in self._levels]}")
        if [lv.held for lv in self._levels] != [max(b - 1, 0) for b in bases]:
            raise InvariantError(f"DFlash levels at {[lv.held for lv in self._levels]} rows, runtime branches "
                                 f"at {bases} tokens")


_PROBES: "weakref.WeakKeyDictionary[Drafter, tuple]" = weakref.WeakKeyDictionary()


def _probe(drafter: Drafter) -> tuple:
    """The specs of one context row's K/V and of one ctx, from the dtype the target's layers hand on."""
    inner, _, _ = _target_parts(drafter.model)
    x = inner.embed_tokens(mx.array([[0]], dtype=mx.uint32))
    h = mx.zeros((1, 1, drafter.cfg.context_width), dtype=x.dtype)
    ctx = drafter.context(h)
    kv = KVLayer()
    kv.update_and_fetch(*drafter.context_kv(ctx, 0))
    return spec_of(kv.export_rows(0, 1)), spec_of({"hidden": ctx})["hidden"]


_IDENTITIES: "weakref.WeakKeyDictionary[Drafter, bytes]" = weakref.WeakKeyDictionary()


def drafter_identity(drafter: Drafter) -> bytes:
    found = _IDENTITIES.get(drafter)
    if found is None:
        h = hashlib.blake2b(digest_size=32, person=b"segcache.dfl.1")
        c = drafter.cfg
        h.update(f"dflash|layers={c.num_hidden_layers}|taps={list(c.target_layer_ids)}|".encode())
        h.update(weights_fingerprint(drafter.module))
        found = _IDENTITIES[drafter] = h.digest()
    return found


def segment(model, value) -> ContextSegment:
    """`Runtime(model, dflash=value)`: a `ContextSegment`, or one of a `Drafter` bound to `model`."""
    if isinstance(value, ContextSegment):
        value = value.drafter
    if not isinstance(value, Drafter):
        raise ValueError(f"dflash=: a DFlash Drafter (segcache.dflash.load_dflash(path, model)), not "
                         f"{type(value).__name__}")
    if value.model is not model:
        raise ValueError("dflash=: the drafter is bound to another model")
    return ContextSegment(value)
