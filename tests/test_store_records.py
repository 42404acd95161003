"""What the store serves: a record only under its own key and layout, bounded work on hostile sizes,
leaves-first eviction, robust cost ordering, and get_many."""

import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import struct
import tracemalloc
import warnings
import zlib

import mlx.core as mx
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from segcache.errors import StoreWarning
from segcache.store import Record, codec, open_store
from segcache.store.codec import PREAMBLE_SIZE, CorruptRecordError


def rec(i: int, n: int = 16, cost: float = 0.5, parent=None) -> Record:
    rng = np.random.default_rng(i)
    k = mx.array(rng.standard_normal((2, n, 8)).astype(np.float32)).astype(mx.bfloat16)
    return Record("kv", n, {"k": k, "v": -k}, {"i": i}, cost=cost, parent=parent)


def layout(r: Record) -> dict:
    return {name: (codec._NAME_OF[a.dtype], tuple(a.shape)) for name, a in r.arrays.items()}


def raw_put(s, key: bytes, value: bytes) -> None:
    """Write a value under key the way a bad restore or a misplaced write would (index kept consistent)."""
    from segcache.store.disk import Entry

    s.flush()
    e = Entry(key, 16, len(value), "kv", 1.0, 0.5, 1.0, None)
    s._disk.put_many([(key, value, e)])
    s._ram.pop(key)


def stored_value(s, key: bytes) -> bytes:
    s.flush()
    with s._disk.env.begin() as txn:
        return bytes(txn.get(key, db=s._disk.records))


# -- defect 8: a record is tied to its key and to the caller's layout


def test_a_valid_value_under_another_key_is_a_counted_warned_miss(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        s.put(b"a", rec(1))
        s.put(b"b", rec(2))
        va, vb = stored_value(s, b"a"), stored_value(s, b"b")
        assert len(va) == len(vb)  # same size, CRC-valid: only the key tells them apart
        raw_put(s, b"a", vb)
        raw_put(s, b"b", va)
        with pytest.warns(StoreWarning, match="written under key 62, read under 61"):
            assert s.get(b"a") is None
        with pytest.warns(StoreWarning, match="written under key"):
            assert s.get_many([b"b"]) == [None]
        assert s.stats()["corrupt_dropped"] == 2 and not s.contains(b"a")
        raw_put(s, b"c", va)
        with pytest.warns(StoreWarning):
            assert s.verify()["corrupt"] == 1
        s.check()


def test_a_record_read_under_another_key_by_the_codec_is_corrupt():
    v = codec.encode(rec(1), key=b"one")
    assert codec.decode(v, key=b"one").meta == {"i": 1}
    with pytest.raises(CorruptRecordError, match="written under key"):
        codec.decode(v, key=b"two")


def test_expect_rejects_other_dtype_shape_or_extra_arrays_and_allows_missing(tmp_path):
    r = rec(3)
    good = layout(r)
    cases = {
        "dtype": {**good, "k": ("float16", good["k"][1])},  # a page re-typed
        "shape": {**good, "v": ("bfloat16", (2, 17, 8))},
        "extra": {"k": good["k"]},  # the record holds an array the layout does not know
    }
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        assert s.get(b"x", expect={**good, "logits": ("float32", (1, 9))}) is None  # absent: a plain miss
        for name, expect in cases.items():
            s.put(b"x", r)
            s.flush()
            assert s.get(b"x", expect=good) is r  # RAM copy fits
            s.evict_ram(0)
            with pytest.warns(StoreWarning, match="layout"):
                assert s.get(b"x", expect=expect) is None, name
            assert not s.contains(b"x")
            s.put(b"x", r)  # in RAM only: a misfit there is dropped the same way
            with pytest.warns(StoreWarning, match="layout"):
                assert s.get(b"x", expect=expect) is None, name
        s.put(b"y", r)
        s.evict_ram(0)
        got = s.get(b"y", expect={**good, "logits": ("float32", (1, 9))})  # missing arrays are allowed
        assert got is not None and set(got.arrays) == {"k", "v"}
        assert s.stats()["corrupt_dropped"] == 2 * len(cases)


def test_expect_is_checked_before_anything_is_decompressed_or_allocated(tmp_path, monkeypatch):
    r = Record("kv", 1, {"z": mx.zeros((1 << 20,), dtype=mx.float32)})  # compresses ~1000x
    v = codec.encode(r, key=b"k", compress=True)
    assert len(v) < 16 << 10
    calls = []
    monkeypatch.setattr(codec, "_inflate", lambda job: calls.append(job))
    monkeypatch.setattr(codec, "_to_mlx", lambda data, e: calls.append(e))
    with pytest.raises(CorruptRecordError, match="layout needs"):
        codec.decode(v, key=b"k", expect={"z": ("float32", (16,))})
    assert calls == []


# -- defect 10: hostile sizes are bounded; NaN/inf costs keep the order


def forge(value: bytes, edit) -> bytes:
    """Rewrite a value's header and fix its checksum: consistent garbage a damaged store may hold."""
    magic, ver, flags, hlen, _ = struct.unpack_from("<4sHHII", value)
    h = msgpack.unpackb(value[PREAMBLE_SIZE : PREAMBLE_SIZE + hlen], raw=False)
    payload = value[PREAMBLE_SIZE + hlen :]
    payload = edit(h, payload)
    hb = msgpack.packb(h, use_bin_type=True)
    head = struct.pack("<4sHHI", magic, ver, flags, len(hb))
    return head + struct.pack("<I", zlib.crc32(hb, zlib.crc32(head))) + hb + payload


def _huge_shape(h, p):
    h["arrays"][0][2] = [0, 1 << 62]
    return p


def _huge_raw(h, p):
    e = h["arrays"][0]
    e[2], e[4] = [1 << 40], 4 << 40
    return p


def _huge_zstd(h, p):
    e = h["arrays"][0]
    seg = codec._cctx().compress(b"\0" * 1024)
    e[2], e[3], e[4], e[5], e[6] = [1 << 28], "zstd", 4 << 28, len(seg), zlib.crc32(seg)
    h["arrays"] = [e]
    return seg


def _nan_cost(h, p):
    h["cost"] = float("nan")
    return p


HOSTILE = {"shape": _huge_shape, "raw": _huge_raw, "zstd": _huge_zstd, "nan_cost": _nan_cost}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_records_declaring_huge_sizes_are_corrupt_and_verify_cleans_them(tmp_path, name):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        s.put(b"good", rec(0))
        s.put(b"bad", Record("kv", 16, {"k": mx.zeros((4,), dtype=mx.float32)}))
        raw_put(s, b"bad", forge(stored_value(s, b"bad"), HOSTILE[name]))
        with pytest.raises(CorruptRecordError):
            codec.decode(stored_value(s, b"bad"), key=b"bad")
        with pytest.warns(StoreWarning):
            report = s.verify()
        assert report["corrupt"] == 1 and report["entries"] == 1
        assert s.get(b"good") is not None
        s.check()


def test_verify_memory_is_bounded_by_a_chunk_not_the_declared_size(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26, compress=True) as s:
        s.put(b"zeros", Record("kv", 1, {"z": mx.zeros((16 << 20,), dtype=mx.uint8)}))  # 16 MiB -> ~1 KB
        s.flush()
        assert s.stats()["disk_bytes"] < 64 << 10
        tracemalloc.start()
        try:
            assert s.verify()["corrupt"] == 0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 4 << 20, peak


COSTS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(float("nan")), st.just(float("inf")))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(costs=st.lists(COSTS, min_size=4, max_size=12))
def test_nan_or_infinite_costs_keep_the_ram_budget_and_close_loses_nothing(tmp_path_factory, costs):
    path = tmp_path_factory.mktemp("cost")
    one = rec(0).nbytes
    s = open_store(path, ram_bytes=3 * one, disk_bytes=1 << 26)
    try:
        for i, c in enumerate(costs):
            r = rec(i)
            s.put(b"k%d" % i, r)
            r.cost = c  # a caller's record changed after put: the RAM tier must stay sane
            s.check()
            assert s.stats()["ram_bytes"] <= 3 * one
    finally:
        s.close()
    with open_store(path, ram_bytes=0, disk_bytes=1 << 26) as s:
        assert sorted(e.key for e in s.entries()) == sorted(b"k%d" % i for i in range(len(costs)))
        assert all(s.get(b"k%d" % i) is not None for i in range(len(costs)))  # written with a clamped cost
        s.check()


def test_nan_costs_in_the_disk_index_keep_gc_working(tmp_path):
    from segcache.store.disk import Entry

    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        for i in range(6):
            s.put(b"k%d" % i, rec(i))
        s.flush()
        with s._disk.env.begin(write=True) as txn:
            for i, c in enumerate([float("nan"), float("inf"), -1.0]):
                e = Entry.unpack(b"k%d" % i, txn.get(b"k%d" % i, db=s._disk.index))
                raw = msgpack.packb([e.tokens, e.nbytes, e.kind, float("nan"), c, e.created, None])
                txn.put(b"k%d" % i, raw, db=s._disk.index)
        half = s.stats()["disk_bytes"] // 2
        assert s.gc(half) > 0 and s.stats()["disk_bytes"] <= half
        s.check()


# -- prefix-aware eviction


def chain(s, n, prefix=b"c", costs=None, root=None):
    keys = [prefix + b"%d" % i for i in range(n)]
    for i, k in enumerate(keys):
        parent = (keys[i - 1] if i else root)
        s.put(k, rec(i, cost=(costs[i] if costs else 0.5), parent=parent))
    return keys


def no_orphans(s) -> set:
    entries = {e.key: e for e in s._disk.entries()}
    return {k for k, e in entries.items() if e.parent is not None and e.parent not in entries}


def test_gc_removes_a_chain_from_the_deep_end_and_never_strands_a_record(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        # the root is the least useful and the oldest: a cost-only ranking would evict it first
        keys = chain(s, 10, costs=[1e-9] + [10.0] * 9)
        branch = chain(s, 3, prefix=b"b", root=keys[4])
        one = s.stats()["disk_bytes"] // 13
        for left in (11, 8, 5, 2, 0):
            s.gc(left * one + one // 2)
            on_disk = {e.key for e in s._disk.entries()}
            assert len(on_disk) == left
            assert not no_orphans(s), "a record lost its parent"
            assert {k for k in keys if k in on_disk} == set(keys[: len({k for k in keys if k in on_disk})]), "not a prefix"
            s.check()
        assert branch


def test_budget_eviction_on_write_is_leaves_first(tmp_path):
    one = len(codec.encode(rec(0), key=b"c0"))
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=int(6.5 * one)) as s:
        keys = chain(s, 20, costs=[1e-9] * 20)
        s.flush()  # one write transaction over budget: it keeps the shallow end
        on_disk = [k for k in keys if s._disk.contains(k)]
        assert not no_orphans(s)
        assert on_disk == keys[: len(on_disk)] and 0 < len(on_disk) < 20
        s.check()


def test_reopen_smaller_evicts_leaves_first(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        keys = chain(s, 12, costs=[1e-9] * 12)
        total = s.stats()["disk_bytes"]
    with open_store(tmp_path, ram_bytes=0, disk_bytes=total // 3) as s:
        on_disk = [k for k in keys if s._disk.contains(k)]
        assert on_disk == keys[: len(on_disk)] and 0 < len(on_disk) < 12
        assert not no_orphans(s)


# -- get_many


class CountingEnv:
    def __init__(self, env):
        self._env, self.begins = env, []

    def begin(self, *a, **k):
        self.begins.append(k.get("write", False))
        return self._env.begin(*a, **k)

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_get_many_reads_disk_in_one_transaction_and_matches_get(tmp_path):
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        recs = {b"k%d" % i: rec(i) for i in range(8)}
        for k, r in recs.items():
            s.put(k, r)
        s.evict_ram(0)
        s.get(b"k0")  # one in RAM
        counting = CountingEnv(s._disk.env)
        s._disk.env = counting
        try:
            keys = [b"k%d" % i for i in range(8)] + [b"missing"]
            expects = [layout(recs[k]) if k in recs else None for k in keys]
            got = s.get_many(keys, expects=expects)
        finally:
            s._disk.env = counting._env
        assert counting.begins == [False], counting.begins
        assert got[-1] is None
        for k, g in zip(keys, got[:-1]):
            assert g.meta == recs[k].meta and all(mx.array_equal(g.arrays[n], recs[k].arrays[n]).item() for n in g.arrays)
        s.evict_ram(0)
        assert [r.meta for r in s.get_many(keys[:-1])] == [s.get(k).meta for k in keys[:-1]]


def test_corrupt_records_warn_once_each(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        s.put(b"a", rec(1))
        v = bytearray(stored_value(s, b"a"))
        v[-1] ^= 1
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(3):
                raw_put(s, b"a", bytes(v))
                s.get(b"a")
        # a record rewritten after it was dropped is a new record: each drop warns
        assert len([x for x in w if issubclass(x.category, StoreWarning)]) == 3
        assert s.stats()["corrupt_dropped"] == 3
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            raw_put(s, b"b", bytes(v))
            s.get(b"b")
            s.get(b"b")
        assert len(w) == 1
