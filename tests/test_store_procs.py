import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import os
import random
import signal
import subprocess
import sys
import time


from segcache.store import open_store

# Shared by this process and the children: a record's content follows from its key.
COMMON = r"""
import sys, numpy as np, mlx.core as mx
from segcache.store import open_store, Record

def rec(key: bytes) -> Record:
    seed = int.from_bytes(key.ljust(16, b"\0")[:16], "little") % (2**63)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 64))
    k = mx.array(rng.standard_normal((2, n, 8)).astype(np.float32))
    return Record("kv", n, {"k": k.astype(mx.bfloat16), "v": k, "ids": mx.array(rng.integers(0, 1000, n, dtype=np.int32))},
                  {"key": key.hex()}, cost=float(rng.random()))

def same(a, b) -> bool:
    bits = lambda x: np.asarray(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x).tobytes()
    return (a.kind, a.tokens, a.meta, a.cost) == (b.kind, b.tokens, b.meta, b.cost) and all(
        x.dtype == y.dtype and x.shape == y.shape and bits(x) == bits(y) for x, y in zip(a.arrays.values(), b.arrays.values()))
"""
exec(COMMON)

BIG = 1 << 30


def run_child(code: str, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import segcache\n" + COMMON + code, *map(str, args)], text=True, **kw)


def assert_whole(path, expect_keys=()):
    with open_store(path, ram_bytes=0, disk_bytes=BIG) as s:
        report = s.verify()
        assert report["corrupt"] == 0 and report["orphans"] == 0 and not report["fixed_total"], report
        s.check()
        keys = [e.key for e in s.entries()]
        for k in keys:
            assert same(s.get(k), rec(k)), k
        missing = set(expect_keys) - set(keys)
        assert not missing, f"{len(missing)} cleanly stored keys lost"
        return keys


def test_a_second_process_sees_what_the_first_stored(tmp_path):
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=BIG) as s:
        for i in range(5):
            s.put(b"first-%d" % i, rec(b"first-%d" % i))
    code = (
        "s = open_store(sys.argv[1], ram_bytes=1<<20, disk_bytes=1<<30)\n"
        "ok = all(same(s.get(b'first-%d' % i), rec(b'first-%d' % i)) for i in range(5))\n"
        "print('hits', s.stats()['hits'], ok)\n"
        "s.put(b'second', rec(b'second')); s.close()\n"
    )
    p = run_child(code, tmp_path, stdout=subprocess.PIPE)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == "hits 5 True"
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=BIG) as s:
        assert same(s.get(b"second"), rec(b"second"))


def test_concurrent_writers_and_readers_lose_and_corrupt_nothing(tmp_path):
    open_store(tmp_path, ram_bytes=0, disk_bytes=BIG).close()
    code = (
        "me, n = int(sys.argv[2]), int(sys.argv[3])\n"
        "s = open_store(sys.argv[1], ram_bytes=20_000, disk_bytes=1<<30)\n"
        "seen = 0\n"
        "for i in range(60):\n"
        "    k = b'p%d-%d' % (me, i); s.put(k, rec(k))\n"
        "    s.put(b'shared-%d' % (i % 10), rec(b'shared-%d' % (i % 10)))\n"
        "    if i % 5 == 0: s.flush()\n"
        "    for j in range(n):\n"
        "        k2 = b'p%d-%d' % (j, i // 2)\n"
        "        r = s.get(k2)\n"
        "        if r is not None:\n"
        "            assert same(r, rec(k2)), k2\n"
        "            seen += 1\n"
        "st = s.stats(); s.close()\n"
        "print(seen, st['corrupt_dropped'], st['dropped'])\n"
    )
    n = 3
    procs = [run_child(code, tmp_path, me, n, stdout=subprocess.PIPE) for me in range(n)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for out in outs:
        seen, corrupt, dropped = map(int, out.split())
        assert corrupt == 0 and dropped == 0
    expect = [b"p%d-%d" % (me, i) for me in range(n) for i in range(60)] + [b"shared-%d" % i for i in range(10)]
    keys = assert_whole(tmp_path, expect)
    assert len(keys) == len(expect)


WRITER = r"""
path, run = sys.argv[1], int(sys.argv[2])
sys.stdin.readline()  # wait for "go": the import cost is paid before the clock starts
s = open_store(path, ram_bytes=30_000, disk_bytes=1<<30)
print("ready", flush=True)
i = 0
while True:
    k = b"w%d-%d" % (run, i)
    s.put(k, rec(k))  # RAM is tiny: nearly every put suspends records to LMDB
    if i % 7 == 0: s.flush()
    if i == 0: print("on disk", flush=True)
    if i % 11 == 0: s.evict_ram(0)
    i += 1
"""


def test_sigkill_while_suspending_20_times_leaves_a_whole_store(tmp_path):
    base = [b"base-%d" % i for i in range(30)]
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=BIG) as s:
        for k in base:
            s.put(k, rec(k))
    rnd = random.Random(0)
    ahead = 6  # children importing while others run: process start-up (~2-3 s) dominates a run
    spare = [run_child(WRITER, tmp_path, r, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for r in range(ahead)]
    nxt = ahead
    for run in range(20):
        p = spare.pop(0)
        if nxt < 20:  # keep a few children importing while this one runs
            spare.append(run_child(WRITER, tmp_path, nxt, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            nxt += 1
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ready"
        # the kill lands while it suspends, however slowly this machine runs it up to its first flush
        assert p.stdout.readline().strip() == "on disk"
        time.sleep(rnd.uniform(0.05, 0.3))
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p.stdin.close()
        p.stdout.close()
        assert p.returncode == -signal.SIGKILL
    keys = assert_whole(tmp_path, base)
    written = [k for k in keys if k.startswith(b"w")]
    assert len({k.split(b"-")[0] for k in written}) == 20  # every run got records to disk before dying
