import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import os
import stat
import struct
import subprocess
import sys

import lmdb
import mlx.core as mx
import msgpack
import numpy as np
import pytest

from segcache.errors import InvariantError, StoreFormatError
from segcache.store import Record, open_store
from segcache.store import cli
from segcache.store.codec import DTYPES

SHAPES = [(), (0,), (3, 0, 2), (5, 7), (2, 3, 100)]


def bits(a):
    carrier = {mx.bfloat16: mx.uint16, mx.float64: mx.uint64}.get(a.dtype)
    return np.asarray(a.view(carrier) if carrier is not None else a).tobytes()


def same(r1: Record, r2: Record) -> bool:
    if (r1.kind, r1.tokens, r1.meta, r1.cost, list(r1.arrays)) != (r2.kind, r2.tokens, r2.meta, r2.cost, list(r2.arrays)):
        return False
    return all(a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b) for a, b in zip(r1.arrays.values(), r2.arrays.values()))


def rec(i: int, n: int = 256, dtype=mx.bfloat16) -> Record:
    rng = np.random.default_rng(i)
    k = mx.array(rng.standard_normal((2, n, 8)).astype(np.float32)).astype(dtype)
    return Record("kv", n, {"k": k, "v": k * 2}, {"i": i}, cost=0.001 * (i % 7 + 1))


def raw_env(path):
    return lmdb.open(str(path), max_dbs=8, lock=True)


def test_every_dtype_round_trips_from_ram_disk_and_reopen(tmp_path):
    mx.random.seed(0)
    recs = {}
    for name, (d, _) in DTYPES.items():
        arrays = {str(s): (mx.random.normal(s) > 0 if d == mx.bool_ else (mx.random.normal(s) * 50).astype(d)) for s in SHAPES}
        recs[name.encode()] = Record(name, 3, arrays, {"dtype": name}, 0.5)
    with open_store(tmp_path / "s", ram_bytes=1 << 30, disk_bytes=1 << 30) as s:
        for k, r in recs.items():
            s.put(k, r)
        assert all(same(s.get(k), r) for k, r in recs.items())  # RAM
        s.evict_ram(0)
        assert s.stats()["ram_bytes"] == 0
        assert all(same(s.get(k), r) for k, r in recs.items())  # disk, promoted
        s.check()
    with open_store(tmp_path / "s", ram_bytes=1 << 30, disk_bytes=1 << 30) as s:  # reopen
        assert all(same(s.get(k), r) for k, r in recs.items())
        assert s.stats()["hits"] == len(recs) and s.stats()["hit_tokens"] == 3 * len(recs)
        assert s.get(b"absent") is None and s.stats()["misses"] == 1


def _store_one(path, key=b"victim", compress=True, r=None):
    with open_store(path, ram_bytes=1 << 20, disk_bytes=1 << 26, compress=compress) as s:
        s.put(key, r or rec(1))
        s.put(b"bystander", rec(2))


def _expect_dropped(path, key=b"victim"):
    with open_store(path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        assert s.get(key) is None
        assert s.stats()["corrupt_dropped"] == 1
        assert not s.contains(key)
        assert same(s.get(b"bystander"), rec(2))
        s.check()


def _edit_value(path, fn, key=b"victim"):
    env = raw_env(path)
    db = env.open_db(b"records.v1")
    with env.begin(write=True) as txn:
        txn.put(key, fn(bytes(txn.get(key, db=db))), db=db)
    env.close()


@pytest.mark.parametrize("where", ["magic", "header", "payload_start", "payload_end"])
def test_flipped_byte_in_lmdb_is_a_counted_miss(tmp_path, where):
    _store_one(tmp_path)

    def flip(v):
        hlen = struct.unpack_from("<I", v, 8)[0]
        pos = {"magic": 0, "header": 16 + hlen // 2, "payload_start": 16 + hlen, "payload_end": len(v) - 1}[where]
        b = bytearray(v)
        b[pos] ^= 0x10
        return bytes(b)

    _edit_value(tmp_path, flip)
    _expect_dropped(tmp_path)


def test_truncated_value_is_a_counted_miss(tmp_path):
    _store_one(tmp_path)
    _edit_value(tmp_path, lambda v: v[: len(v) - 3])
    _expect_dropped(tmp_path)


@pytest.mark.parametrize("field", ["shape", "dtype"])
def test_rewritten_header_is_a_counted_miss(tmp_path, field):
    _store_one(tmp_path)

    def rewrite(v):
        hlen = struct.unpack_from("<I", v, 8)[0]
        h = msgpack.unpackb(v[16 : 16 + hlen], raw=False)
        if field == "shape":
            h["arrays"][0][2] = [2, 8, 256]
        else:
            h["arrays"][0][1] = "float16"
        hb = msgpack.packb(h, use_bin_type=True)
        return v[:8] + struct.pack("<I", len(hb)) + v[12:16] + hb + v[16 + hlen :]

    _edit_value(tmp_path, rewrite)
    _expect_dropped(tmp_path)


def test_flipped_byte_in_data_mdb_file_is_a_counted_miss(tmp_path):
    marker = np.frombuffer(b"SEGCACHE-MARKER!" * 64, dtype=np.uint8)
    r = Record("kv", 1, {"m": mx.array(marker)})
    _store_one(tmp_path, compress=False, r=r)
    data = tmp_path / "data.mdb"
    blob = bytearray(data.read_bytes())
    pos = blob.index(b"SEGCACHE-MARKER!" * 4)
    assert blob.count(b"SEGCACHE-MARKER!" * 64) == 1
    blob[pos + 100] ^= 0x01
    data.write_bytes(bytes(blob))
    _expect_dropped(tmp_path)


def test_verify_finds_and_removes_every_bad_record(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        for i in range(10):
            s.put(b"k%d" % i, rec(i))
    for i in (2, 5):
        _edit_value(tmp_path, lambda v: v[:-1] + bytes([v[-1] ^ 1]), key=b"k%d" % i)
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        report = s.verify()
        assert report["corrupt"] == 2 and report["entries"] == 8
        assert s.stats()["corrupt_dropped"] == 2
        s.check()
        assert s.verify()["corrupt"] == 0
        assert all(same(s.get(b"k%d" % i), rec(i)) for i in range(10) if i not in (2, 5))


def test_ram_budget_holds_and_evictions_go_to_disk(tmp_path):
    one = rec(0).nbytes
    with open_store(tmp_path, ram_bytes=5 * one, disk_bytes=1 << 28) as s:
        for i in range(40):
            s.put(b"k%d" % i, rec(i))
            assert s.stats()["ram_bytes"] <= 5 * one
            s.check()
        st = s.stats()
        assert st["ram_evictions"] >= 35 and st["disk_entries"] >= 35 and st["entries"] == 40
        assert all(same(s.get(b"k%d" % i), rec(i)) for i in range(40))


def test_ram_keeps_what_saves_most_compute_per_byte(tmp_path):
    one = rec(0).nbytes
    with open_store(tmp_path, ram_bytes=3 * one, disk_bytes=1 << 28) as s:
        cheap = Record("kv", 1, rec(0).arrays, cost=0.0001)
        dear = Record("kv", 1, rec(1).arrays, cost=10.0)
        s.put(b"dear", dear)
        s.put(b"cheap", cheap)
        for i in range(2, 6):
            s.put(b"k%d" % i, Record("kv", 1, rec(i).arrays, cost=0.01))
        assert b"dear" in s._ram and b"cheap" not in s._ram


def test_disk_budget_degrades_to_fewer_records_never_raises(tmp_path):
    budget = 3 << 20
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=budget) as s:
        for i in range(200):
            s.put(b"k%d" % i, rec(i, n=1024, dtype=mx.float32))  # 128 KiB each, 25 MiB in all
        s.put(b"huge", rec(999, n=1 << 16, dtype=mx.float32))  # 8 MiB: larger than the whole budget
        s.flush()
        st = s.stats()
        assert st["disk_bytes"] <= budget and st["disk_evictions"] > 100 and st["dropped"] >= 1
        s.check()
        kept = [i for i in range(200) if s.contains(b"k%d" % i)]
        assert kept and all(same(s.get(b"k%d" % i), rec(i, n=1024, dtype=mx.float32)) for i in kept[-3:])
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=budget) as s:
        s.check()
        assert s.gc(budget // 4) > 0 and s.stats()["disk_bytes"] <= budget // 4
        s.check()


def test_map_grows_past_its_initial_size(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=512 << 20, compress=False) as s:
        for i in range(12):
            s.put(b"k%d" % i, Record("x", 1, {"a": mx.full((8 << 20,), i, dtype=mx.uint8)}))  # 96 MiB > 64 MiB map
        assert s._disk.env.info()["map_size"] > 64 << 20
        assert s.stats()["disk_entries"] == 12 and s.stats()["dropped"] == 0
        s.check()


def test_other_format_version_is_refused_with_advice(tmp_path):
    open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26).close()
    env = raw_env(tmp_path)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format", msgpack.packb({"version": 99, "created": 0.0}), db=meta)
    env.close()
    with pytest.raises(StoreFormatError, match="version 99.*Delete the directory"):
        open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26)


def test_directory_0700_and_files_0600(tmp_path):
    os.umask(0o022)
    with open_store(tmp_path / "s", ram_bytes=0, disk_bytes=1 << 26) as s:
        s.put(b"k", rec(0))
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    for f in os.listdir(tmp_path / "s"):
        assert stat.S_IMODE(os.stat(tmp_path / "s" / f).st_mode) == 0o600, f


def test_close_is_idempotent_and_put_after_close_raises(tmp_path):
    s = open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 26)
    s.put(b"k", rec(0))
    s.close()
    s.close()
    with pytest.raises(segcache.errors.StoreError, match="closed"):
        s.put(b"k", rec(0))


def test_clean_interpreter_exit_loses_nothing(tmp_path):
    code = (
        "import segcache, mlx.core as mx\n"
        "from segcache.store import open_store, Record\n"
        f"s = open_store({str(tmp_path)!r}, ram_bytes=1<<24, disk_bytes=1<<26)\n"
        "s.put(b'exit', Record('kv', 4, {'a': mx.arange(10)}))\n"  # never closed explicitly
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        assert s.get(b"exit").arrays["a"].tolist() == list(range(10))


def test_check_catches_a_broken_index(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        s.put(b"k", rec(0))
        env = s._disk.env
        with env.begin(write=True) as txn:
            txn.delete(b"k", db=s._disk.index)
        with pytest.raises(InvariantError):
            s.check()


def test_cli_helpers(tmp_path, capsys):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        for i in range(5):
            s.put(b"k%d" % i, rec(i))
    assert cli.stats(str(tmp_path)) == 0 and "entries 5" in capsys.readouterr().out
    assert cli.ls(str(tmp_path)) == 0 and capsys.readouterr().out.count("kv") == 5
    assert cli.verify(str(tmp_path)) == 0 and "0 corrupt" in capsys.readouterr().out
    assert cli.gc(str(tmp_path), 0) == 0 and "evicted 5" in capsys.readouterr().out
    assert cli.main(["stats", str(tmp_path / "nope")]) == 1 and "no store at" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "segcache.store.cli", "stats", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0 and "entries 0" in out.stdout
