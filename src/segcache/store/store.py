"""`PrefixStore`: the two tiers behind one key -> Record API.

RAM holds decoded records and takes writes without copying or compressing.
What RAM evicts, and everything still dirty at `flush`/`close`, is encoded
(compressed where it pays) and written to LMDB in a few large transactions.
A RAM miss reads disk and promotes the record to RAM.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import lmdb
import mlx.core as mx
import msgpack

from ..errors import StoreError
from . import codec
from .disk import MAX_KEY, DiskTier, Entry
from .ram import RamTier
from .record import Record

_BATCH_BYTES = 256 << 20  # encoded bytes per LMDB write transaction when suspending


@dataclass(frozen=True)
class EntryInfo:
    """One row of `PrefixStore.entries()`."""

    key: bytes
    tokens: int
    nbytes: int  # encoded bytes on disk, or array bytes for a record only in RAM
    kind: str
    last_use: float  # unix seconds (RAM-only records: time of listing)
    tier: str  # "disk" or "ram"


def _validate(key: bytes, record: Record) -> None:
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY:
        raise StoreError(f"store keys are 1..{MAX_KEY} bytes, got {type(key).__name__} of length {len(key) if isinstance(key, bytes) else '?'}")
    if not isinstance(record, Record):
        raise StoreError(f"put takes a segcache.store.Record, got {type(record).__name__}")
    if not isinstance(record.kind, str) or len(record.kind) > 64:
        raise StoreError(f"Record.kind must be a str of <= 64 chars, got {record.kind!r}")
    if not isinstance(record.tokens, int) or record.tokens < 0:
        raise StoreError(f"Record.tokens must be an int >= 0, got {record.tokens!r}")
    if not isinstance(record.cost, (int, float)) or not math.isfinite(record.cost) or record.cost < 0:
        raise StoreError(f"Record.cost must be finite seconds >= 0, got {record.cost!r}")
    for name, a in record.arrays.items():
        if not isinstance(name, str) or not isinstance(a, mx.array):
            raise StoreError(f"Record.arrays maps str -> mx.array; entry {name!r} is {type(a).__name__}")
        if a.dtype not in codec._NAME_OF:
            raise StoreError(f"array {name!r} has dtype {a.dtype}, which the store cannot keep; cast it first")
    try:
        msgpack.packb(record.meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise StoreError(f"Record.meta must be msgpack-able plain values ({e})") from e


class PrefixStore:
    """Key -> Record store with a RAM tier over an LMDB tier. Use `open_store` to create one."""

    def __init__(self, path, *, ram_bytes: int, disk_bytes: int, page_tokens: int = 256, salt: bytes | str | None = None, compress: bool = False):
        self.path = os.fspath(path)
        self.page_tokens = int(page_tokens)  # for key derivation by callers; the store itself is key-agnostic
        self.salt = salt
        self.compress = compress
        self._lock = threading.RLock()  # one operation at a time per handle
        self._disk = DiskTier(self.path, disk_bytes=disk_bytes, compress=compress)
        self._ram = RamTier(ram_bytes, self._suspend)
        # Since this handle opened. A prefill through the prefix cache counts once
        # (hit if it resumed any tokens); a direct get() counts per record.
        self._hits = self._misses = self._hit_tokens = 0
        self._prefills = self._prefill_tokens = 0
        self._errors = 0  # store failures degraded to a miss or a skipped publish
        self._ram_reads = 0  # records served from the RAM tier
        self._disk_reads = 0  # records read from disk (and promoted to RAM)
        self._closed = False
        ref = weakref.ref(self)
        self._atexit = lambda: (s := ref()) is not None and s.close()
        atexit.register(self._atexit)  # a clean interpreter exit loses nothing

    # -- suspend to disk ----------------------------------------------------

    def _suspend(self, items: list[tuple[bytes, Record]]) -> None:
        """Encode and write records in few transactions; failures drop records, never raise."""
        batch, size = [], 0
        now = time.time()
        for key, rec in items:
            try:
                value = codec.encode(rec, compress=self.compress)
            except StoreError as e:  # validated at put, so this is a bug or a changed array
                warnings.warn(f"segcache store: not suspending {key.hex()[:16]}: {e}", stacklevel=2)
                self._disk.dropped += 1
                continue
            batch.append((key, value, Entry(key, rec.tokens, len(value), rec.kind, now, float(rec.cost), now)))
            size += len(value)
            if size >= _BATCH_BYTES:
                self._write(batch)
                batch, size = [], 0
        if batch:
            self._write(batch)

    def _write(self, batch) -> None:
        try:
            self._disk.put_many(batch)
        except lmdb.Error as e:  # e.g. the file system is full: a cache may lose entries
            warnings.warn(f"segcache store: {len(batch)} records not written to {self.path}: {e}", stacklevel=3)
            self._disk.dropped += len(batch)

    # -- public API ---------------------------------------------------------

    def put(self, key: bytes, record: Record) -> None:
        """Store a record under key in RAM (cheap); it reaches disk when evicted or at flush/close.

        Raises:
            StoreError: The key or record is malformed (nothing is stored), or the store is closed.
        """
        with self._lock:
            self._check_open()
            _validate(key, record)
            mx.eval(list(record.arrays.values()))
            self._ram.put(key, record)

    def get_many(self, keys, *, expects=None) -> list:
        """TEMPORARY shim until the store branch lands: one get per key."""
        expects = expects or [None] * len(keys)
        return [self.get(k, count=False, expect=e) for k, e in zip(keys, expects)]

    def update(self, key: bytes, fn):
        """TEMPORARY shim until the store branch lands (not atomic across processes)."""
        rec = fn(self.get(key, count=False))
        if rec is not None:
            self.put(key, rec)
        return rec

    def get(self, key: bytes, *, count: bool = True, expect=None) -> Record | None:
        """Return the record at key, or None. RAM first; a disk hit is promoted to RAM.

        Args:
            key: The record key.
            count: Count the lookup in `hits`/`misses`/`hit_tokens`. The prefix
                cache passes False and counts one hit or miss per prefill instead.
        """
        with self._lock:
            self._check_open()
            rec = self._ram.get(key)
            if rec is not None:
                self._ram_reads += 1
            else:
                rec = self._disk.get(key)
                if rec is not None:
                    self._disk_reads += 1
                    self._ram.put(key, rec, dirty=False)
            if not count:
                return rec
            if rec is None:
                self._misses += 1
            else:
                self._hits += 1
                self._hit_tokens += rec.tokens
            return rec

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
        """Remove key from both tiers; returns whether it was present."""
        with self._lock:
            self._check_open()
            in_ram = self._ram.pop(key) is not None
            return self._disk.delete(key) or in_ram

    def flush(self) -> None:
        """Write every RAM record not yet on disk (they stay in RAM, now clean)."""
        with self._lock:
            self._check_open()
            dirty = self._ram.dirty()
            self._suspend(dirty)
            self._ram.mark_clean(k for k, _ in dirty)
            self._disk.flush()

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
        prefill or publish turned into a miss; ``ram_reads``/``disk_reads`` the
        records each tier served (a disk read is promoted to RAM).
        """
        with self._lock:
            self._check_open()
            ram_only = sum(1 for k in self._ram.keys() if self._ram.is_dirty(k) and not self._disk.contains(k))
            return {
                "hits": self._hits,
                "misses": self._misses,
                "hit_tokens": self._hit_tokens,
                "evictions": self._ram.evictions + self._disk.evictions,
                "ram_evictions": self._ram.evictions,
                "disk_evictions": self._disk.evictions,
                "prefills": self._prefills,
                "prefill_tokens": self._prefill_tokens,
                "errors": self._errors,
                "ram_reads": self._ram_reads,
                "disk_reads": self._disk_reads,
                "corrupt_dropped": self._disk.corrupt_dropped,
                "dropped": self._disk.dropped,
                "ram_bytes": self._ram.used,
                "ram_entries": len(self._ram),
                "disk_bytes": self._disk.used_bytes(),
                "disk_entries": self._disk.count(),
                "entries": self._disk.count() + ram_only,
            }

    def entries(self) -> list[EntryInfo]:
        """Every stored key with tokens, bytes, kind and last use (disk entries and RAM-only ones)."""
        with self._lock:
            self._check_open()
            out = [EntryInfo(e.key, e.tokens, e.nbytes, e.kind, e.last_use, "disk") for e in self._disk.entries()]
            on_disk = {e.key for e in out}
            now = time.time()
            for k in self._ram.keys():
                if k not in on_disk:
                    r = self._ram.get(k)
                    out.append(EntryInfo(k, r.tokens, r.nbytes, r.kind, now, "ram"))
            return out

    def verify(self) -> dict:
        """Flush, then decode every disk record; bad ones are deleted and counted. Returns a report."""
        with self._lock:
            self.flush()
            return self._disk.verify()

    def gc(self, max_bytes: int) -> int:
        """Evict oldest-least-useful disk records until the disk tier holds <= max_bytes."""
        with self._lock:
            self._check_open()
            return self._disk.gc(max_bytes)

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
                self._suspend(dirty)
                self._ram.mark_clean(k for k, _ in dirty)
            finally:
                self._closed = True
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
) -> PrefixStore:
    """Open (or create) the prefix store at path.

    Args:
        path: Directory of the store (created 0700).
        ram_bytes: Budget of the RAM tier (array bytes).
        disk_bytes: Budget of the disk tier (encoded bytes).
        page_tokens: Tokens per KV page; part of key derivation.
        salt: Optional salt mixed into model identities (separates tenants).
        compress: Compress records with zstd where it saves >= 5%. Off by default:
            on KV it saves 8-30% of the bytes but makes resume 1.7-3x slower than
            raw records (bench/apc.py, docs/apc.md); turn it on when disk is scarce.

    Raises:
        StoreFormatError: The directory holds a store of another format version.
    """
    if ram_bytes < 0 or disk_bytes <= 0 or page_tokens <= 0:
        raise StoreError(f"need ram_bytes >= 0, disk_bytes > 0, page_tokens > 0; got {ram_bytes}, {disk_bytes}, {page_tokens}")
    return PrefixStore(path, ram_bytes=ram_bytes, disk_bytes=disk_bytes, page_tokens=page_tokens, salt=salt, compress=compress)
