"""The RAM tier: decoded records bounded by bytes, evicted by what a resume needs.

Putting a record is a dict insert: no copy and no compression. The budget counts
what a record costs this process, not only its array bytes (`footprint`): an
index node of a few hundred bytes holds a Python object, its dicts, an MLX array
and the tier's own bookkeeping, about 1.5 KiB measured, so many small records
cannot outgrow the budget unseen. Eviction goes by units (`units.py`): first the
records no record in RAM resumes from, then a checkpoint with the pages only it
needs, least valuable first. Records that
leave RAM and are not on disk yet ("dirty") are handed, in one batch per
eviction round, to a callback that suspends them to disk. It answers the
tiers' interface (`tier.py`) and, for the store above it, keeps which records
are dirty.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Sequence

import mlx.core as mx

from ..errors import InvariantError, StoreWarning
from .codec import Expect, fits
from .record import Record
from .units import Item, Units

SuspendFn = Callable[[list[tuple[bytes, Record]]], None]

RECORD_OVERHEAD = 1024  # bytes a record costs besides its arrays: the objects, its meta, the tier's maps
ARRAY_OVERHEAD = 512  # bytes an MLX array costs besides its data (wrapper, descriptor, allocation)


def footprint(key: bytes, record: Record) -> int:
    """Bytes the RAM budget counts for one record: its arrays, its key and the fixed overheads."""
    return record.nbytes + len(key) + RECORD_OVERHEAD + ARRAY_OVERHEAD * len(record.arrays)


class RamTier:
    """Byte-bounded map of key -> Record with cost-aware eviction."""

    name = "ram"

    def __init__(self, ram_bytes: int, on_evict: SuspendFn):
        self.budget = int(ram_bytes)
        self._on_evict = on_evict  # receives dirty records leaving RAM; must not raise
        self._items: dict[bytes, Record] = {}
        self._nbytes: dict[bytes, int] = {}  # same keys as _items; footprint(key, record) at insert
        self._last: dict[bytes, int] = {}  # same keys as _items; value of _clock at last use
        self._dirty: set[bytes] = set()  # subset of _items: not known to be on disk
        self.used = 0  # == sum(_nbytes.values()) <= budget between public calls
        self.evictions = 0  # records that left RAM for lack of room, since creation
        self.reads = 0  # records served by get/get_many, since creation
        self.corrupt = 0  # records dropped because they did not fit the layout asked for
        self._clock = 0  # strictly increasing use counter

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def put(self, key: bytes, record: Record, *, dirty: bool = True) -> None:
        """Insert (or replace) key, then evict until the budget holds."""
        self.put_many([(key, record)], dirty=dirty)

    def put_many(self, items: list[tuple[bytes, Record]], *, dirty: bool = True) -> None:
        """Insert (or replace) records together, then evict until the budget holds.

        What one publish writes goes in together: its pages are needed by its
        checkpoint, which an eviction between them would not see yet. They are
        evicted last (`Units` keep).
        """
        big = []
        for key, record in items:
            self.pop(key)
            n = footprint(key, record)
            if n > self.budget:  # never fits: straight to disk
                self.evictions += 1
                if dirty:
                    big.append((key, record))
                continue
            self._items[key] = record
            self._nbytes[key] = n
            self._last[key] = self._tick()
            if dirty:
                self._dirty.add(key)
            self.used += n
        if big:
            self._on_evict(big)
        if self.used > self.budget:
            self._evict(self.budget, keep={k for k, _ in items})

    def get(self, key: bytes, expect: Expect | None = None) -> Record | None:
        """The record at key (counting a use), or None; one that does not fit `expect` is dropped."""
        rec = self._items.get(key)
        if rec is None:
            return None
        if not fits(rec, expect):  # a caller changed its arrays after put, or a bug: never serve it
            self.pop(key)
            self.corrupt += 1
            warnings.warn(f"segcache store: record {key.hex()[:16]} dropped from RAM: its arrays do not match "
                          f"the layout {dict(expect)}", StoreWarning, stacklevel=4)
            return None
        self._last[key] = self._tick()
        self.reads += 1
        return rec

    def get_many(self, keys: Sequence[bytes], expects: Sequence[Expect | None] | None = None) -> list[Record | None]:
        exp = expects if expects is not None else [None] * len(keys)
        return [self.get(k, e) for k, e in zip(keys, exp)]

    def delete(self, key: bytes) -> bool:
        """Remove key without suspending it; whether it was held."""
        return self.pop(key) is not None

    def peek(self, key: bytes) -> Record | None:
        """The record at key, without counting a use."""
        return self._items.get(key)

    def pop(self, key: bytes) -> Record | None:
        """Remove key without suspending it; returns the record or None."""
        rec = self._items.pop(key, None)
        if rec is not None:
            self.used -= self._nbytes.pop(key)
            del self._last[key]
            self._dirty.discard(key)
        return rec

    def share(self, items: Sequence[tuple[bytes, dict]]) -> int:
        """Hold the given arrays in place of the same-named arrays of the records at their keys,
        where every one has the same dtype, shape and bytes: a live runtime's views over its
        own buffer (store/sharing.py), so its rows are in memory once, not also as the copies
        a publish made. Footprints, uses and dirtiness stay; a record absent, or an array
        that differs in any way, is left as it is.

        Returns:
            The records that now share their arrays.
        """
        found = []
        for key, arrays in items:
            rec = self._items.get(key)
            olds = [rec.arrays.get(n) for n in arrays] if rec is not None else []
            if not arrays or any(o is None or o.dtype != a.dtype or o.shape != a.shape
                                 for o, a in zip(olds, arrays.values())):
                continue
            found.append((key, rec, arrays, mx.stack([mx.array_equal(o, a) for o, a in zip(olds, arrays.values())])))
        if not found:
            return 0
        mx.eval([f[3] for f in found])
        shared = 0
        for key, rec, arrays, same in found:
            if bool(mx.all(same).item()) and self._items.get(key) is rec:
                self._items[key] = dataclasses.replace(rec, arrays={**rec.arrays, **arrays})
                shared += 1
        return shared

    def units(self, keep=frozenset()) -> Units:
        """The records' units as RAM holds them (a parent on disk only ends a chain, `units.py`)."""
        items = {k: Item(k, r.kind, r.tokens, self._nbytes[k], r.parent, r.cost, self._last[k]) for k, r in self._items.items()}
        return Units(items, complete=False, keep=keep)

    def _evict(self, target: int, keep=frozenset()) -> None:
        """Evict the unresumable records, then units, until at most target bytes remain.

        Dirty records leave in one batch, each unit's records parents first, so the
        disk receives a checkpoint with the pages it needs."""
        found = self.units(keep)
        useless = set(found.unresumable())
        out = []
        for group in found.order():
            if group[0] not in useless and self.used <= target:
                break
            for k in reversed(group):  # parents (pages) before the checkpoint
                dirty = k in self._dirty
                rec = self.pop(k)
                self.evictions += 1
                if dirty:
                    out.append((k, rec))
        if out:  # state is consistent before the callback runs
            self._on_evict(out)

    def shrink(self, target: int) -> None:
        """Evict (suspending dirty records) until at most target bytes remain."""
        if self.used > target:
            self._evict(max(int(target), 0))

    def dirty(self) -> list[tuple[bytes, Record]]:
        """Records not yet on disk, oldest use first."""
        return sorted(((k, self._items[k]) for k in self._dirty), key=lambda kv: self._last[kv[0]])

    def dirty_keys(self) -> set[bytes]:
        """The keys of the records not yet on disk."""
        return set(self._dirty)

    def mark_clean(self, keys) -> None:
        self._dirty.difference_update(keys)

    def keys(self) -> list[bytes]:
        return list(self._items)

    def is_dirty(self, key: bytes) -> bool:
        return key in self._dirty

    def stats(self) -> dict[str, int]:
        return {"ram_reads": self.reads, "ram_evictions": self.evictions, "ram_corrupt": self.corrupt,
                "ram_bytes": self.used, "ram_entries": len(self._items)}

    def check(self) -> None:
        """Raise InvariantError unless the bookkeeping agrees with itself and the budget."""
        if not (set(self._items) == set(self._nbytes) == set(self._last)):
            raise InvariantError("RAM tier maps disagree on their keys")
        if not self._dirty <= set(self._items):
            raise InvariantError("RAM tier has dirty keys that it does not hold")
        total = sum(self._nbytes.values())
        if total != self.used:
            raise InvariantError(f"RAM tier counts {self.used} bytes, records sum to {total}")
        for k, r in self._items.items():
            if footprint(k, r) != self._nbytes[k]:
                raise InvariantError(f"record {k.hex()[:16]} changed size in RAM")
        if self.used > self.budget:
            raise InvariantError(f"RAM tier holds {self.used} bytes over its budget {self.budget}")
        if len(set(self._last.values())) != len(self._last):
            raise InvariantError("RAM tier has two records with the same use tick")
