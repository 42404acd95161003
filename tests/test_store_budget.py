"""The disk budget bounds the file a user sees (issue 24, item 6).

`--disk-bytes 64M` once held the records' byte total under 64 MB while data.mdb grew
to 86 MB: LMDB keeps values in whole pages, keeps freed pages for reuse, and needs
contiguous runs for large values. Here data.mdb is measured directly, through many
evictions of records of mixed sizes, after reopening with a smaller budget, and after
`gc` (which gives free pages back when no other process has the store open).
"""

import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import os
import random
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from segcache.store import Record, open_store

MiB = 1 << 20
SIZES = [2_000, 30_000, 65_536, 140_000, 300_000]  # an index node .. a large checkpoint, in bytes


def record(i: int, n: int) -> Record:
    return Record("kv", 1, {"a": mx.full((n,), i % 251, dtype=mx.uint8)}, {"i": i}, cost=random.Random(i).random())


def data_mdb(path) -> int:
    return os.path.getsize(Path(path) / "data.mdb")


def fill(s, path, count: int, seed: int = 0, budget: int | None = None) -> dict:
    """Put `count` records of mixed sizes; checks the file after each one against `budget`."""
    rnd = random.Random(seed)
    for i in range(count):
        key = b"s%d-%d" % (seed, i)
        s.put(key, record(i, rnd.choice(SIZES)))
        if budget is not None:
            assert data_mdb(path) <= budget, f"data.mdb is {data_mdb(path)} bytes after {i + 1} records, over {budget}"
    return s.stats()


def test_the_file_stays_within_the_budget_through_many_evictions(tmp_path):
    budget = 4 * MiB
    with open_store(tmp_path, ram_bytes=0, disk_bytes=budget) as s:  # no RAM: every put is a disk write
        st = fill(s, tmp_path, 600, budget=budget)
        assert st["disk_evictions"] > 300 and st["dropped"] == 0, st  # ~55 MB through a 4 MB store
        assert st["disk_file_bytes"] == data_mdb(tmp_path) and st["disk_bytes"] <= st["disk_page_bytes"] <= budget
        s.check()
        rnd = random.Random(0)
        sizes = [rnd.choice(SIZES) for _ in range(600)]
        kept = [i for i in range(600) if s.contains(b"s0-%d" % i)]
        assert len(kept) > 10 and 599 in kept  # the newest record stays (what is written is evicted last)
        for i in kept[-5:]:
            got = s.get(b"s0-%d" % i)
            assert got.meta == {"i": i} and got.arrays["a"].size == sizes[i] and got.arrays["a"][0].item() == i % 251
    assert data_mdb(tmp_path) <= budget
    with open_store(tmp_path, ram_bytes=1 * MiB, disk_bytes=budget) as s:  # through RAM, in batches, after a reopen
        fill(s, tmp_path, 300, seed=1)
        s.flush()
        assert data_mdb(tmp_path) <= budget
        s.check()


def test_a_smaller_budget_at_reopen_shrinks_the_file(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=64 * MiB) as s:
        fill(s, tmp_path, 150)
    assert data_mdb(tmp_path) > 12 * MiB
    with open_store(tmp_path, ram_bytes=0, disk_bytes=3 * MiB) as s:
        assert data_mdb(tmp_path) <= 3 * MiB  # evicted and compacted at open: nobody else had it open
        assert s.stats()["disk_entries"] > 0
        s.check()
        fill(s, tmp_path, 100, seed=2, budget=3 * MiB)


HOLDER = r"""
import sys
from segcache.store import open_store
s = open_store(sys.argv[1], ram_bytes=0, disk_bytes=1 << 30)
print("open", flush=True)
sys.stdin.readline()
s.close()
"""


def test_gc_gives_the_space_back_when_no_other_process_has_the_store_open(tmp_path):
    with open_store(tmp_path, ram_bytes=0, disk_bytes=64 * MiB) as s:
        fill(s, tmp_path, 150)
        big = data_mdb(tmp_path)
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert holder.stdout.readline().strip() == "open"
            assert s.gc(2 * MiB, file=True) > 0 and s.stats()["disk_page_bytes"] <= 2 * MiB
            assert data_mdb(tmp_path) >= big  # another process has it mapped: its pages stay, for reuse
        finally:
            holder.stdin.write("\n")
            holder.stdin.close()
            holder.wait(timeout=60)
        assert holder.returncode == 0
        s.gc(2 * MiB, file=True)
        assert data_mdb(tmp_path) <= 2 * MiB  # alone now: the file is rewritten without its free pages
        s.check()
        before = {e.key for e in s.entries()}
        assert before and all(s.get(k) is not None for k in before)  # what was kept survived the rewrite
        fill(s, tmp_path, 20, seed=3)  # and the store goes on working
        s.check()
    with open_store(tmp_path, ram_bytes=0, disk_bytes=64 * MiB) as s:
        assert before <= {e.key for e in s.entries()}
        s.check()
