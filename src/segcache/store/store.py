"""`PrefixStore`: the tiers (RAM -> LMDB -> optional remote) behind one key -> Record API.

Every tier answers the same interface (`tier.py`); a read asks them in order,
fastest first, and says which one answered (`find_many`). RAM holds decoded
records and takes writes without copying or compressing. What RAM evicts, and
everything still dirty at `flush`/`close`, is encoded (compressed where it
pays) and written to LMDB in a few large transactions. A RAM miss reads disk
and promotes the record to RAM. With a remote tier (`remote.py`), puts and
node updates are also written through in the background, and a miss in both
local tiers asks the remote, which checks the value exactly as a disk value is
checked; it fills RAM (from where it reaches disk like any record).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import math
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import lmdb
import mlx.core as mx
import msgpack

from ..errors import StoreError, StoreWarning
from . import codec
from .codec import Expect
from .disk import MAX_KEY, DiskTier
from .ram import RamTier
from .record import Record
from .remote import Busy, RemoteTier
from .tier import Tier


@dataclass(frozen=True)
class EntryInfo:
    """One row of `PrefixStore.entries()`."""

    key: bytes
    tokens: int
    nbytes: int  # encoded bytes on disk, or array bytes for a record only in RAM
    kind: str
    last_use: float  # unix seconds (RAM-only records: time of listing)
    tier: str  # "disk" or "ram"
    parent: bytes | None = None  # the record this one extends (Record.parent)


def _validate(key: bytes, record: Record) -> None:
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY:
        raise StoreError(f"store keys are 1..{MAX_KEY} bytes, got {type(key).__name__} of length {len(key) if isinstance(key, bytes) else '?'}")
    if not isinstance(record, Record):
        raise StoreError(f"put takes a segcache.store.Record, got {type(record).__name__}")
    if not isinstance(record.kind, str) or len(record.kind) > 64:
        raise StoreError(f"Record.kind must be a str of <= 64 chars, got {record.kind!r}")
    if not isinstance(record.tokens, int) or record.tokens < 0:
        raise StoreError(f"Record.tokens must be an int >= 0, got {record.tokens!r}")
    if isinstance(record.cost, bool) or not isinstance(record.cost, (int, float)) or not math.isfinite(record.cost) or record.cost < 0:
        raise StoreError(f"Record.cost must be finite seconds >= 0, got {record.cost!r}")
    if record.parent is not None and (not isinstance(record.parent, bytes) or not 1 <= len(record.parent) <= MAX_KEY):
        raise StoreError(f"Record.parent must be a key (bytes of 1..{MAX_KEY}) or None, got {record.parent!r}")
    for name, a in record.arrays.items():
        if not isinstance(name, str) or not isinstance(a, mx.array):
            raise StoreError(f"Record.arrays maps str -> mx.array; entry {name!r} is {type(a).__name__}")
        if a.dtype not in codec._NAME_OF:
            raise StoreError(f"array {name!r} has dtype {a.dtype}, which the store cannot keep; cast it first")
    try:
        msgpack.packb(record.meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise StoreError(f"Record.meta must be msgpack-able plain values ({e})") from e


_REMOTE_STATS = ("remote_reads", "remote_writes", "remote_errors", "remote_dropped", "remote_backlog", "remote_corrupt")  # 0 without a remote


class Found(NamedTuple):
    """A record and the tier that served it ("ram", "disk" or "remote")."""

    record: Record
    tier: str


def salt_digest(salt: bytes | str | None) -> str | None:
    """What the store's meta keeps of a salt: a hash, never the salt itself."""
    if salt is None:
        return None
    raw = salt.encode() if isinstance(salt, str) else bytes(salt)
    return hashlib.blake2b(raw, digest_size=16, person=b"segcache.salt").hexdigest()


@contextlib.contextmanager
def _store_errors(path: str, what: str):
    """Turn an LMDB or OS failure of a store operation into a StoreError that says what was asked."""
    try:
        yield
    except lmdb.Error as e:
        raise StoreError(f"prefix store at {path}: {what} failed ({type(e).__name__}: {e}); nothing was changed") from None


class PrefixStore:
    """Key -> Record store with a RAM tier over an LMDB tier. Use `open_store` to create one."""

    def __init__(
        self,
        path,
        *,
        ram_bytes: int,
        disk_bytes: int,
        page_tokens: int = 256,
        salt: bytes | str | None = None,
        compress: bool = False,
        create: bool = True,
        max_readers: int = 126,
        remote: RemoteTier | None = None,
    ):
        self.path = os.fspath(path)
        self.page_tokens = int(page_tokens)  # for key derivation by callers; the store itself is key-agnostic
        self.salt = salt
        self.compress = compress
        self._lock = threading.RLock()  # one operation at a time per handle
        self._disk = DiskTier(self.path, disk_bytes=disk_bytes, compress=compress, create=create, max_readers=max_readers)
        self._ram = RamTier(ram_bytes, self._suspend)
        self._disk.pinned = self._pinned
        # Since this handle opened. A prefill through the prefix cache counts once
        # (hit if it resumed any tokens); a direct get() counts per record.
        self._hits = self._misses = self._hit_tokens = 0
        self._prefills = self._prefill_tokens = 0
        self._errors = 0  # store failures degraded to a miss or a skipped publish
        self._remote = remote
        # The node merges `merge_later` holds until `merging` ends (None: not merging), and the
        # thread that merges: only its calls wait, any other thread's run at once.
        self._held: list | None = None
        self._merging_thread: int | None = None
        self._tiers: tuple[Tier, ...] = (self._ram, self._disk) + ((remote,) if remote is not None else ())  # fastest first
        self._closed = False
        if remote is not None:
            remote.source = self._remote_source
        if create:  # inspection handles (create=False) do not know the writer's parameters
            try:
                self._check_params()
            except BaseException:
                self._disk.close()
                raise
        ref = weakref.ref(self)
        self._atexit = lambda: (s := ref()) is not None and s.close()
        atexit.register(self._atexit)  # a clean interpreter exit loses nothing

    def _check_params(self) -> None:
        mine = {"page_tokens": self.page_tokens, "salt": salt_digest(self.salt)}
        with _store_errors(self.path, "reading the store's parameters"):
            stored = self._disk.params(mine)
        if stored is not None and stored != mine:
            diff = [f"{k} {stored.get(k)!r} (now {mine[k]!r})" for k in mine if stored.get(k) != mine[k]]
            warnings.warn(
                f"segcache store: {self.path} was created with {', '.join(diff).replace('salt', 'a salt hash')}; "
                f"records keyed with the other parameters will not hit. Use the store's parameters or another directory.",
                StoreWarning,
                stacklevel=4,
            )

    # -- suspend to disk ----------------------------------------------------

    def _pinned(self) -> tuple[set[bytes], set[bytes]]:
        """What the disk must keep for records still only in RAM: the keys they extend, and their own."""
        dirty = self._ram.dirty_keys()
        return {r.parent for k in dirty if (r := self._ram.peek(k)) is not None and r.parent is not None}, dirty

    def _suspend(self, items: list[tuple[bytes, Record]]) -> set[bytes]:
        """Write records RAM evicts (or flushes) to disk; returns the keys now there. Never raises."""
        return self._disk.write(items)

    # -- public API ---------------------------------------------------------

    def put(self, key: bytes, record: Record) -> None:
        """Store a record under key in RAM (cheap); it reaches disk when evicted or at flush/close.

        Raises:
            StoreError: The key or record is malformed (nothing is stored), or the store is closed.
        """
        self.put_many([(key, record)])

    def put_many(self, items: Sequence[tuple[bytes, Record]]) -> None:
        """Store records that belong together (a checkpoint and the pages it needs) in RAM.

        They enter RAM at once, so an eviction sees the checkpoint that needs the
        pages, and they leave it (and reach the remote) parents first.

        Raises:
            StoreError: A key or record is malformed (nothing is stored), or the store is closed.
        """
        items = list(items)
        with self._lock:
            self._check_open()
            for key, record in items:
                _validate(key, record)
            mx.eval([a for _, record in items for a in record.arrays.values()])
            self._ram.put_many(items)
            if self._remote is not None:
                self._remote.put_many(items)

    def get(self, key: bytes, *, count: bool = True, expect: Expect | None = None) -> Record | None:
        """Return the record at key, or None. RAM first; a disk hit is promoted to RAM.

        Args:
            key: The record key.
            count: Count the lookup in `hits`/`misses`/`hit_tokens`. The prefix
                cache passes False and counts one hit or miss per prefill instead.
            expect: Array name -> (dtype name as in `codec.DTYPES`, shape). Every
                array of the record must be listed with exactly that dtype and shape
                (listed arrays may be absent: the caller checks presence). Checked
                on the stored header before anything is decompressed or allocated; a
                mismatch is a corrupt record (dropped, counted, warned) and a miss.
        """
        return self.get_many([key], expects=None if expect is None else [expect], count=count)[0]

    def get_many(self, keys: Sequence[bytes], *, expects: Sequence[Expect | None] | None = None, count: bool = False) -> list[Record | None]:
        """Return the records at keys (None where missing), reading disk in ONE transaction.

        RAM hits come from RAM; the rest are read and checked together (threads fill
        the arrays), then promoted to RAM. Validation is that of `get`.

        Args:
            keys: Record keys.
            expects: Per key, the layout of `get`'s ``expect``, or None.
            count: Count each lookup in `hits`/`misses` (default off: the prefix cache counts prefills).
        """
        found = self.find_many(keys, expects)
        out = [None if f is None else f.record for f in found]
        if count:
            with self._lock:
                for rec in out:
                    if rec is None:
                        self._misses += 1
                    else:
                        self._hits += 1
                        self._hit_tokens += rec.tokens
        return out

    def find_many(self, keys: Sequence[bytes], expects: Sequence[Expect | None] | None = None) -> list[Found | None]:
        """`get_many` that also says which tier served each record (nothing is counted as a hit).

        Asks the tiers fastest first, each for what the faster ones lacked (disk in
        one transaction, the remote in one round trip); what a slower tier serves is
        promoted to RAM (a remote record dirty: it reaches this host's disk too).
        """
        with self._lock:
            self._check_open()
            keys = list(keys)
            exp = list(expects) if expects is not None else [None] * len(keys)
            if len(exp) != len(keys):
                raise StoreError(f"get_many got {len(keys)} keys and {len(exp)} expects; pass one expect per key")
            out: list[Found | None] = [None] * len(keys)
            todo = list(range(len(keys)))
            with _store_errors(self.path, "reading"):
                for tier in self._tiers:
                    if not todo:
                        break
                    got = self._ask(tier, [keys[i] for i in todo], [exp[i] for i in todo])
                    for i, rec in zip(todo, got):
                        if rec is not None:
                            out[i] = Found(rec, tier.name)
                            if tier is not self._ram:
                                self._ram.put(keys[i], rec, dirty=tier is self._remote)
                    todo = [i for i in todo if out[i] is None]
            return out

    @staticmethod
    def _ask(tier: Tier, keys: list[bytes], expects: list[Expect | None]) -> list[Record | None]:
        return [tier.get(keys[0], expects[0])] if len(keys) == 1 else tier.get_many(keys, expects)

    def prefetch(self, keys: Sequence[bytes], expects: Sequence[Expect | None] | None = None) -> dict[bytes, Record]:
        """Bring the keys that neither local tier holds from the remote, in ONE round trip.

        What the remote returns is checked like a disk read (codec, CRCs, key, layout)
        and fills RAM; keys it lacks are not asked again for a moment, so the lookups
        that follow stay local. Without a remote this does nothing. Returns the
        records brought, by key.
        """
        with self._lock:
            self._check_open()
            if self._remote is None:
                return {}
            exp = list(expects) if expects is not None else [None] * len(keys)
            keys = list(keys)
            local = [k in self._ram for k in keys]
            ask = [k for k, held in zip(keys, local) if not held]
            with _store_errors(self.path, "reading"):
                on_disk = dict(zip(ask, self._disk.contains_many(ask))) if ask else {}
            todo = [(k, e) for k, e, held in zip(keys, exp, local) if not held and not on_disk[k]]
            got = self._remote.get_many([k for k, _ in todo], [e for _, e in todo])
            out = {}
            for (k, _), rec in zip(todo, got):
                if rec is not None:
                    self._ram.put(k, rec)  # dirty: it reaches this host's disk like a local record
                    out[k] = rec
            return out

    def _remote_source(self, key: bytes) -> bytes | None:
        """The value to send the remote late for key (the writer thread's catch-up), or None if gone.

        Never waits for a request: if one holds the store, raises Busy (tried later).
        A record still in RAM is encoded from RAM; one on disk is sent as stored.
        """
        if not self._lock.acquire(blocking=False):
            raise Busy
        try:
            if self._closed:
                return None
            rec = self._ram.peek(key)
            raw = self._disk.raw(key) if rec is None else None
        except (lmdb.Error, StoreError):
            return None
        finally:
            self._lock.release()
        if rec is None:
            return raw
        try:
            return codec.encode(rec, key=key, compress=self.compress)
        except StoreError:
            return None

    def update(self, key: bytes, fn: Callable[[Record | None], Record | None]) -> Record | None:
        """Atomically replace the record at key by ``fn(current)``, across processes.

        Inside ONE LMDB write transaction: read the current disk value (authoritative,
        not the RAM copy; None if absent or corrupt), call fn, write its result. The
        result is then held in RAM, clean. A dirty RAM copy of key is written first.

        Args:
            key: The record key.
            fn: current -> new record, or None to leave the record as it is. It may be
                called more than once (each time on the then-current value), so it must
                not have other effects.

        Returns:
            The record now stored under key (fn's result, or the current one if fn
            returned None), or None if there is none.

        Raises:
            StoreError: The key or fn's record is malformed, the record exceeds the disk
                budget, or the write failed; the store is unchanged.
        """
        return self.update_many([(key, fn)])[0]

    def update_many(self, items: Sequence[tuple[bytes, Callable[[Record | None], Record | None]]]) -> list[Record | None]:
        """`update` of several keys in ONE LMDB write transaction: all of them, or none.

        Each fn sees its key's current disk value inside the transaction, exactly as
        `update`; a key listed twice sees the earlier fn's result. If any fn raises or
        returns a malformed record, or a value exceeds the disk budget, nothing is
        written (the exception propagates; malformed records raise StoreError). With a
        remote tier, each written key's merge is queued for it as `update` queues one.

        Returns:
            Per item, the record now stored under its key (None if there is none).
        """
        items = list(items)

        def checked(key: bytes, fn: Callable[[Record | None], Record | None]) -> Callable[[Record | None], Record | None]:
            def run(current: Record | None) -> Record | None:
                new = fn(current)
                if new is not None:
                    _validate(key, new)
                    mx.eval(list(new.arrays.values()))
                return new

            return run

        with self._lock:
            self._check_open()
            for key, _ in items:
                _validate(key, Record("", 0))
            if not items:
                return []
            dirty = [(k, rec) for k in dict.fromkeys(k for k, _ in items)
                     if self._ram.is_dirty(k) and (rec := self._ram.peek(k)) is not None]
            if dirty:  # ours and not on disk yet: disk must hold them before we read
                self._ram.mark_clean(self._suspend(dirty))
            runs = [(key, checked(key, fn)) for key, fn in items]
            what = f"update of {items[0][0].hex()[:16]}" + (f" and {len(items) - 1} more" if len(items) > 1 else "")
            with _store_errors(self.path, what):
                got = self._disk.update_many(runs, lambda key, r: codec.encode(r, key=key, compress=self.compress))
            out = []
            for (key, run), (rec, _) in zip(runs, got):
                if rec is None:
                    self._ram.pop(key)
                else:
                    self._ram.put(key, rec, dirty=False)
                    if self._remote is not None:
                        self._remote.update(key, run)  # the same merge, on the remote's value
                out.append(rec)
            return out

    def merge_later(self, items: Sequence[tuple[bytes, Callable[[Record | None], Record | None]]]) -> None:
        """`update_many` of `items` now, or inside `merging` (on its thread) at its end, in its one
        transaction. For read-modify-writes whose result the caller does not read (a publish's
        node merges): each fn still sees the then-current record. Raises as `update_many` does
        when run now."""
        if self._held is not None and self._merging_thread == threading.get_ident():
            for key, _ in items:
                _validate(key, Record("", 0))  # refused here, as update_many would
            self._held.extend(items)
        else:
            self.update_many(items)

    @contextlib.contextmanager
    def merging(self):
        """Hold this thread's `merge_later` calls and run them as ONE `update_many` (one LMDB write
        transaction) at the end: several prompts published in one step pay for one. A failed
        write is warned about and counted (`errors`), as a failed publish is; the records the
        publishes put stay in RAM. Nested: the outermost one writes."""
        if self._held is not None:
            yield
            return
        self._held, self._merging_thread = [], threading.get_ident()
        try:
            yield
        finally:
            held, self._held, self._merging_thread = self._held, None, None
            if held and not self.closed:
                try:
                    self.update_many(held)
                except Exception as exc:  # a cache: the publishes degrade, the requests go on
                    self.note_error()
                    warnings.warn(f"segcache prefix store: publish failed ({type(exc).__name__}: {exc}); "
                                  "continuing without it", StoreWarning, stacklevel=3)

    def note_prefill(self, tokens: int, hit_tokens: int) -> None:
        """Count one prefill of `tokens` tokens that resumed `hit_tokens` of them from the store."""
        with self._lock:
            self._prefills += 1
            self._prefill_tokens += tokens
            if hit_tokens > 0:
                self._hits += 1
                self._hit_tokens += hit_tokens
            else:
                self._misses += 1

    def note_error(self) -> None:
        """Count a store failure the prefix cache turned into a miss (or a skipped publish)."""
        with self._lock:
            self._errors += 1

    def contains(self, key: bytes) -> bool:
        """True if key is held in RAM or on disk (the disk record is not decoded)."""
        with self._lock:
            self._check_open()
            return key in self._ram or self._disk.contains(key)

    def __contains__(self, key: bytes) -> bool:
        return self.contains(key)

    def delete(self, key: bytes) -> bool:
        """Remove key from the local tiers (RAM and disk; the remote is shared); returns whether it was present."""
        with self._lock:
            self._check_open()
            with _store_errors(self.path, "delete"):
                on_disk = self._disk.delete(key)
            return self._ram.delete(key) or on_disk

    def flush(self) -> None:
        """Write every RAM record not yet on disk (they stay in RAM, now clean).

        A record that could not be written (warned about, counted in `dropped`)
        stays dirty: a record is clean only once it is on disk.
        """
        with self._lock:
            self._check_open()
            self._ram.mark_clean(self._suspend(self._ram.dirty()))
            try:
                self._disk.flush()
            except (lmdb.Error, StoreError) as e:
                warnings.warn(f"segcache store: last-use times not written to {self.path}: {e}", StoreWarning, stacklevel=2)

    def flush_some(self, max_bytes: int) -> tuple[int, int]:
        """`flush` about max_bytes of the oldest records not yet on disk, in one hold of the lock.

        For a writer thread beside the model's: the lock is held for one chunk, so a
        lookup or a publish waits at most that long. At least one record is written.

        Returns:
            (records now on disk, records still only in RAM).
        """
        with self._lock:
            self._check_open()
            dirty = self._ram.dirty()
            take, size = [], 0
            for key, rec in dirty:
                if take and size + rec.nbytes > max_bytes:
                    break
                take.append((key, rec))
                size += rec.nbytes
            written = self._suspend(take) if take else set()
            self._ram.mark_clean(written)
            if len(take) == len(dirty):
                try:
                    self._disk.flush()
                except (lmdb.Error, StoreError) as e:
                    warnings.warn(f"segcache store: last-use times not written to {self.path}: {e}", StoreWarning, stacklevel=2)
            return len(written), len(dirty) - len(written)

    def drain_remote(self, timeout: float = 5.0) -> bool:
        """Wait (at most timeout seconds) until queued write-throughs were sent or dropped.

        `flush` does not wait for the remote (the server's worker calls it when idle, and
        a slow remote must not hold it); `close` waits up to 5 s. True if the queue is empty.
        """
        return True if self._remote is None else self._remote.drain(timeout)

    def share(self, items: Sequence[tuple[bytes, dict]]) -> int:
        """Let RAM records hold a live runtime's views of the same bytes (`RamTier.share`);
        records on disk only are bytes already. Returns the records that now share."""
        with self._lock:
            return 0 if self._closed else self._ram.share(items)

    def evict_ram(self, target_bytes: int = 0) -> None:
        """Shrink the RAM tier to target_bytes, suspending what leaves (for memory pressure)."""
        with self._lock:
            self._check_open()
            self._ram.shrink(target_bytes)

    def stats(self) -> dict:
        """Counters since this handle opened, and sizes as they are now.

        ``hits``/``misses``/``hit_tokens`` count prefills through the prefix
        cache (one each; ``hit_tokens`` = tokens resumed instead of computed)
        plus direct counted ``get`` calls; ``prefills``/``prefill_tokens`` the
        prefills and their prompt tokens; ``errors`` store failures that a
        prefill or publish turned into a miss; then each tier's own counters
        (`tier.py`): ``ram_reads``/``disk_reads`` the records each tier served (a
        disk read is promoted to RAM), ``ram_evictions``/``disk_evictions``
        (``evictions`` both), ``ram_corrupt``/``disk_corrupt`` records dropped as
        damaged (``corrupt_dropped`` both), ``disk_dropped`` (``dropped``) writes
        given up; ``ram_bytes``/``disk_bytes`` and ``*_entries`` the sizes, ``entries``
        the records held in either; ``disk_page_bytes`` the pages the disk tier's
        records really take and ``disk_file_bytes`` the size of data.mdb (what
        ``disk_bytes`` the budget bounds).
        ``remote_reads``/``remote_writes`` the records the remote served and
        stored, ``remote_errors`` its failed round trips (down, slow, full),
        ``remote_dropped`` write-throughs given up for good (queue full, too large,
        backlog overflow, record gone before the remote came back; the record stays
        local), ``remote_backlog`` writes owed since an outage, sent once the remote
        answers again, ``remote_corrupt`` remote values that failed the checks (a
        miss, never served). All 0 without a remote.
        """
        with self._lock:
            self._check_open()
            with _store_errors(self.path, "stats"):
                return self._stats()

    def _stats(self) -> dict:
        st = {name: 0 for name in _REMOTE_STATS}
        for tier in self._tiers:
            st.update(tier.stats())
        ram_only = sum(1 for k in self._ram.keys() if self._ram.is_dirty(k) and not self._disk.contains(k))
        return st | {
            "hits": self._hits,
            "misses": self._misses,
            "hit_tokens": self._hit_tokens,
            "prefills": self._prefills,
            "prefill_tokens": self._prefill_tokens,
            "errors": self._errors,
            "evictions": st["ram_evictions"] + st["disk_evictions"],
            "corrupt_dropped": st["ram_corrupt"] + st["disk_corrupt"],
            "dropped": st["disk_dropped"],
            "entries": st["disk_entries"] + ram_only,
        }

    def remote_info(self) -> dict | None:
        """The remote's reachability, keys under this namespace, memory and eviction policy (None without one)."""
        with self._lock:
            self._check_open()
            return None if self._remote is None else self._remote.info()

    def entries(self) -> list[EntryInfo]:
        """Every stored key with tokens, bytes, kind and last use (disk entries and RAM-only ones)."""
        with self._lock:
            self._check_open()
            with _store_errors(self.path, "listing entries"):
                disk = self._disk.entries()
            out = [EntryInfo(e.key, e.tokens, e.nbytes, e.kind, e.last_use, "disk", e.parent) for e in disk]
            on_disk = {e.key for e in out}
            now = time.time()
            for k in self._ram.keys():
                if k not in on_disk:
                    r = self._ram.peek(k)
                    out.append(EntryInfo(k, r.tokens, r.nbytes, r.kind, now, "ram", r.parent))
            return out

    def verify(self) -> dict:
        """Flush, then check every disk record; bad ones are deleted, counted and warned. Returns a report."""
        with self._lock:
            self.flush()
            with _store_errors(self.path, "verify"):
                return self._disk.verify()

    def gc(self, max_bytes: int, *, file: bool = False) -> int:
        """Evict disk records until the disk tier holds <= max_bytes; returns the count.

        Every record nothing can resume from goes first, then whole units (a checkpoint
        with the pages only it needs; `units.py`), least useful per byte and oldest
        first, so no record is left without what it needs.
        Then, if data.mdb is larger than max_bytes and no other process has the store
        open, it is rewritten without its free pages (LMDB never shrinks it itself).

        Args:
            max_bytes: bytes of record values to keep at most.
            file: also evict until the pages the records take (LMDB's own count, more
                than their values) fit max_bytes, so the rewritten file does too.

        Raises:
            StoreError: max_bytes < 0 (nothing is evicted).
        """
        with self._lock:
            self._check_open()
            with _store_errors(self.path, "gc"):
                return self._disk.gc(max_bytes, pages=max_bytes if file else None)

    def check(self) -> None:
        """Raise InvariantError unless both tiers are consistent and within budget."""
        with self._lock:
            self._check_open()
            self._ram.check()
            self._disk.check()

    def close(self) -> None:
        """Suspend RAM records to disk and close; idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                dirty = self._ram.dirty()
                written = self._suspend(dirty)
                self._ram.mark_clean(written)
                if len(written) < len(dirty):
                    warnings.warn(f"segcache store: {len(dirty) - len(written)} records lost at close of {self.path}", StoreWarning, stacklevel=2)
            finally:
                self._closed = True
                if self._remote is not None:
                    self._remote.close()
                self._disk.close()
                atexit.unregister(self._atexit)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"prefix store at {self.path} is closed; open it again with open_store()")

    def __enter__(self) -> "PrefixStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PrefixStore({self.path!r}, ram={self._ram.used}/{self._ram.budget} B, closed={self._closed})"


def open_store(
    path,
    *,
    ram_bytes: int = 1 << 30,
    disk_bytes: int = 16 << 30,
    page_tokens: int = 256,
    salt: bytes | str | None = None,
    compress: bool = False,
    create: bool = True,
    max_readers: int = 126,
    remote: str | None = None,
    remote_timeout: float = 0.05,
    remote_ttl: float | None = None,
    remote_max_value: int = 64 << 20,
    remote_queue: int = 256,
    remote_namespace: bytes | str = b"segcache:1:",
    remote_backlog: int = 4096,
) -> PrefixStore:
    """Open (or create) the prefix store at path.

    The directory is created (mode 0700) if missing, and a store is created in it
    if it is empty. An existing directory's mode is never changed: if others may
    access it, a StoreWarning says so. A non-empty directory without a store, a
    directory of another user, and a damaged data.mdb (cut short, bad meta pages)
    are refused with a StoreError, as is a file system without free space. A store
    over ``disk_bytes`` (reopened with a smaller budget) is evicted down to it.
    ``page_tokens`` and a hash of ``salt`` are kept in the store; reopening with
    others warns (StoreWarning), since records keyed with them will not hit.

    Args:
        path: Directory of the store.
        ram_bytes: Budget of the RAM tier (array bytes).
        disk_bytes: Budget of the disk tier: of data.mdb's size (at least 1 MiB) and of the
            encoded records in it (docs/format.md, "Budgets and eviction").
        page_tokens: Tokens per KV page; part of key derivation.
        salt: Optional salt mixed into model identities (separates tenants).
        compress: Compress records with zstd where it saves >= 5%. Off by default:
            on KV it saves 8-30% of the bytes but makes resume 1.7-3x slower than
            raw records (bench/apc.py, docs/apc.md); turn it on when disk is scarce.
        create: Create the directory and the store if missing. False (inspection and
            maintenance) raises StoreError("no store at ...") instead, creates nothing,
            and skips the page_tokens/salt check.
        max_readers: LMDB reader slots (concurrent read transactions across processes).
        remote: Optional shared tier, ``redis://[:password@]host:port/db`` (``rediss://``
            for TLS), Redis or Valkey. Publishes are written through in the background;
            local misses ask it (checked like disk reads). Down or slow, it is skipped
            with backoff: a StoreWarning and the ``remote_*`` counters, never an error.
        remote_timeout: Seconds per remote round trip (a lookup waits at most this).
        remote_ttl: Optional expiry of remote records, in seconds.
        remote_max_value: Records larger than this many encoded bytes stay local.
        remote_queue: Records waiting for write-through; beyond it they stay local (remote_dropped).
        remote_namespace: Prefix of every remote key (separate deployments sharing a database).
        remote_backlog: Writes owed while the remote is down (keys, not records), sent once it
            answers again; the oldest beyond this many are given up (remote_dropped).

    Raises:
        StoreError: No usable store at path (see above), it is already open in this
            process, or LMDB failed; nothing was created or changed.
        StoreFormatError: The directory holds a store of another format version.
    """
    if ram_bytes < 0 or disk_bytes <= 0 or page_tokens <= 0 or max_readers <= 0:
        raise StoreError(f"need ram_bytes >= 0, disk_bytes > 0, page_tokens > 0, max_readers > 0; got {ram_bytes}, {disk_bytes}, {page_tokens}, {max_readers}")
    tier = None
    if remote:
        ns = remote_namespace.encode() if isinstance(remote_namespace, str) else bytes(remote_namespace)
        tier = RemoteTier(remote, timeout=remote_timeout, ttl=remote_ttl, max_value=remote_max_value, queue_size=remote_queue, namespace=ns,
                          backlog=remote_backlog, compress=compress)
    try:
        return PrefixStore(
            path, ram_bytes=ram_bytes, disk_bytes=disk_bytes, page_tokens=page_tokens, salt=salt, compress=compress,
            create=create, max_readers=max_readers, remote=tier,
        )
    except BaseException:
        if tier is not None:
            tier.close(0)
        raise
