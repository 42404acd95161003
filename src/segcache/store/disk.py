"""The disk tier: one LMDB environment holding encoded records and their index.

Layout (see docs/format.md): named databases ``records.v1`` (key -> encoded
record), ``index.v1`` (key -> msgpack entry) and ``meta`` (format version and
the byte total). A record and its index entry are written and deleted in the
same write transaction, so a crash leaves the old state or the new, never a
record without its entry. Several processes may open one directory: LMDB
serializes writers with its lock file and gives readers snapshots.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import lmdb
import msgpack

from ..errors import InvariantError, StoreError, StoreFormatError
from . import codec
from .policy import eviction_key
from .record import Record

T = TypeVar("T")

DB_RECORDS = b"records.v1"
DB_INDEX = b"index.v1"
DB_META = b"meta"
META_FORMAT = b"format"  # msgpack {"version": int, "created": float}
META_BYTES = b"bytes"  # u64: sum of len(value) over records.v1 == sum of index nbytes
MAX_KEY = 511  # LMDB's default maximum key size

_U64 = struct.Struct("<Q")
_MIN_MAP = 64 << 20
_LOW_WATER = 0.95  # evict to 95% of the budget so a full store does not scan on every put


@dataclass(frozen=True)
class Entry:
    """Index entry of one stored record (all plain values)."""

    key: bytes
    tokens: int
    nbytes: int  # len of the encoded value
    kind: str
    last_use: float  # unix seconds, comparable across processes
    cost: float  # seconds of compute saved
    created: float

    def pack(self) -> bytes:
        return msgpack.packb([self.tokens, self.nbytes, self.kind, self.last_use, self.cost, self.created])

    @staticmethod
    def unpack(key: bytes, raw: bytes) -> "Entry":
        try:
            t, n, k, lu, c, cr = msgpack.unpackb(raw, raw=False)
            e = Entry(bytes(key), int(t), int(n), str(k), float(lu), float(c), float(cr))
        except Exception:
            raise codec.CorruptRecordError(f"corrupt index entry for key {bytes(key).hex()[:16]}") from None
        return e


def _check_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # the cache may hold prompt contents: private to the user


class DiskTier:
    """LMDB-backed record storage bounded by ``disk_bytes`` of encoded values."""

    def __init__(self, path: str | os.PathLike, *, disk_bytes: int, compress: bool = True):
        self.path = os.fspath(path)
        self.disk_bytes = int(disk_bytes)  # budget on META_BYTES, enforced at every write
        self.compress = compress
        # LMDB needs room beyond the values: pages, overflow rounding, free pages that
        # readers still see. The map never grows past this cap.
        self.map_cap = max(2 * self.disk_bytes + _MIN_MAP, _MIN_MAP)
        self.evictions = 0  # records removed to respect the budget, since open
        self.corrupt_dropped = 0  # bad records found and deleted, since open
        self.dropped = 0  # writes given up (too large, or the map could not hold them)
        self._touched: dict[bytes, float] = {}  # last-use updates not yet written
        _check_dir(self.path)
        data = os.path.join(self.path, "data.mdb")
        size = os.path.getsize(data) if os.path.exists(data) else 0
        self.env = lmdb.open(
            self.path,
            map_size=min(self.map_cap, max(_MIN_MAP, 2 * size)),
            subdir=True,
            mode=0o600,
            lock=True,
            max_dbs=8,
            max_readers=126,
            readahead=False,  # records are read whole and at random
            meminit=False,
        )
        try:
            for f in ("data.mdb", "lock.mdb"):
                p = os.path.join(self.path, f)
                if os.path.exists(p):
                    os.chmod(p, 0o600)
            self._open_dbs()
        except BaseException:
            self.env.close()
            raise
        self._closed = False

    # -- transactions -------------------------------------------------------

    def _run(self, fn: Callable[[lmdb.Transaction], T], *, write: bool = False, buffers: bool = False) -> T:
        """Run fn in one transaction; adopt a map another process grew, grow ours when full."""
        for _ in range(40):
            try:
                with self.env.begin(write=write, buffers=buffers) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)  # adopt the size another process set
            except lmdb.MapFullError:
                if not write or not self._grow():
                    raise
        raise StoreError(f"LMDB at {self.path} kept changing size; retry, or close other writers")

    def _grow(self) -> bool:
        cur = self.env.info()["map_size"]
        new = min(self.map_cap, cur * 2)
        if new <= cur:
            return False
        self.env.set_mapsize(new)
        return True

    def _open_dbs(self) -> None:
        with self.env.begin(write=True) as txn:
            self.meta = self.env.open_db(DB_META, txn=txn)
            raw = txn.get(META_FORMAT, db=self.meta)
            if raw is None:
                named = [k for k, _ in txn.cursor() if k != DB_META]
                if named:
                    raise StoreFormatError(
                        f"{self.path} holds an LMDB environment that is not a segcache store "
                        f"(databases {named[:4]}); choose an empty directory"
                    )
                txn.put(META_FORMAT, msgpack.packb({"version": codec.FORMAT_VERSION, "created": time.time()}), db=self.meta)
                txn.put(META_BYTES, _U64.pack(0), db=self.meta)
            else:
                try:
                    version = msgpack.unpackb(raw, raw=False)["version"]
                except Exception:
                    version = "unreadable"
                if version != codec.FORMAT_VERSION:
                    raise StoreFormatError(
                        f"prefix store at {self.path} has format version {version}; this segcache reads "
                        f"version {codec.FORMAT_VERSION}. Delete the directory (it is only a cache) or "
                        f"point the store at another path."
                    )
            self.records = self.env.open_db(DB_RECORDS, txn=txn)
            self.index = self.env.open_db(DB_INDEX, txn=txn)

    def _used(self, txn) -> int:
        raw = txn.get(META_BYTES, db=self.meta)
        return _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0

    # -- writes -------------------------------------------------------------

    def put_many(self, items: list[tuple[bytes, bytes, Entry]]) -> int:
        """Store encoded records in one transaction, evicting to the budget; never raises on space.

        Returns:
            How many of the items are stored.
        """
        keep = [it for it in items if len(it[1]) <= self.disk_bytes * _LOW_WATER]
        self.dropped += len(items) - len(keep)
        if not keep:
            return 0
        try:
            evicted = self._run(lambda txn: self._put_txn(txn, keep), write=True)
        except lmdb.MapFullError:
            if len(keep) > 1:  # the map is at its cap: smaller transactions need fewer fresh pages
                mid = len(keep) // 2
                return self.put_many(keep[:mid]) + self.put_many(keep[mid:])
            self.evictions += self._run(lambda txn: self._evict_to(txn, self.disk_bytes // 2), write=True)
            try:
                evicted = self._run(lambda txn: self._put_txn(txn, keep), write=True)
            except lmdb.MapFullError:
                self.dropped += 1
                return 0
        self.evictions += evicted
        return len(keep)

    def _put_txn(self, txn, items) -> int:
        self._flush_touched(txn)
        used = self._used(txn)
        for key, value, entry in items:
            old = txn.get(key, db=self.index)
            if old is not None:
                used -= self._entry_or_none(key, old, default=len(txn.get(key, db=self.records) or b""))
            txn.put(key, value, db=self.records)
            txn.put(key, entry.pack(), db=self.index)
            used += len(value)
        evicted = 0
        if used > self.disk_bytes:
            used, evicted = self._evict_txn(txn, used, int(self.disk_bytes * _LOW_WATER))
        txn.put(META_BYTES, _U64.pack(max(used, 0)), db=self.meta)
        return evicted

    @staticmethod
    def _entry_or_none(key, raw, default: int) -> int:
        try:
            return Entry.unpack(key, raw).nbytes
        except codec.CorruptRecordError:
            return default

    def _evict_txn(self, txn, used: int, target: int) -> tuple[int, int]:
        """Delete oldest-least-useful records until used <= target; returns (used, count).

        The caller writes ``used`` back to META_BYTES in the same transaction.
        """
        cands = []
        for k, raw in txn.cursor(db=self.index):
            try:
                e = Entry.unpack(k, raw)
                cands.append((eviction_key(e.cost, e.nbytes, e.last_use), bytes(k), e.nbytes))
            except codec.CorruptRecordError:
                cands.append(((-(10**9), 0.0), bytes(k), len(txn.get(k, db=self.records) or b"")))
        cands.sort()
        n = 0
        for _, k, nb in cands:
            if used <= target:
                break
            txn.delete(k, db=self.records)
            txn.delete(k, db=self.index)
            used -= nb
            n += 1
        return used, n

    def _evict_to(self, txn, target: int) -> int:
        used, n = self._evict_txn(txn, self._used(txn), target)
        txn.put(META_BYTES, _U64.pack(max(used, 0)), db=self.meta)
        return n

    def _flush_touched(self, txn) -> None:
        for k, t in self._touched.items():
            raw = txn.get(k, db=self.index)
            if raw is None:
                continue
            try:
                e = Entry.unpack(k, raw)
            except codec.CorruptRecordError:
                continue
            if t > e.last_use:
                txn.put(k, Entry(k, e.tokens, e.nbytes, e.kind, t, e.cost, e.created).pack(), db=self.index)
        self._touched.clear()

    def delete(self, key: bytes, only_if: bytes | None = None) -> bool:
        """Delete key (only if its value still equals ``only_if``, when given)."""

        def fn(txn):
            v = txn.get(key, db=self.records)
            if v is None or (only_if is not None and v != only_if):
                ie = txn.get(key, db=self.index)
                if v is None and ie is not None:  # an index entry alone: drop it too
                    txn.delete(key, db=self.index)
                return False
            ie = txn.get(key, db=self.index)
            n = len(v) if ie is None else self._entry_or_none(key, ie, default=len(v))  # META_BYTES sums index sizes
            txn.delete(key, db=self.records)
            txn.delete(key, db=self.index)
            txn.put(META_BYTES, _U64.pack(max(self._used(txn) - n, 0)), db=self.meta)
            return True

        self._touched.pop(key, None)
        return self._run(fn, write=True)

    def gc(self, max_bytes: int) -> int:
        """Evict oldest-least-useful records until the store holds <= max_bytes; returns the count."""
        n = self._run(lambda txn: self._evict_to(txn, int(max_bytes)), write=True)
        self.evictions += n
        return n

    def flush(self) -> None:
        """Write pending last-use updates."""
        if self._touched:
            self._run(self._flush_touched, write=True)

    # -- reads --------------------------------------------------------------

    def get(self, key: bytes) -> Record | None:
        """Decode the record at key; a corrupt one is deleted, counted, and reported as a miss."""

        def fn(txn):
            v = txn.get(key, db=self.records)
            if v is None:
                return None, None
            try:
                return codec.decode(v), None  # decode copies out of the map before the txn ends
            except codec.CorruptRecordError:
                return None, bytes(v)

        rec, bad = self._run(fn, buffers=True)
        if bad is not None:
            if self.delete(key, only_if=bad):
                self.corrupt_dropped += 1
            return None
        if rec is not None:
            self._touched[key] = time.time()
        return rec

    def contains(self, key: bytes) -> bool:
        return self._run(lambda txn: txn.get(key, db=self.index) is not None)

    def used_bytes(self) -> int:
        return self._run(self._used)

    def count(self) -> int:
        return self._run(lambda txn: txn.stat(self.records)["entries"])

    def entries(self) -> list[Entry]:
        """Every index entry (unreadable ones skipped; `verify` removes them)."""

        def fn(txn):
            out = []
            for k, raw in txn.cursor(db=self.index):
                try:
                    out.append(Entry.unpack(k, raw))
                except codec.CorruptRecordError:
                    pass
            return out

        return self._run(fn)

    def verify(self, chunk: int = 32) -> dict:
        """Decode every record; delete bad ones, orphans and stale totals. Returns a report."""
        keys = self._run(lambda txn: [bytes(k) for k in txn.cursor(db=self.records).iternext(values=False)])
        bad: list[tuple[bytes, bytes]] = []
        for i in range(0, len(keys), chunk):  # short read transactions

            def fn(txn, part=keys[i : i + chunk]):
                out = []
                for k in part:
                    v = txn.get(k, db=self.records)
                    if v is None:
                        continue
                    try:
                        rec = codec.decode(v)
                        e = Entry.unpack(k, txn.get(k, db=self.index) or b"")
                        if (e.tokens, e.kind, e.nbytes) != (rec.tokens, rec.kind, len(v)):
                            raise codec.CorruptRecordError("index entry disagrees with the record")
                    except codec.CorruptRecordError:
                        out.append((k, bytes(v)))
                return out

            bad += self._run(fn, buffers=True)
        dropped = sum(self.delete(k, only_if=v) for k, v in bad)
        self.corrupt_dropped += dropped

        def fix(txn):  # index entries without records, and the byte total
            orphans = [bytes(k) for k in txn.cursor(db=self.index).iternext(values=False) if txn.get(k, db=self.records) is None]
            for k in orphans:
                txn.delete(k, db=self.index)
            total = sum(len(v) for _, v in txn.cursor(db=self.records))
            fixed_total = total != self._used(txn)
            txn.put(META_BYTES, _U64.pack(total), db=self.meta)
            return len(orphans), fixed_total, txn.stat(self.records)["entries"], total

        orphans, fixed_total, n, total = self._run(fix, write=True)
        return {"checked": len(keys), "corrupt": dropped, "orphans": orphans, "fixed_total": fixed_total, "entries": n, "bytes": total}

    def check(self, budget: bool = True) -> None:
        """Raise InvariantError unless index, records and byte total agree (and fit the budget)."""

        def fn(txn):
            rec_keys = {bytes(k): len(v) for k, v in txn.cursor(db=self.records)}
            idx = {}
            for k, raw in txn.cursor(db=self.index):
                idx[bytes(k)] = Entry.unpack(k, raw)
            return rec_keys, idx, self._used(txn)

        rec_keys, idx, used = self._run(fn)
        if set(rec_keys) != set(idx):
            raise InvariantError(f"records and index differ in {len(set(rec_keys) ^ set(idx))} keys")
        for k, n in rec_keys.items():
            if idx[k].nbytes != n:
                raise InvariantError(f"index says {idx[k].nbytes} bytes for {k.hex()[:16]}, record has {n}")
        if sum(rec_keys.values()) != used:
            raise InvariantError(f"byte total {used} != sum of records {sum(rec_keys.values())}")
        if budget and used > self.disk_bytes:
            raise InvariantError(f"disk tier holds {used} bytes over its budget {self.disk_bytes}")

    def close(self) -> None:
        """Write pending last-use updates and close the environment; idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        except lmdb.Error:
            pass  # last-use hints only
        self.env.close()
        self._closed = True
