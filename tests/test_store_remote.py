"""The remote tier (issue 14) against a real redis-server on 127.0.0.1.

Each test starts its own server on a free port (no persistence) and stops it in
the fixture's finalizer. Resumed states are compared with mlx-lm computing cold.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import hashlib
import subprocess
import sys
import time
import warnings

import mlx.core as mx
import numpy as np
import pytest

from conftest import tiny
from redis_util import RedisServer
from segcache import Runtime, open_store
from segcache.errors import StoreWarning
from segcache.testing import models

NS = b"segcache:1:"
PROMPTS = [list(range(3, 43)), list(range(3, 35)) + [9, 8, 7, 6, 5, 4, 3]]  # pages of 16, a shared page, tails
FAMILIES = ("llama", "qwen3_5", "gemma3_text")  # dense, hybrid, sliding window
# A generous lookup timeout: two loaded cores can stall a loopback reply past the 50 ms default,
# and these tests are about what is served, not about speed.
OPEN = dict(ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=16, remote_timeout=2.0)


def digest(a) -> str:
    return hashlib.sha256(np.asarray(a.astype(mx.float32)).tobytes()).hexdigest()


def cold(model, prompt):
    """The prompt computed with no store at all (same kernels, no resume)."""
    return Runtime(model).prefill(prompt)


def cold_stored(path, model, prompt):
    """The prompt computed through an empty store without remote: the same stops and chunks
    as any store-backed prefill that resumes nothing, so a miss must match it bit for bit."""
    with open_store(path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=16) as s:
        return Runtime(model, store=s).prefill(prompt)


def publish(path, url, families=FAMILIES, **kw):
    """Prefill every prompt on every family through a store with the remote; returns the digests."""
    out = []
    with open_store(path, remote=url, **OPEN, **kw) as store:
        for f in families:
            for p in PROMPTS:
                out.append(digest(Runtime(tiny(f), store=store).prefill(p)))
        st = store.stats()
    assert st["remote_writes"] > 0 and st["remote_dropped"] == 0 and st["remote_errors"] == 0, st
    return out


def values(srv) -> dict[bytes, bytes]:
    c = srv.client()
    return {k: c.get(k) for k in c.scan_iter(match=NS + b"*")}


CHILD = r"""
import segcache, sys, json, hashlib, numpy as np, mlx.core as mx
from segcache import Runtime, open_store
from segcache.testing import models
prompts = json.loads(sys.argv[3])
out = []
with open_store(sys.argv[1], remote=sys.argv[2], ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=16, remote_timeout=2.0) as store:
    for f in ("llama", "qwen3_5", "gemma3_text"):
        for p in prompts:
            out.append(hashlib.sha256(np.asarray(Runtime(models.build(f), store=store).prefill(p).astype(mx.float32)).tobytes()).hexdigest())
    st = store.stats()
print(" ".join(out), st["hit_tokens"], st["remote_reads"], st["disk_entries"] + st["ram_entries"])
"""


def test_a_second_process_with_its_own_disk_resumes_from_the_remote(tmp_path, redis_server):
    """Item 1: dense, hybrid and window models, separate LMDB directories: exact resume."""
    import json

    want = publish(tmp_path / "a", redis_server.url)
    got = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "b"), redis_server.url, json.dumps(PROMPTS)],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    *digests, hit, reads, local = got.stdout.split()
    assert digests == want
    assert int(hit) == len(FAMILIES) * sum(len(p) for p in PROMPTS)  # every prompt resumed whole
    assert int(reads) > 0 and int(local) > 0  # from the remote, and filled the local tiers


def test_lookups_are_one_round_trip_per_prefill(tmp_path, redis_server):
    """A prompt of several pages asks the remote once for its pages and nodes, not once per page."""
    long = [(5 * i) % 61 + 2 for i in range(16 * 6 + 5)]
    with open_store(tmp_path / "a", remote=redis_server.url, **OPEN) as store:
        Runtime(tiny("llama"), store=store).prefill(long)
    c = redis_server.client()
    c.config_resetstat()
    with open_store(tmp_path / "b", remote=redis_server.url, **OPEN) as store:
        got = Runtime(tiny("llama"), store=store).prefill(long)
        assert store.stats()["hit_tokens"] == len(long)
        calls = {k: v["calls"] for k, v in c.info("commandstats").items()}
    assert digest(got) == digest(cold(tiny("llama"), long))
    # pages + nodes in one MGET, then the checkpoint past the last page (its key depends on the node)
    assert calls.get("cmdstat_mget", 0) <= 2 and "cmdstat_get" not in calls, calls


def test_the_remote_killed_mid_run_leaves_the_local_tiers_serving_and_reconnects(tmp_path, redis_server):
    """Item 2: requests complete while it is gone (one warning, counted), and it is used again once back."""
    model = tiny("llama")
    with open_store(tmp_path / "a", remote=redis_server.url, **OPEN) as store:
        Runtime(model, store=store).prefill(PROMPTS[0])
        store.drain_remote()
        redis_server.stop()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in range(6):
                p = [(7 * n + i) % 60 + 3 for i in range(40)]
                assert digest(Runtime(model, store=store).prefill(p)) == digest(cold(model, p))
                again = Runtime(model, store=store)
                assert digest(again.prefill(PROMPTS[0])) == digest(cold(model, PROMPTS[0]))  # local tiers serve
        remote_warnings = [w for w in caught if issubclass(w.category, StoreWarning) and "remote" in str(w.message)]
        assert len(remote_warnings) == 1, [str(w.message) for w in caught]
        st = store.stats()
        # owed, not lost: the writes wait in the backlog for the remote's return
        assert st["remote_errors"] >= 1 and st["remote_backlog"] >= 1 and st["remote_dropped"] == 0, st

        redis_server.start()  # same port
        deadline, k = time.monotonic() + 60, 0
        while store.stats()["remote_writes"] == st["remote_writes"]:
            assert time.monotonic() < deadline, f"no reconnect within 60 s: {store.stats()}"
            p = [(11 * k + i) % 60 + 3 for i in range(20)]
            Runtime(model, store=store).prefill(p)
            store.drain_remote()
            k += 1
            time.sleep(0.2)
        late = [(13 * k + i) % 60 + 3 for i in range(40)]
        Runtime(model, store=store).prefill(late)
    with open_store(tmp_path / "b", remote=redis_server.url, **OPEN) as other:
        assert digest(Runtime(model, store=other).prefill(late)) == digest(cold(model, late))
        assert other.stats()["hit_tokens"] == len(late) and other.stats()["remote_reads"] > 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_damaged_remote_values_are_counted_misses_never_served(tmp_path, redis_server, damage):
    """Item 3: every value damaged: no token is resumed, each rejected value is counted, output is cold."""
    model = tiny("qwen3_5")
    with open_store(tmp_path / "a", remote=redis_server.url, **OPEN) as store:
        for p in PROMPTS:
            Runtime(model, store=store).prefill(p)
    vals = values(redis_server)
    keys = sorted(vals)
    assert len(keys) >= 4
    c = redis_server.client()
    bad = {}
    for k in keys:
        v = bytearray(vals[k])
        if damage == "flip":
            v[len(v) // 2] ^= 0x40  # the payload (or the header of a small node) changes
            v[-1] ^= 0x01
        elif damage == "truncate":
            v = v[: len(v) - max(1, len(v) // 3)]
        else:  # each value under the next key of the same kind (pages, nodes, checkpoints)
            same = [j for j in keys if j[len(NS):len(NS) + 2] == k[len(NS):len(NS) + 2]]
            v = bytearray(vals[same[(same.index(k) + 1) % len(same)]]) if len(same) > 1 else v[:-1]
        bad[k] = bytes(v)
    for n, p in enumerate(PROMPTS):  # a fresh local store per prompt: only the remote could resume
        c.flushdb()  # the previous prompt's publish repaired what it rewrote: damage again
        c.mset(bad)
        with open_store(tmp_path / f"b{n}", remote=redis_server.url, **OPEN) as store:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", StoreWarning)
                assert digest(Runtime(model, store=store).prefill(p)) == digest(cold_stored(tmp_path / f"c{n}", model, p))
            st = store.stats()
        assert st["hit_tokens"] == 0, st
        assert st["remote_corrupt"] > 0 and st["remote_corrupt"] == st["remote_reads"], st


@pytest.mark.parametrize("other", ["same", "weights", "dtype", "salt"])
def test_another_model_dtype_or_salt_never_hits(tmp_path, redis_server, other):
    """Item 4: a store on another identity shares the remote and reads nothing of the first."""
    publish(tmp_path / "a", redis_server.url, families=("llama",))
    model, salt = tiny("llama"), None
    if other == "weights":
        model = tiny("llama", seed=1)
    elif other == "dtype":
        model = models.build("llama", dtype=mx.bfloat16)
    elif other == "salt":
        salt = "tenant-b"
    c = redis_server.client()
    first = set(c.scan_iter(match=NS + b"*"))
    for n, p in enumerate(PROMPTS):
        for k in set(c.scan_iter(match=NS + b"*")) - first:  # what the other identity published itself
            c.delete(k)
        with open_store(tmp_path / f"b{n}", remote=redis_server.url, salt=salt, **OPEN) as store:
            got = Runtime(model, store=store).prefill(p)
            st = store.stats()
        if other != "same":
            assert digest(got) == digest(cold_stored(tmp_path / f"c{n}", model, p))
        if other == "same":  # the control: the publisher's own identity does hit
            assert st["hit_tokens"] == len(p) and st["remote_reads"] > 0, st
        else:
            assert st["hit_tokens"] == 0 and st["remote_reads"] == 0, st


def test_write_through_queue_full_keeps_records_local_and_counts_them(tmp_path, redis_server):
    """A full queue never blocks a publish: the record stays local, counted in remote_dropped."""
    with open_store(tmp_path / "a", remote=redis_server.url, **{**OPEN, "remote_queue": 1, "remote_timeout": 0.05}) as store:
        redis_server.proc.send_signal(__import__("signal").SIGSTOP)  # slow: accepts nothing
        try:
            for p in PROMPTS:
                Runtime(tiny("llama"), store=store).prefill(p)
            st = store.stats()
            assert st["remote_dropped"] >= 1, st
            for p in PROMPTS:  # still local
                Runtime(tiny("llama"), store=store).prefill(p)
            assert store.stats()["hit_tokens"] - st["hit_tokens"] == sum(len(p) for p in PROMPTS)
        finally:
            redis_server.proc.send_signal(__import__("signal").SIGCONT)


def test_node_updates_from_two_hosts_merge_in_the_remote(tmp_path, redis_server):
    """Host B's node update does not overwrite host A's continuation (B's own copy of the
    node predates A's publish; a plain SET of it would lose A's)."""
    model, shared = tiny("llama"), list(range(3, 19))  # one page of 16
    own = {k: [(7 * k + 5 * i + 1) % 60 + 3 for i in range(8)] for k in range(3)}
    b = open_store(tmp_path / "b", remote=redis_server.url, **OPEN)
    try:
        Runtime(model, store=b).prefill(shared + own[0])
        b.drain_remote()
        with open_store(tmp_path / "a", remote=redis_server.url, **OPEN) as a:
            Runtime(model, store=a).prefill(shared + own[1])
        Runtime(model, store=b).prefill(shared + own[2])  # B's node is its own, without A's continuation
        b.drain_remote()
    finally:
        b.close()
    for k in range(3):
        prompt = shared + own[k][:5] + [63, 62]
        with open_store(tmp_path / f"c{k}", remote=redis_server.url, **OPEN) as c:
            got = Runtime(model, store=c).prefill(prompt)
            assert c.stats()["hit_tokens"] == len(shared) + 5, f"continuation {k} was lost"
        assert mx.allclose(got, cold(model, prompt), atol=1e-4, rtol=1e-4).item()


def test_a_password_protected_remote_and_a_wrong_password(tmp_path):
    """redis://:password@host works; a wrong password is a counted error and a warning that
    does not show the password, never an exception."""
    srv = RedisServer(tmp_path / "redis", "--requirepass", "s3cret").start()
    try:
        good = f"redis://:s3cret@127.0.0.1:{srv.port}/0"
        publish(tmp_path / "a", good, families=("llama",))
        with open_store(tmp_path / "b", remote=good, **OPEN) as s:
            Runtime(tiny("llama"), store=s).prefill(PROMPTS[0])
            assert s.stats()["hit_tokens"] == len(PROMPTS[0])
        bad = f"redis://:wrong-pw@127.0.0.1:{srv.port}/0"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with open_store(tmp_path / "c", remote=bad, **OPEN) as s:
                Runtime(tiny("llama"), store=s).prefill(PROMPTS[0])
                st = s.stats()
        assert st["hit_tokens"] == 0 and st["remote_errors"] >= 1, st
        msgs = [str(w.message) for w in caught if "remote" in str(w.message)]
        assert msgs and not any("wrong-pw" in m for m in msgs), msgs
    finally:
        srv.stop()


def test_a_malformed_url_is_refused_at_open(tmp_path):
    from segcache.errors import StoreError

    with pytest.raises(StoreError, match="redis://"):
        open_store(tmp_path / "a", remote="http://127.0.0.1:1/0", **OPEN)
    assert not (tmp_path / "a").exists()
