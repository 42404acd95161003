"""Read-modify-write across processes (update), and writes that fail are never reported as done."""

import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import multiprocessing as mp
import time
import warnings

import lmdb
import mlx.core as mx
import pytest

from segcache.errors import StoreError, StoreWarning
from segcache.store import Record, open_store
from segcache.store.ram import footprint

NODE = b"node"
PER_PROC = 20


def append(item: str):
    def fn(current: Record | None) -> Record:
        items = list(current.meta["items"]) if current is not None else []
        time.sleep(0.002)  # a slow caller widens the window a non-atomic update would lose items in
        return Record("node", 0, {}, {"items": items + [item]}, cost=0.1)

    return fn


def _worker(path: str, who: int, start) -> None:
    with open_store(path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        start.wait(timeout=120)  # every process opened its store: they all go at once
        for i in range(PER_PROC):
            s.update(NODE, append(f"{who}:{i}"))


def test_four_processes_appending_to_one_node_lose_nothing(tmp_path):
    open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26).close()
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(5)  # the four workers and this process
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), who, start)) for who in range(4)]
    for p in procs:
        p.start()
    start.wait(timeout=120)
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        items = s.get(NODE).meta["items"]
    want = {f"{w}:{i}" for w in range(4) for i in range(PER_PROC)}
    assert len(items) == len(want) and set(items) == want, f"{len(want - set(items))} items lost"


def test_update_semantics(tmp_path):
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        assert s.update(b"n", lambda cur: None) is None and not s.contains(b"n")
        a = s.update(b"n", append("a"))
        assert a.meta["items"] == ["a"] and s._disk.contains(b"n") and not s._ram.is_dirty(b"n")
        assert s.update(b"n", lambda cur: None).meta["items"] == ["a"]  # None leaves it
        s.put(b"n", Record("node", 0, {}, {"items": ["dirty"]}))  # ours, only in RAM
        assert s.update(b"n", append("b")).meta["items"] == ["dirty", "b"]  # written first, then read from disk

        def boom(cur):
            raise ValueError("caller failed")

        with pytest.raises(ValueError):
            s.update(b"n", boom)
        with pytest.raises(StoreError):
            s.update(b"n", lambda cur: Record("node", -1))  # malformed: nothing written
        s.evict_ram(0)
        assert s.get(b"n").meta["items"] == ["dirty", "b"]
        s.check()


# -- defect 5: a record is clean only once it is on disk


def test_a_failed_flush_leaves_records_dirty_and_a_later_flush_writes_them(tmp_path, monkeypatch):
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 26) as s:
        s.put(b"a", Record("kv", 1, {"x": mx.arange(100)}))

        def broken(*a, **k):
            raise lmdb.DiskError("simulated: no space left on device")

        monkeypatch.setattr(s._disk, "put_many", broken)
        with pytest.warns(StoreWarning, match="not written"):
            s.flush()
        assert s._ram.is_dirty(b"a")
        monkeypatch.undo()
        s.flush()
        assert not s._ram.is_dirty(b"a") and s._disk.contains(b"a")
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        assert s.get(b"a") is not None


def test_a_write_path_store_error_never_escapes_put_after_the_insert(tmp_path, monkeypatch):
    one = Record("kv", 1, {"x": mx.arange(1000, dtype=mx.float32)})
    with open_store(tmp_path, ram_bytes=2 * footprint(b"k0", one), disk_bytes=1 << 26) as s:

        def broken(*a, **k):
            raise StoreError("simulated write failure")

        monkeypatch.setattr(s._disk, "put_many", broken)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for i in range(5):  # RAM holds 2: every put past that suspends, and the suspend fails
                s.put(b"k%d" % i, Record("kv", 1, {"x": mx.arange(1000, dtype=mx.float32) + i}))
        assert any(issubclass(x.category, StoreWarning) for x in w)
        s.check()
        assert s.get(b"k4") is not None and s.stats()["dropped"] >= 3
        monkeypatch.undo()
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        assert {e.key for e in s.entries()} == {b"k3", b"k4"}  # the two RAM held, written at close
