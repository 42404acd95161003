"""The remote tier: one Redis / Valkey shared by the prefix stores of several hosts.

The remote is an accelerator, never a dependency:

* reads are one pipelined round trip (MGET) per call, bounded by a short socket
  timeout (``timeout``, 50 ms by default); a failure marks the remote down for a
  backoff (0.25 s doubling to ``backoff_max``) during which reads and writes skip
  it without any network call, so a dead or slow remote costs at most one timeout
  per backoff window, and the store keeps serving from its local tiers;
* writes go through a bounded queue to one background thread (never the caller's);
  a full queue or a value over ``max_value`` drops the write (the record stays
  local) and counts it in ``dropped``;
* a write due while the remote is down or failing is noted in a bounded backlog
  (the key only, or a node's merge): once the remote answers again, the writer
  thread re-reads those records from the local tiers (``source``) and sends them,
  oldest first, when no fresh write waits. What overflows the backlog, or has
  left the local tiers by then, is dropped and counted;
* values are the codec's records, byte for byte what LMDB holds, checked
  (codec, CRCs, key in the header, the caller's layout) before anything is
  served; a value that fails is a miss, counted in ``corrupt`` and deleted from
  the remote so no host pays for it again;
* a key the remote just lacked is not asked again for a second (one prefill's
  reads then stay local).

It answers the tiers' interface (`tier.py`) with records; `get_values` and
`stream` are the byte-level reads below it. Keys are the store's
content-chained keys under ``namespace``. One warning per outage
(StoreWarning), not one per request.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
import time
import warnings
from typing import Callable, Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import mlx.core as mx

from ..errors import StoreError, StoreWarning
from . import codec
from .codec import Expect
from .record import Record

DEFAULT_TIMEOUT = 0.05  # seconds per round trip (the per-lookup budget)
DEFAULT_MAX_VALUE = 64 << 20  # bytes; larger records stay local
DEFAULT_QUEUE = 256  # records waiting for write-through
DEFAULT_BACKLOG = 4096  # keys noted while the remote was down, sent once it is back
DEFAULT_NAMESPACE = b"segcache:1:"  # the "1" follows the codec's key scheme; bump it to start afresh
_BACKOFF_MIN = 0.25
_WRITE_BATCH = 32  # records per write pipeline
_WATCH_RETRIES = 4  # optimistic merges of one node before the update is dropped
_MERGES_PER_KEY = 16  # node merges kept per key in the backlog (beyond: dropped)
_ABSENT_SECONDS = 1.0  # a key the remote just lacked is not asked again for this long (one prefill)
_ABSENT_MAX = 8192
_RECV = 16 << 10  # bytes per read of reply headers: what it takes past a header is copied once more (values go straight to their buffer)


def redact(url: str) -> str:
    """The URL without its password (for messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username + ':' if parts.username else ':'}***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class RemoteTier:
    """Bytes under namespaced keys in Redis / Valkey, with backoff and background writes.

    Counters (since open): ``reads`` values returned, ``writes`` values stored,
    ``errors`` failed round trips (down, timeout, full, refused), ``dropped``
    writes given up (queue full, too large, remote down or failing), ``corrupt``
    values that failed the record checks.

    Invariant: ``_down_until[path] > now`` exactly while that path ("read" or "write")
    backs off; during that time no call of that path reaches the network.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        ttl: float | None = None,
        max_value: int = DEFAULT_MAX_VALUE,
        queue_size: int = DEFAULT_QUEUE,
        namespace: bytes = DEFAULT_NAMESPACE,
        backoff_max: float = 30.0,
        backlog: int = DEFAULT_BACKLOG,
        compress: bool = False,
    ):
        try:
            import redis
        except ImportError:
            raise StoreError("remote prefix cache needs redis-py: pip install 'redis>=5' (or drop remote=)") from None
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise StoreError(f"remote={redact(url)!r}: expected redis://[:password@]host:port/db or rediss:// (TLS)")
        if timeout <= 0 or max_value <= 0 or queue_size <= 0 or backlog < 0 or (ttl is not None and ttl <= 0):
            raise StoreError(f"remote needs timeout > 0, max_value > 0, queue_size > 0, backlog >= 0 and ttl None or > 0; "
                             f"got {timeout}, {max_value}, {queue_size}, {backlog}, {ttl}")
        self._redis = redis
        self.url = redact(url)
        self.timeout, self.ttl, self.max_value = float(timeout), ttl, int(max_value)
        self.namespace = bytes(namespace)
        self.backoff_max = float(backoff_max)
        self._client = redis.Redis.from_url(  # lookups: a request waits on these
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False, health_check_interval=0,
        )
        # Writes run on the writer thread, which no request waits for: a slower remote
        # still takes them, and a slow lookup does not cost the writes (nor the reverse).
        wt = max(1.0, 20 * timeout)
        self._wclient = redis.Redis.from_url(
            url, socket_timeout=wt, socket_connect_timeout=wt, retry_on_timeout=False, health_check_interval=0,
        )
        self._lock = threading.Lock()  # counters and backoff state
        self.reads = self.writes = self.errors = self.dropped = self.corrupt = 0
        self.compress = compress  # records this tier encodes (put, update) use zstd where it pays
        self._absent: dict[bytes, float] = {}  # key -> monotonic time the remote lacked it (lookups only)
        self._corrupt_warned = False  # one warning for rejected values, then only the counter
        self._down_until = {"read": 0.0, "write": 0.0}  # per path: reads and writes back off apart
        self._backoff = {"read": 0.0, "write": 0.0}
        self._warned = False  # one warning per outage
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        # Writes owed since an outage, oldest first: key -> [] (a put: the value is re-read
        # from `source` when sent) or [merge fns] (a node's updates, re-applied in order).
        # Invariant: len(_backlog) <= backlog_max; every entry dropped from it counted in dropped.
        self._backlog: OrderedDict[bytes, list] = OrderedDict()
        self.backlog_max = int(backlog)
        self.caught_up = 0  # backlog writes sent late
        self._taken = 0  # backlog keys the writer took out and is sending (still owed until sent)
        self._scratch = bytearray()  # stream(reuse=True)'s value buffer (lookups run one at a time per store)
        # key -> the value to send now, None if the record left the local tiers, or raises Busy
        # (try later). Set by the store; runs on the writer thread.
        self.source: Callable[[bytes], bytes | None] | None = None
        self._closed = False
        self._stop = threading.Event()
        self._warm()
        self._worker = threading.Thread(target=self._run, name="segcache-remote", daemon=True)
        self._worker.start()

    # -- health --

    def _ok(self, path: str = "read") -> bool:
        return time.monotonic() >= self._down_until[path]

    def _failed(self, what: str, exc: BaseException, path: str = "read") -> None:
        with self._lock:
            self.errors += 1
            self._backoff[path] = min(self.backoff_max, max(_BACKOFF_MIN, self._backoff[path] * 2))
            self._down_until[path] = time.monotonic() + self._backoff[path]
            warn, self._warned = not self._warned, True
        if warn:
            warnings.warn(
                f"segcache store: remote {self.url} failed on {what} ({type(exc).__name__}: {exc}); serving from the local "
                f"tiers and retrying with backoff (up to {self.backoff_max:g} s); see remote_errors in stats",
                StoreWarning, stacklevel=4,
            )

    def _succeeded(self, path: str = "read") -> None:
        if self._backoff[path]:
            with self._lock:
                self._backoff[path] = 0.0
                self._warned = any(self._backoff.values())

    @property
    def up(self) -> bool:
        """False while backing off after a failure."""
        return self._ok()

    # -- records (the tiers' interface) --

    name = "remote"

    def get(self, key: bytes, expect: Expect | None = None) -> Record | None:
        return self.get_many([key], [expect])[0]

    def get_many(self, keys: Sequence[bytes], expects: Sequence[Expect | None] | None = None) -> list[Record | None]:
        """The records at keys from ONE round trip, each checked as a disk read is (None where absent or bad).

        Each value is checked and decoded as it arrives, while the next ones are on
        the wire. Keys the remote lacked within the last second are not asked again.
        """
        exp = list(expects) if expects is not None else [None] * len(keys)
        now = time.monotonic()
        ask = [i for i, k in enumerate(keys) if now - self._absent.get(k, -1e9) > _ABSENT_SECONDS]
        out: list[Record | None] = [None] * len(keys)
        if not ask:
            return out
        answered = set()
        for i, v in self.stream([keys[i] for i in ask], reuse=True):  # v: valid until the next value
            i = ask[i]
            answered.add(i)
            rec = codec.decode_many([(v, keys[i], exp[i])])[0]
            if isinstance(rec, Exception):
                self._rejected(keys[i], rec)
            else:
                out[i] = rec
        if len(self._absent) > _ABSENT_MAX:
            self._absent.clear()
        if self.up:  # an answer, not a failure: what it lacked is not asked again for a moment
            for i in ask:
                if i not in answered:
                    self._absent[keys[i]] = now
        return out

    def _rejected(self, key: bytes, err: Exception) -> None:
        with self._lock:
            self.corrupt += 1
            warn, self._corrupt_warned = not self._corrupt_warned, True
        if warn:
            warnings.warn(f"segcache store: remote record {key.hex()[:16]} rejected ({err}); treated as a miss and "
                          f"deleted (further rejects only counted in remote_corrupt)", StoreWarning, stacklevel=5)
        self.delete(key)

    def put(self, key: bytes, record: Record) -> None:
        """Queue a write-through of record (encoded on the writer thread; dropped and counted if the queue is full)."""
        mx.eval(list(record.arrays.values()))  # MLX evaluates on the caller's stream, never on the writer thread
        self._absent.pop(key, None)
        compress = self.compress
        self._offer(("put", key, lambda: codec.encode(record, key=key, compress=compress)))

    def put_many(self, items: Sequence[tuple[bytes, Record]]) -> None:
        """Queue the write-throughs of records that belong together (a checkpoint and the pages it
        needs), in order, parents first: all of them, or none (counted dropped) if the queue lacks
        room. A checkpoint sent without its pages would only cost the remote memory."""
        if len(items) > 1 and not self._closed and self._ok("write") and self._queue.maxsize - self._queue.qsize() < len(items):
            self._count_dropped(len(items))
            return
        for key, record in items:
            self.put(key, record)

    def update(self, key: bytes, fn: Callable[[Record | None], Record | None]) -> None:
        """Queue ``fn`` over the record at key, merged atomically on the remote (WATCH/MULTI).

        The same merge the disk tier runs in its transaction: hosts extending one
        node at once keep each other's changes; a value that fails the checks counts
        as absent and is rewritten whole.
        """
        compress = self.compress

        def on_bytes(value: bytes | None) -> bytes | None:
            current = None
            if value is not None:
                r = codec.decode_many([(value, key, None)])[0]
                current = None if isinstance(r, Exception) else r
            new = fn(current)
            return None if new is None else codec.encode(new, key=key, compress=compress)

        self.merge(key, on_bytes)

    def delete(self, key: bytes) -> bool:
        """Queue a delete of key (skipped while the remote backs off); False: not known to be there."""
        if not self._closed and self._ok("write"):
            try:
                self._queue.put_nowait(("del", key, None))
            except queue.Full:
                pass  # a cache: the value stays until overwritten or expired
        return False

    # -- bytes --

    def get_values(self, keys: Sequence[bytes]) -> list[bytes | bytearray | None]:
        """The values at keys in ONE round trip (None where absent); all None if the remote is down."""
        out: list[bytes | bytearray | None] = [None] * len(keys)
        for i, v in self.stream(keys):
            out[i] = v
        return out

    def stream(self, keys: Sequence[bytes], *, reuse: bool = False) -> Iterator[tuple[int, bytearray | memoryview]]:
        """(index, value) for each key the remote holds, as each value arrives, from ONE MGET.

        The caller checks value i while later values are still on the wire (the
        server keeps writing into the socket buffer meanwhile), and each value is
        received straight into a buffer of its own (or the reused one): one copy,
        where a parsed reply takes three. Nothing is yielded while the remote backs off. A failure part way
        (timeout, reset, a malformed reply) ends the stream: what came before stands,
        the rest is a miss, and the remote backs off. Values over ``max_value`` are
        skipped (read and discarded, so the connection stays in step).

        With reuse, every value is received into one buffer kept by this tier and
        yielded as a memoryview that is valid only until the next item: for a
        caller that copies each value out at once (no fresh pages per value).
        """
        if not keys or not self._ok():
            return
        pool = self._client.connection_pool
        try:
            conn = _connection(pool)
        except self._redis.RedisError as e:
            self._failed("a lookup", e)
            return
        done, n, reply = False, 0, None
        try:
            try:
                conn.send_command("MGET", *[self.namespace + k for k in keys])
                reply = _Reply(conn._sock, self._redis, self._scratch if reuse else None)
                for i, v in reply.values(len(keys), self.max_value):
                    n += 1
                    yield i, v
                done = True
            except (self._redis.RedisError, OSError, ValueError) as e:
                if isinstance(e, TimeoutError):  # socket.timeout is TimeoutError
                    e = self._redis.TimeoutError(f"no reply within {self.timeout:g} s")
                self._failed("a lookup", e)
                return
            self._succeeded()
        finally:
            if reuse and reply is not None:
                self._scratch = reply.reused
            with self._lock:
                self.reads += n
            if not done:  # stopped part way (failure, or the caller left): the reply's rest would desync the connection
                conn.disconnect()
            pool.release(conn)

    # -- writes (background) --

    def merge(self, key: bytes, fn: Callable[[bytes | None], bytes | None]) -> bool:
        """Queue ``value = fn(current value)`` under key, atomically (WATCH/MULTI); False if dropped."""
        return self._offer(("merge", key, fn))

    def _offer(self, item) -> bool:
        if self._closed:
            self._count_dropped(1)
            return False
        if not self._ok("write"):
            self._defer([item])
            return False
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self._count_dropped(1)
            return False

    def _count_dropped(self, n: int) -> None:
        with self._lock:
            self.dropped += n

    def _defer(self, items, front: bool = False) -> None:
        """Note writes owed to the remote: (op, key, arg) items; the oldest beyond the bound are dropped.

        With front (the catch-up returning what it could not send), also ends the catch-up's round.
        """
        with self._lock:
            if front:
                self._taken = 0
            for op, key, arg in items:
                entry = self._backlog.setdefault(key, [])
                if op == "merge":
                    if len(entry) >= _MERGES_PER_KEY:
                        self.dropped += 1
                    elif front:
                        entry.insert(0, arg)
                    else:
                        entry.append(arg)
                self._backlog.move_to_end(key, last=not front)
            while len(self._backlog) > self.backlog_max:
                _, entry = self._backlog.popitem(last=False)
                self.dropped += max(1, len(entry))

    def _warm(self) -> None:
        """Connect the lookup pool (at most ``timeout``): a new host's first prefill would pay it.

        Run at open, on the opener's thread, so the first lookup never races a
        connect in progress. A failure is silent here; the first lookup finds out,
        warns and backs off.
        """
        pool = self._client.connection_pool
        try:
            conn = _connection(pool)
        except self._redis.RedisError:
            return  # the first lookup finds out, warns and backs off
        pool.release(conn)

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                batch = [self._queue.get(timeout=0.05)]
            except queue.Empty:
                if self._backlog and not self._stop.is_set():
                    try:
                        self._catch_up()
                    except Exception as e:  # as below: never let the writer die
                        with self._lock:  # that round's keys are given up
                            self.dropped, self._taken = self.dropped + self._taken, 0
                        warnings.warn(f"segcache store: remote catch-up failed: {type(e).__name__}: {e}", StoreWarning, stacklevel=2)
                continue
            while len(batch) < _WRITE_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except Exception as e:  # never let the writer die: a cache loses writes, nothing else
                self._count_dropped(len(batch))
                warnings.warn(f"segcache store: remote write failed: {type(e).__name__}: {e}", StoreWarning, stacklevel=2)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, batch: list) -> None:
        dels = [key for op, key, _ in batch if op == "del"]
        batch = [item for item in batch if item[0] != "del"]
        if not self._ok("write"):
            self._defer(batch)
            return
        if dels:
            self._send([], dels)
        puts = []
        for op, key, arg in batch:
            if op == "merge":
                if not self._merge(key, arg):
                    self._defer([(op, key, arg)])
                continue
            try:
                value = arg()
            except StoreError:
                self._count_dropped(1)
                continue
            if len(value) > self.max_value:
                self._count_dropped(1)
            else:
                puts.append((key, value))
        if puts and not self._send(puts):
            self._defer([("put", key, None) for key, _ in puts])

    def _send(self, puts: list[tuple[bytes, bytes]], dels: Sequence[bytes] = ()) -> bool:
        """SET each (key, value) (and DEL each of dels) in one pipeline; False (backing off) if the remote failed."""
        if not self._ok("write"):
            return False
        try:
            pipe = self._wclient.pipeline(transaction=False)
            for key, value in puts:
                pipe.set(self.namespace + key, value, ex=self._ex())
            if dels:
                pipe.delete(*[self.namespace + k for k in dels])
            pipe.execute()
        except self._redis.RedisError as e:  # OOM under noeviction, down, timeout
            self._failed("a write", e, "write")
            return False
        self._succeeded("write")
        with self._lock:
            self.writes += len(puts)
        return True

    def _catch_up(self) -> None:
        """Send up to one batch of the backlog, oldest first, if the remote is not backing off.

        Puts are re-read from the local tiers (`source`); a record gone from them is
        dropped. Whatever cannot be sent now goes back to the front, in order.
        """
        if not self._ok("write") or self.source is None:
            return
        with self._lock:
            take = []
            while self._backlog and len(take) < _WRITE_BATCH:
                take.append(self._backlog.popitem(last=False))
            self._taken = len(take)
        back: list = []  # (op, key, arg), in backlog order
        puts, put_keys = [], []
        for key, fns in take:
            if back:
                back += [("merge", key, f) for f in fns] if fns else [("put", key, None)]
                continue
            if not fns:
                try:
                    value = self.source(key)
                except Busy:  # the store is in use: later
                    back.append(("put", key, None))
                    continue
                if value is None or len(value) > self.max_value:
                    self._count_dropped(1)
                else:
                    puts.append((key, value))
                    put_keys.append(key)
                continue
            for i, fn in enumerate(fns):
                if not self._merge(key, fn):
                    back += [("merge", key, f) for f in fns[i:]]
                    break
                with self._lock:
                    self.caught_up += 1
        if puts:
            if self._send(puts):
                with self._lock:
                    self.caught_up += len(puts)
            else:
                back = [("put", k, None) for k in put_keys] + back
        self._defer(back[::-1], front=True)

    def _ex(self) -> int | None:
        return None if self.ttl is None else max(1, int(round(self.ttl)))

    def _merge(self, key: bytes, fn: Callable[[bytes | None], bytes | None]) -> bool:
        """Apply fn to the remote value under key; False (backing off) if the remote failed.

        A merge that ends without a write (fn declines, the result is too large,
        other hosts kept changing the node) still returns True: there is nothing to
        send again.
        """
        if not self._ok("write"):
            return False
        name = self.namespace + key
        try:
            with self._wclient.pipeline(transaction=True) as pipe:
                for _ in range(_WATCH_RETRIES):
                    try:
                        pipe.watch(name)
                        cur = pipe.get(name)
                        new = fn(cur if isinstance(cur, bytes) else None)
                        if new is None or len(new) > self.max_value:
                            pipe.unwatch()
                            self._count_dropped(new is not None)
                            return True
                        pipe.multi()
                        pipe.set(name, new, ex=self._ex())
                        pipe.execute()
                        break
                    except self._redis.WatchError:
                        continue  # another host changed the node: merge again on its value
                else:
                    self._count_dropped(1)  # a lost continuation only loses a hint
                    return True
        except self._redis.RedisError as e:
            self._failed("a node merge", e, "write")
            return False
        self._succeeded("write")
        with self._lock:
            self.writes += 1
        return True

    def drain(self, timeout: float = 5.0, *, backlog: bool = True) -> bool:
        """Wait (at most timeout seconds) until every queued write was sent or dropped and, if
        backlog, the backlog too unless the remote is backing off (it waits for the remote)."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks or (backlog and (self._backlog or self._taken) and self._ok("write") and self.source is not None):
            if time.monotonic() >= end or not self._worker.is_alive():
                return False
            time.sleep(0.002)
        return True

    def info(self) -> dict:
        """One probe: reachable, keys under the namespace (bounded scan), used/max memory, policy."""
        try:
            mem = self._client.info("memory")
            n = 0
            for n, _ in enumerate(self._client.scan_iter(match=self.namespace + b"*", count=1000), 1):
                if n >= 100_000:
                    break
        except self._redis.RedisError as e:
            self._failed("a probe", e)
            return {"reachable": False, "error": f"{type(e).__name__}: {e}"}
        self._succeeded()
        return {"reachable": True, "keys": n, "used_memory": mem.get("used_memory_human"),
                "maxmemory": mem.get("maxmemory_human"), "maxmemory_policy": mem.get("maxmemory_policy")}

    def stats(self) -> dict:
        with self._lock:
            return {"remote_reads": self.reads, "remote_writes": self.writes, "remote_errors": self.errors,
                    "remote_dropped": self.dropped, "remote_corrupt": self.corrupt, "remote_queued": self._queue.qsize(),
                    "remote_backlog": len(self._backlog) + self._taken, "remote_caught_up": self.caught_up}

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (bounded by timeout), stop the writer, close connections; idempotent."""
        if self._closed:
            return
        self.drain(timeout, backlog=False)  # the store is closing: its records cannot be re-read
        self._closed = True
        self._stop.set()
        self._worker.join(timeout)
        with self._lock:  # owed writes this process can no longer send
            self.dropped += sum(max(1, len(e)) for e in self._backlog.values())
            self._backlog.clear()
        for c in (self._client, self._wclient):
            try:
                c.close()
            except Exception:
                pass


class Busy(Exception):
    """Raised by a `RemoteTier.source` that cannot read now (the store is in use); tried again later."""


def _connection(pool):
    """A connected connection from a redis-py pool (the caller releases it)."""
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 wants a command name
        return pool.get_connection("MGET")


class _Reply:
    """An MGET reply read off the socket value by value (RESP2, and RESP3's null).

    Replies are ``*N`` then per key ``$len`` + bytes + CRLF, or ``$-1`` (``_`` in
    RESP3) for a missing key; an error reply (``-ERR ...``) raises ResponseError.
    """

    def __init__(self, sock, redis_mod, reused: bytearray | None = None):
        if sock is None:
            raise redis_mod.ConnectionError("connection closed")
        self.sock, self.redis = sock, redis_mod
        self.buf, self.pos = bytearray(), 0  # bytes received but not parsed: buf[pos:]
        self.scratch = bytearray(_RECV)
        self.reuse = reused is not None
        self.reused = reused if reused is not None else bytearray()  # the one value buffer, grown as needed

    def _fill(self) -> None:
        n = self.sock.recv_into(self.scratch)
        if n == 0:
            raise self.redis.ConnectionError("the remote closed the connection mid-reply")
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        self.buf += memoryview(self.scratch)[:n]

    def _line(self) -> bytes:
        while True:
            j = self.buf.find(b"\r\n", self.pos)
            if j >= 0:
                out = bytes(self.buf[self.pos : j])
                self.pos = j + 2
                return out
            if len(self.buf) - self.pos > 1024:
                raise self.redis.DataError("malformed reply: no line end within 1 KiB")
            self._fill()

    def _read(self, n: int, keep: bool) -> bytearray | memoryview | None:
        """The next n bytes (into a fresh buffer, or the reused one, if keep; else discarded), then the CRLF after them."""
        out = None
        if keep and self.reuse:
            if len(self.reused) < n:
                self.reused = bytearray(n)
            out = memoryview(self.reused)[:n]
        elif keep:
            out = bytearray(n)
        have = min(n, len(self.buf) - self.pos)
        if keep:
            out[:have] = memoryview(self.buf)[self.pos : self.pos + have]
        self.pos += have
        got, mv = have, memoryview(out) if keep else None
        while got < n:
            m = self.sock.recv_into(mv[got:], n - got) if keep else self.sock.recv_into(self.scratch, min(n - got, _RECV))
            if m == 0:
                raise self.redis.ConnectionError("the remote closed the connection mid-value")
            got += m
        if self._line() != b"":
            raise self.redis.DataError("malformed reply: a value is not followed by CRLF")
        return out

    def values(self, n: int, max_value: int) -> Iterator[tuple[int, bytearray]]:
        head = self._line()
        if head[:1] == b"-":
            raise self.redis.ResponseError(head[1:].decode("utf-8", "replace"))
        if head != b"*%d" % n:
            raise self.redis.DataError(f"malformed reply to MGET of {n} keys: {head[:32]!r}")
        for i in range(n):
            line = self._line()
            if line in (b"$-1", b"_"):
                continue
            if line[:1] != b"$" or not line[1:].isdigit():
                raise self.redis.DataError(f"malformed reply to MGET: {line[:32]!r}")
            size = int(line[1:])
            v = self._read(size, keep=size <= max_value)
            if v is not None:
                yield i, v
