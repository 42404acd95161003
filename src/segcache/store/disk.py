"""The disk tier: one LMDB environment holding encoded records and their index.

Layout (see docs/format.md): named databases ``records.v1`` (key -> encoded
record), ``index.v1`` (key -> msgpack entry) and ``meta`` (format version,
the byte total and the store's parameters). A record and its index entry are
written and deleted in the same write transaction, so a crash leaves the old
state or the new, never a record without its entry. Several processes may open
one directory: LMDB serializes writers with its lock file and gives readers
snapshots. Read-modify-write (`update`) happens inside one write transaction.

Nothing here lets a damaged or foreign file kill the process: the directory is
checked before LMDB sees it, and data.mdb is checked against LMDB's own meta
pages (a file cut short would otherwise be mapped and fault with SIGBUS).

The budget bounds the file a user sees. LMDB keeps every value in whole pages
(a large one in a run of overflow pages) and keeps freed pages in the file for
reuse, so the values' byte total says little about data.mdb's size. Here:

    map cap   = the budget, in whole pages (>= _FLOOR)   the file can never grow past it
    in use    = the pages the databases hold now          LMDB's own counts (`_in_use`)
    high      = cap - max(_FREE x cap, _RESERVE)         kept free: copy-on-write needs fresh
                                                          pages, and a freed one waits two commits
    low       = high - _HYSTERESIS x cap
    before a write, if in use + the write > high, evict (its own transaction, whose
                freed pages the write then reuses) down to low - the write; one write
                transaction holds at most half the free reserve of values
    `gc`      evicts, then rewrites the file without its free pages when no other
              process has the store open (`_compact`)
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import struct
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import lmdb
import msgpack

from ..errors import InvariantError, StoreError, StoreFormatError, StoreWarning
from . import codec, units
from .files import STORE_FILES, fsync_dir, no_store, prepare_dir, sole_user
from .policy import safe_cost
from .record import Record

T = TypeVar("T")

DB_RECORDS = b"records.v1"
DB_INDEX = b"index.v1"
DB_META = b"meta"
META_FORMAT = b"format"  # msgpack {"version": int, "created": float}
META_BYTES = b"bytes"  # u64: sum of len(value) over records.v1 == sum of index nbytes
META_PARAMS = b"params"  # msgpack {"page_tokens": int, "salt": hex blake2b of the salt or None}
MAX_KEY = 511  # LMDB's default maximum key size

_U64 = struct.Struct("<Q")
_MIN_MAP = 64 << 20  # the map starts here (or at the cap, if smaller) and doubles up to the cap
_FLOOR = 1 << 20  # the smallest map (a smaller budget bounds the values, and the file by this)
_FREE = 0.08  # share of the map kept free (at least _RESERVE): room for copy-on-write and for runs
_RESERVE = 512 << 10  # of free pages long enough for a value, whatever the budget
_HYSTERESIS = 0.07  # eviction ahead of a write goes this share below the high-water mark
_FIT_TRIES = 4  # runs freed for one value the map cannot place before it is given up
_LOW_WATER = 0.95  # evict the values' byte total to 95% of the budget so a full store does not scan on every put
_BATCH_BYTES = 256 << 20  # encoded bytes per write transaction when writing many records
GRACE = 60.0  # seconds: a page written before the checkpoint that needs it (a flush in batches, another
# process's RAM) is not unresumable yet


@dataclass(frozen=True)
class Entry:
    """Index entry of one stored record (all plain values)."""

    key: bytes
    tokens: int
    nbytes: int  # len of the encoded value
    kind: str
    last_use: float  # unix seconds, comparable across processes
    cost: float  # seconds of compute saved; finite and >= 0 (clamped on read)
    created: float
    parent: bytes | None = None  # key of the record this one extends; it is evicted only after this one

    def pack(self) -> bytes:
        return msgpack.packb([self.tokens, self.nbytes, self.kind, self.last_use, self.cost, self.created, self.parent])

    @staticmethod
    def unpack(key: bytes, raw: bytes) -> "Entry":
        try:
            t, n, k, lu, c, cr, p = msgpack.unpackb(raw, raw=False)
            if p is not None and not isinstance(p, bytes):
                raise TypeError("parent")
            lu = float(lu)
            e = Entry(bytes(key), int(t), int(n), str(k), lu if math.isfinite(lu) else 0.0, safe_cost(c), float(cr), p)
        except Exception:
            raise codec.CorruptRecordError(f"corrupt index entry for key {bytes(key).hex()[:16]}") from None
        return e


class DiskTier:
    """LMDB-backed record storage bounded by ``disk_bytes`` of encoded values (the tiers' interface, `tier.py`)."""

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        disk_bytes: int,
        compress: bool = True,
        create: bool = True,
        max_readers: int = 126,
    ):
        self.path = os.fspath(path)
        self.disk_bytes = int(disk_bytes)  # the budget: of the file (the map's cap) and of META_BYTES
        self.compress = compress
        self.max_readers = max_readers
        # LMDB's page size is the OS's; the map (so the file) never grows past the cap, unless
        # the file already was larger (a smaller budget than before: `_fit` at open shrinks it).
        psize = mmap.PAGESIZE
        self.map_cap = max(_FLOOR, self.disk_bytes // psize * psize)
        self.high = self.map_cap - max(int(self.map_cap * _FREE), _RESERVE)  # pages in use at most, after a write
        self.low = self.high - int(self.map_cap * _HYSTERESIS)  # ...down to which eviction ahead of a write goes
        self.evictions = 0  # records removed to respect the budget, since open
        self.corrupt_dropped = 0  # bad records found and deleted, since open
        self.dropped = 0  # writes given up (too large, or the map could not hold them)
        self.reads = 0  # records read and checked, since open
        self._touched: dict[bytes, float] = {}  # last-use updates not yet written
        self._warned: set[bytes] = set()  # keys already reported as corrupt (one warning per record)
        # Eviction keeps what records not on disk yet need: () -> (keys they extend, their own keys).
        self.pinned: Callable[[], tuple[set[bytes], set[bytes]]] = lambda: (set(), set())
        self.grace = GRACE  # seconds a record nothing needs yet is kept (what it serves may be on its way)
        self._writing: set[bytes] = set()  # keys of the `write` in progress: its later batches need them
        self._closed = True
        had_store = prepare_dir(self.path, create=create)
        self._open_env(create=create)
        try:
            if not had_store:
                for f in STORE_FILES:
                    p = os.path.join(self.path, f)
                    if os.path.exists(p):
                        os.chmod(p, 0o600)
            self._open_dbs(create=create)
            self._closed = False
            if self.used_bytes() > self.disk_bytes or self.file_bytes() > self.map_cap:  # a smaller budget than before
                self.gc(int(self.disk_bytes * _LOW_WATER), pages=self.low)
        except lmdb.Error as e:
            self.env.close()
            self._closed = True
            raise StoreError(_lmdb_message(self.path, "open", e)) from None
        except BaseException:
            self.env.close()
            self._closed = True
            raise

    def _open_env(self, *, create: bool) -> None:
        data = os.path.join(self.path, "data.mdb")
        size = os.path.getsize(data) if os.path.exists(data) else 0
        try:
            self.env = lmdb.open(
                self.path,
                # over the cap (a smaller budget than before): room to evict in, until `gc` compacts
                map_size=size + _RESERVE if size > self.map_cap else min(self.map_cap, max(_MIN_MAP, 2 * size)),
                subdir=True,
                mode=0o600,
                create=create,
                lock=True,
                max_dbs=8,
                max_readers=self.max_readers,
                readahead=False,  # records are read whole and at random
                meminit=False,
            )
        except lmdb.Error as e:
            raise StoreError(_lmdb_message(self.path, "open", e)) from None
        try:
            self.psize = self.env.stat()["psize"]
            # the largest value a leaf holds inline; a larger one takes its own run of overflow pages
            self._nodemax = (((self.psize - 16) // 2) & ~1) - 2
            self.env.reader_check()  # slots of processes that died inside a read transaction
        except lmdb.Error as e:
            self.env.close()
            raise StoreError(_lmdb_message(self.path, "open", e)) from None

    # -- transactions -------------------------------------------------------

    def _run(self, fn: Callable[[lmdb.Transaction], T], *, write: bool = False, buffers: bool = False) -> T:
        """Run fn in one transaction; adopt a map another process grew, grow ours when full.

        fn may run more than once (after a resize); each run sees the then-current data.
        """
        readers_checked = False
        for _ in range(40):
            try:
                with self.env.begin(write=write, buffers=buffers) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)  # adopt the size another process set
            except lmdb.MapFullError:
                if not write or not self._grow():
                    raise
            except lmdb.ReadersFullError:
                if readers_checked:
                    raise StoreError(f"every LMDB reader slot of {self.path} is in use by live processes; close some, or retry") from None
                self.env.reader_check()  # free the slots of dead processes, then retry once
                readers_checked = True
        raise StoreError(f"LMDB at {self.path} kept changing size; retry, or close other writers")

    def _grow(self) -> bool:
        cur = self.env.info()["map_size"]
        new = min(self.map_cap, cur * 2)
        if new <= cur:
            return False
        self.env.set_mapsize(new)
        return True

    def _open_dbs(self, *, create: bool) -> None:
        with self.env.begin(write=True) as txn:
            self.meta = self.env.open_db(DB_META, txn=txn)
            raw = txn.get(META_FORMAT, db=self.meta)
            if raw is None:
                named = [bytes(k) for k, _ in txn.cursor() if k != DB_META]
                if named:
                    raise StoreFormatError(
                        f"{self.path} holds an LMDB environment that is not a segcache store "
                        f"(databases {named[:4]}); choose an empty directory"
                    )
                if not create:
                    raise no_store(self.path, "data.mdb holds no segcache store")
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
            self.main = self.env.open_db(None, txn=txn)

    def params(self, mine: dict) -> dict | None:
        """Record ``mine`` as the store's parameters if it has none; return the stored ones (None: just set)."""

        def fn(txn):
            raw = txn.get(META_PARAMS, db=self.meta)
            if raw is None:
                txn.put(META_PARAMS, msgpack.packb(mine), db=self.meta)
                return None
            try:
                got = msgpack.unpackb(raw, raw=False)
                return got if isinstance(got, dict) else {}
            except Exception:
                return {}

        return self._run(fn, write=True)

    def _in_use(self, txn) -> int:
        """Bytes of the pages the databases hold now: what the file holds but its free pages
        (LMDB's own counts: branch, leaf and overflow pages of every database, and the two meta pages)."""
        pages = 2
        for db in (self.main, self.meta, self.records, self.index):
            st = txn.stat(db)
            pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return pages * self.psize

    def _footprint(self, key: bytes, n: int) -> int:
        """Bytes of pages a record of an n-byte value takes: its overflow run (or its share of a
        leaf) and its index entry's share of a leaf."""
        node = 8 + len(key) + n
        if node > self._nodemax:
            node = ((16 - 1 + n) // self.psize + 1) * self.psize + 16 + len(key)  # OVPAGES, and the leaf node
        return node + 2 + (8 + len(key) + 80 + 2)

    def file_bytes(self) -> int:
        """The size of data.mdb: what the budget bounds."""
        return os.path.getsize(os.path.join(self.path, "data.mdb"))

    def _used(self, txn) -> int:
        raw = txn.get(META_BYTES, db=self.meta)
        return _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0

    # -- writes -------------------------------------------------------------

    def put(self, key: bytes, record: Record) -> None:
        """Encode and write one record (a failure is warned and counted in `dropped`)."""
        self.write([(key, record)])

    def write(self, items: list[tuple[bytes, Record]]) -> set[bytes]:
        """Encode records and write them in few transactions; returns the keys now on disk.

        Never raises: a record that cannot be encoded or written (full file system,
        I/O error, over the budget) is warned about and counted in `dropped`.
        """
        self._writing = {k for k, _ in items}  # a later batch's records may need an earlier one's
        try:
            return self._write(items)
        finally:
            self._writing = set()

    def _write(self, items: list[tuple[bytes, Record]]) -> set[bytes]:
        written: set[bytes] = set()
        batch, size = [], 0
        now = time.time()
        limit = min(_BATCH_BYTES, max(1, (self.map_cap - self.high) // 2))  # what one write may take of the reserve
        for key, rec in items:
            try:
                value = codec.encode(rec, key=key, compress=self.compress)
            except StoreError as e:  # validated at put, so this is a bug or a changed array
                warnings.warn(f"segcache store: not writing {key.hex()[:16]}: {e}", StoreWarning, stacklevel=2)
                self.dropped += 1
                continue
            batch.append((key, value, Entry(key, rec.tokens, len(value), rec.kind, now, safe_cost(rec.cost), now, rec.parent)))
            size += len(value)
            if size >= limit:
                written.update(self._write_batch(batch))
                batch, size = [], 0
        if batch:
            written.update(self._write_batch(batch))
        return written

    def _write_batch(self, batch) -> list[bytes]:
        try:
            return self.put_many(batch)
        except (lmdb.Error, StoreError, OSError) as e:  # e.g. the file system is full: a cache may lose entries
            warnings.warn(f"segcache store: {len(batch)} records not written to {self.path}: {e}", StoreWarning, stacklevel=3)
            self.dropped += len(batch)
            return []

    def put_many(self, items: list[tuple[bytes, bytes, Entry]]) -> list[bytes]:
        """Store encoded records (key, value, entry) in one transaction, evicting to the budget; never raises on space.

        Pages for the write are made free first (`_room`). If the map still cannot
        hold it (free pages in runs too short for a value, or held by another
        process's old reader), the batch is split; a single record gets runs freed
        for it (`_evict_fit`) a few times, then is given up.

        Returns:
            The keys now on disk (a record larger than the budget, or one the map
            cannot hold, is left out and counted in `dropped`).

        Raises:
            lmdb.Error: The write failed for another reason (e.g. the disk is full); nothing was written.
        """
        keep = [it for it in items
                if len(it[1]) <= self.disk_bytes * _LOW_WATER and self._footprint(it[0], len(it[1])) <= self.low]
        self.dropped += len(items) - len(keep)
        if not keep:
            return []
        need = sum(self._footprint(k, len(v)) for k, v, _ in keep)
        self._room(need)
        try:
            evicted = self._run(lambda txn: self._put_txn(txn, keep), write=True)
        except lmdb.MapFullError:
            if len(keep) > 1:  # smaller transactions need fewer free pages at once
                mid = len(keep) // 2
                return self.put_many(keep[:mid]) + self.put_many(keep[mid:])
            # Enough pages are free, but in runs too short for this value (or held by an
            # old reader): free a run it fits, then try again.
            for attempt in range(_FIT_TRIES):
                self.evictions += self._run(lambda txn: self._evict_fit(txn, len(keep[0][1])), write=True)
                self._release()
                try:
                    evicted = self._run(lambda txn: self._put_txn(txn, keep), write=True)
                    break
                except lmdb.MapFullError:
                    if attempt == _FIT_TRIES - 1:
                        self.dropped += 1
                        return []
        self.evictions += evicted
        return [k for k, _, _ in keep]

    def _evict_fit(self, txn, nbytes: int) -> int:
        """Evict so that a value of nbytes finds a run of free pages; returns the count."""
        self._flush_touched(txn)
        used, n = self._evict_txn(txn, self._used(txn), None, fits=nbytes)
        if not n:  # no record that large: free twice its size by the usual order, hoping runs join
            used, n = self._evict_txn(txn, used, None, pages=max(self._in_use(txn) - 2 * nbytes, 0))
        txn.put(META_BYTES, _U64.pack(max(used, 0)), db=self.meta)
        return n

    def _room(self, need: int, force: bool = False) -> None:
        """Evict, in a transaction of its own, until `need` more bytes of pages fit under the
        high-water mark (with `force`, down to the low-water mark less `need` in any case).

        The write that follows reuses the pages this frees (`_release`).
        """
        if not force and self._run(self._in_use) + need <= self.high:
            return
        target = max(self.low - need, 0)

        def fn(txn):
            self._flush_touched(txn)
            used, n = self._evict_txn(txn, self._used(txn), None, pages=target)
            txn.put(META_BYTES, _U64.pack(max(used, 0)), db=self.meta)
            return n

        n = self._run(fn, write=True)
        self.evictions += n
        if n:
            self._release()

    def _release(self) -> None:
        """Commit one more (trivial) write, so the pages the last one freed can be reused.

        LMDB keeps the last two snapshots (its two meta pages): pages freed by
        transaction N belong to snapshot N-1 and are handed out from transaction N+2 on
        (when no reader still sees them).
        """
        self._run(lambda txn: txn.put(META_BYTES, _U64.pack(self._used(txn)), db=self.meta), write=True)

    def _put_txn(self, txn, items) -> int:
        self._flush_touched(txn)
        used = self._used(txn)
        for key, value, entry in items:
            used += self._put_one(txn, key, value, entry)
        evicted = 0
        if used > self.disk_bytes:
            used, evicted = self._evict_txn(txn, used, int(self.disk_bytes * _LOW_WATER), keep={k for k, _, _ in items})
        txn.put(META_BYTES, _U64.pack(max(used, 0)), db=self.meta)
        return evicted

    def _put_one(self, txn, key: bytes, value: bytes, entry: Entry) -> int:
        """Write one record and its entry; returns the change of the byte total."""
        delta = len(value)
        old = txn.get(key, db=self.index)
        if old is not None:
            delta -= self._entry_or_none(key, old, default=len(txn.get(key, db=self.records) or b""))
        txn.put(key, value, db=self.records)
        txn.put(key, entry.pack(), db=self.index)
        self._warned.discard(key)
        return delta

    def update(self, key: bytes, fn: Callable[[Record | None], Record | None], encode: Callable[[Record], bytes]) -> tuple[Record | None, bool]:
        """`update_many` of one key: (the record now stored under key, whether fn's result was written)."""
        return self.update_many([(key, fn)], lambda _, rec: encode(rec))[0]

    def update_many(self, items: Sequence[tuple[bytes, Callable[[Record | None], Record | None]]],
                    encode: Callable[[bytes, Record], bytes]) -> list[tuple[Record | None, bool]]:
        """Read, change and write each key inside ONE write transaction (atomic across processes).

        All or nothing: if any fn or encode raises, or any new value exceeds the budget,
        the transaction is aborted and nothing is written. A key listed twice sees the
        first fn's result.

        Args:
            items: (key, fn) pairs. fn: current record (decoded from disk, None if absent or
                corrupt) -> new record, or None to leave it as it is. May run more than once
                (after a map resize).
            encode: (key, Record) -> value bytes.

        Returns:
            Per item, (the record now stored under its key, whether fn's result was written).

        Raises:
            StoreError: A new value exceeds the disk budget (nothing was written).
            lmdb.Error: The write failed (nothing was written).
        """
        items = list(items)
        if not items:
            return []

        def txn_fn(txn):
            self._flush_touched(txn)
            used = self._used(txn)
            out, bads = [], []
            for key, fn in items:
                v = txn.get(key, db=self.records)
                current = None
                if v is not None:
                    r = codec.decode_many([(v, key, None)])[0]
                    if isinstance(r, codec.CorruptRecordError):
                        bads.append((key, r))
                    else:
                        current = r
                new = fn(current)
                if new is None:
                    out.append((current, False))
                    continue
                value = encode(key, new)
                if len(value) > self.disk_bytes * _LOW_WATER or self._footprint(key, len(value)) > self.low:
                    raise StoreError(f"record of {len(value)} bytes for {key.hex()[:16]} exceeds the disk budget {self.disk_bytes}; nothing was written")
                now = time.time()
                used += self._put_one(txn, key, value, Entry(key, new.tokens, len(value), new.kind, now, safe_cost(new.cost), now, new.parent))
                out.append((new, True))
            evicted = 0
            if any(w for _, w in out):
                if used > self.disk_bytes:
                    used, evicted = self._evict_txn(txn, used, int(self.disk_bytes * _LOW_WATER), keep={k for k, _ in items})
                txn.put(META_BYTES, _U64.pack(max(used, 0)), db=self.meta)
            return out, evicted, bads

        self._room(4 * self.psize * len(items))  # a node: a few pages
        try:
            out, evicted, bads = self._run(txn_fn, write=True)
        except lmdb.MapFullError:
            self._room(16 * self.psize * len(items), force=True)
            out, evicted, bads = self._run(txn_fn, write=True)
        written = {k for (k, _), (_, w) in zip(items, out) if w}
        for key, bad in bads:
            self._report(key, bad)
            self.corrupt_dropped += key in written  # overwritten; if left, the next read drops it
        self.evictions += evicted
        return out

    @staticmethod
    def _entry_or_none(key, raw, default: int) -> int:
        try:
            return Entry.unpack(key, raw).nbytes
        except codec.CorruptRecordError:
            return default

    def _units(self, txn, keep=frozenset(), grace: bool = True) -> units.Units:
        """The records' units (`units.py`) as the index lists them now.

        Kept, besides ``keep``: the records ``pinned`` names (what records still in RAM
        extend), and (with ``grace``) records written in the last ``self.grace`` seconds
        that nothing needs yet (a page whose checkpoint is on its way, from this
        process or another).
        """
        items: dict[bytes, units.Item] = {}
        created: dict[bytes, float] = {}
        for k, raw in txn.cursor(db=self.index):
            k = bytes(k)
            try:
                e = Entry.unpack(k, raw)
                items[k] = units.Item(k, e.kind, e.tokens, e.nbytes, e.parent, e.cost, e.last_use)
                created[k] = e.created
            except codec.CorruptRecordError:  # unreadable entry: unresumable, first to go
                items[k] = units.Item(k, "", 0, len(txn.get(k, db=self.records) or b""), k, 0.0, 0.0)
        protect, elsewhere = self.pinned()
        keep = set(keep) | set(protect) | self._writing
        found = units.Units(items, keep=keep, elsewhere=elsewhere)
        recent = time.time() - self.grace
        young = {k for k in items if k not in found.needed and created.get(k, 0.0) > recent} if grace else set()
        if young:
            found = units.Units(items, keep=keep | young, elsewhere=elsewhere)
        return found

    def _evict_txn(self, txn, used: int, target: int | None, keep: set[bytes] = frozenset(),
                   pages: int | None = None, fits: int | None = None, purge: bool = False,
                   grace: bool = True) -> tuple[int, int]:
        """Delete records until used <= target and the pages in use <= pages (None: no bound);
        returns (used, count). With ``fits``, delete one unit only, the first holding a value of
        at least ``fits`` bytes: its run of pages then holds such a value.

        Whenever anything is deleted (and always with ``purge``), every unresumable record
        goes first, whatever the bound; then whole units, least valuable first
        (`units.Units.order`), so a surviving record always has what it resumes from and
        what it needs. ``keep`` (the keys being written) goes last. Without ``grace``
        (`gc`, `verify`: asked for), records written in the last seconds that nothing
        needs yet are unresumable too. The caller writes ``used`` back to META_BYTES in
        the same transaction.
        """

        fitted = False

        def over(used: int) -> bool:
            if fits is not None:
                return not fitted
            return (target is not None and used > target) or (pages is not None and self._in_use(txn) > pages)

        n = 0
        if not purge and not over(used):
            return used, 0
        found = self._units(txn, keep, grace=grace)
        sizes = {k: it.nbytes for k, it in found.items.items()}
        unresumable = set(found.unresumable())

        def delete(group):
            nonlocal used, n
            for k in group:
                txn.delete(k, db=self.records)
                txn.delete(k, db=self.index)
                self._touched.pop(k, None)
                used -= sizes[k]
                n += 1

        for group in found.order():
            if group[0] in unresumable and group[0] not in found.keep:
                delete(group)
                continue
            if not over(used):
                break
            if fits is not None:
                if not any(sizes[k] >= fits for k in group):
                    continue
                fitted = True
            delete(group)
        return used, n

    def _evict_to(self, txn, target: int, pages: int | None = None) -> int:
        used, n = self._evict_txn(txn, self._used(txn), target, pages=pages, purge=True, grace=False)
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
                txn.put(k, Entry(k, e.tokens, e.nbytes, e.kind, t, e.cost, e.created, e.parent).pack(), db=self.index)
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

    def gc(self, max_bytes: int, pages: int | None = None) -> int:
        """Evict every unresumable record, then units (`units.py`), until their values hold <= max_bytes (and the pages in use
        are <= pages, if given), then give the file's free pages back if it is larger than
        max_bytes (`_compact`); returns the count."""
        if max_bytes < 0:
            raise StoreError(f"gc needs max_bytes >= 0, got {max_bytes}; nothing was evicted")
        n = self._run(lambda txn: self._evict_to(txn, int(max_bytes), pages), write=True)
        self.evictions += n
        if self.file_bytes() > max_bytes:
            self._compact()
        return n

    def _compact(self) -> bool:
        """Rewrite data.mdb without its free pages, if no other process has the store open.

        LMDB never shrinks its file: freed pages stay for reuse. A copy of the live
        pages replaces it, under the lock LMDB itself checks at open (an exclusive
        fcntl lock on byte 0 of lock.mdb; every process with the store open holds a
        shared one, and one opening it meanwhile waits). Returns whether it did; the
        environment is open again either way.
        """
        self.flush()
        self.env.close()
        done = False
        try:
            with sole_user(self.path) as sole:
                if sole:
                    tmp = tempfile.mkdtemp(prefix=".compact-", dir=self.path)
                    try:
                        src = lmdb.open(self.path, readonly=True, lock=False, subdir=True, max_dbs=8)
                        try:
                            src.copy(tmp, compact=True)
                        finally:
                            src.close()
                        os.chmod(os.path.join(tmp, "data.mdb"), 0o600)
                        os.replace(os.path.join(tmp, "data.mdb"), os.path.join(self.path, "data.mdb"))
                        fsync_dir(self.path)
                        done = True
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
        except (lmdb.Error, OSError) as e:  # e.g. no room for the copy: the store stays as it was
            warnings.warn(f"segcache store: could not compact {self.path}: {e}", StoreWarning, stacklevel=3)
        finally:
            self._open_env(create=False)
            self._open_dbs(create=False)
        return done

    def flush(self) -> None:
        """Write pending last-use updates."""
        if self._touched:
            self._run(self._flush_touched, write=True)

    # -- reads --------------------------------------------------------------

    def _report(self, key: bytes, err: Exception) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"segcache store: record {key.hex()[:16]} in {self.path} dropped: {err}", StoreWarning, stacklevel=5)

    def get_many(self, keys: list[bytes], expects: list[codec.Expect | None] | None = None) -> list[Record | None]:
        """Decode the records at keys in ONE read transaction; corrupt ones are deleted, counted, warned, and missing.

        Args:
            keys: Record keys.
            expects: Per key, the layout its arrays must match (see `codec.read_header`), or None.
        """
        if not keys:
            return []
        exp = expects if expects is not None else [None] * len(keys)

        def fn(txn):
            items, where = [], []
            for i, k in enumerate(keys):
                v = txn.get(k, db=self.records)
                if v is not None:
                    items.append((v, k, exp[i]))
                    where.append(i)
            decoded = codec.decode_many(items)  # copies out of the map before the transaction ends
            bad = [(keys[i], bytes(items[j][0]), r) for j, (i, r) in enumerate(zip(where, decoded)) if isinstance(r, Exception)]
            return where, decoded, bad

        where, decoded, bad = self._run(fn, buffers=True)
        out: list[Record | None] = [None] * len(keys)
        now = time.time()
        for i, r in zip(where, decoded):
            if not isinstance(r, Exception):
                out[i] = r
                self._touched[keys[i]] = now
                self.reads += 1
        for k, v, err in bad:
            if self.delete(k, only_if=v):
                self.corrupt_dropped += 1
            self._report(k, err)
        return out

    def get(self, key: bytes, expect: codec.Expect | None = None) -> Record | None:
        """Decode the record at key; a corrupt one is deleted, counted, warned, and reported as a miss."""
        return self.get_many([key], None if expect is None else [expect])[0]

    def contains(self, key: bytes) -> bool:
        return self._run(lambda txn: txn.get(key, db=self.index) is not None)

    def raw(self, key: bytes) -> bytes | None:
        """The stored value at key as it is (encoded, not checked), or None."""
        return self._run(lambda txn: txn.get(key, db=self.records))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` of each key, in one read transaction."""
        return self._run(lambda txn: [txn.get(k, db=self.index) is not None for k in keys])

    def used_bytes(self) -> int:
        return self._run(self._used)

    def stats(self) -> dict[str, int]:
        used, pages, entries, useless = self._run(lambda txn: (self._used(txn), self._in_use(txn), txn.stat(self.records)["entries"],
                                                               self._units(txn, grace=False).unresumable_bytes()))
        return {"disk_reads": self.reads, "disk_evictions": self.evictions, "disk_corrupt": self.corrupt_dropped,
                "disk_dropped": self.dropped, "disk_bytes": used, "disk_entries": entries,
                "disk_page_bytes": pages, "disk_file_bytes": self.file_bytes(), "disk_unresumable_bytes": useless}

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
        """Check every record completely (bounded memory); delete bad ones, orphans and stale totals."""
        keys = self._run(lambda txn: [bytes(k) for k in txn.cursor(db=self.records).iternext(values=False)])
        bad: list[tuple[bytes, bytes, Exception]] = []
        for i in range(0, len(keys), chunk):  # short read transactions

            def fn(txn, part=keys[i : i + chunk]):
                out = []
                for k in part:
                    v = txn.get(k, db=self.records)
                    if v is None:
                        continue
                    try:
                        h = codec.check_value(v, key=k)
                        e = Entry.unpack(k, txn.get(k, db=self.index) or b"")
                        if (e.tokens, e.kind, e.nbytes, e.parent) != (h["tokens"], h["kind"], len(v), h["parent"]):
                            raise codec.CorruptRecordError("index entry disagrees with the record")
                    except (codec.CorruptRecordError, MemoryError, OverflowError) as err:
                        out.append((k, bytes(v), err))
                return out

            bad += self._run(fn, buffers=True)
        dropped = 0
        for k, v, err in bad:
            if self.delete(k, only_if=v):
                dropped += 1
                self._report(k, err)
        self.corrupt_dropped += dropped

        def fix(txn):  # index entries without records, and the byte total
            orphans = [bytes(k) for k in txn.cursor(db=self.index).iternext(values=False) if txn.get(k, db=self.records) is None]
            for k in orphans:
                txn.delete(k, db=self.index)
            total = sum(len(v) for _, v in txn.cursor(db=self.records))
            fixed_total = total != self._used(txn)
            txn.put(META_BYTES, _U64.pack(total), db=self.meta)
            return len(orphans), fixed_total, txn.stat(self.records)["entries"], total

        orphans, fixed_total, _, _ = self._run(fix, write=True)

        def purge(txn):  # what nothing can resume from (past the grace of records on their way)
            used = self._used(txn)
            left, gone = self._evict_txn(txn, used, None, purge=True, grace=False)
            txn.put(META_BYTES, _U64.pack(max(left, 0)), db=self.meta)
            return gone, used - left, txn.stat(self.records)["entries"], left

        useless, useless_bytes, n, total = self._run(purge, write=True)
        self.evictions += useless
        return {"checked": len(keys), "corrupt": dropped, "orphans": orphans, "fixed_total": fixed_total,
                "unresumable": useless, "unresumable_bytes": useless_bytes, "entries": n, "bytes": total}

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
        if self.evictions:
            useless = self._run(lambda txn: self._units(txn).unresumable_bytes())
            if useless:
                raise InvariantError(f"disk tier holds {useless} bytes nothing can resume from after {self.evictions} "
                                     f"evictions (every eviction removes those first)")

    def close(self) -> None:
        """Write pending last-use updates and close the environment; idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        except (lmdb.Error, StoreError):
            pass  # last-use hints only
        self.env.close()
        self._closed = True


def _lmdb_message(path: str, what: str, e: lmdb.Error) -> str:
    text = str(e)
    if "already open" in text:
        return f"the prefix store at {path} is already open in this process; share that PrefixStore handle (or close it first)"
    return f"cannot {what} the prefix store at {path}: {type(e).__name__}: {text}. If the store is damaged, delete the directory (it is only a cache)"

