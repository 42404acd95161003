"""The remote tier's catch-up after an outage, and its value-by-value MGET reader (issue 14).

Against a real redis-server on 127.0.0.1 (the `redis_server` fixture). Resumed
states are compared with the digests the publishing process computed cold.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json
import subprocess
import sys
import time
import warnings

import pytest

from conftest import tiny
from segcache import Runtime, open_store
from segcache.errors import StoreWarning
from segcache.store.remote import RemoteTier
from test_store_remote import CHILD, FAMILIES, NS, OPEN, PROMPTS, digest


def wait_for(cond, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {seconds} s"
        time.sleep(0.05)


def test_records_published_while_the_remote_was_down_reach_it_once_it_is_back(tmp_path, redis_server):
    """Published during an outage: owed (not dropped), sent after the restart on the same port
    without any new publish, and a second process with its own disk resumes them exactly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)  # the outage's one warning
        with open_store(tmp_path / "a", remote=redis_server.url, **OPEN) as store:
            redis_server.stop()
            want = []
            for f in FAMILIES:
                for p in PROMPTS:
                    want.append(digest(Runtime(tiny(f), store=store).prefill(p)))
                if f == FAMILIES[0]:
                    store.evict_ram(0)  # these owed records are re-read from disk (sent as stored), the rest from RAM
            store.drain_remote()  # the writer has seen every write fail (not still queued)
            st = store.stats()
            assert st["remote_backlog"] > 0 and st["remote_writes"] == 0 and st["remote_dropped"] == 0, st
            redis_server.start()  # same port, empty
            wait_for(lambda: store.stats()["remote_backlog"] == 0, "the backlog was not sent")
            st = store.stats()
            assert st["remote_writes"] > 0 and st["remote_dropped"] == 0, st
    got = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "b"), redis_server.url, json.dumps(PROMPTS)],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    *digests, hit, reads, _ = got.stdout.split()
    assert digests == want
    assert int(hit) == len(FAMILIES) * sum(len(p) for p in PROMPTS) and int(reads) > 0


def test_the_backlog_is_bounded_and_what_overflows_is_counted_dropped(tmp_path, redis_server):
    """A long outage keeps only the newest `remote_backlog` keys; the rest count in remote_dropped."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        with open_store(tmp_path / "a", remote=redis_server.url, remote_backlog=3, **OPEN) as store:
            redis_server.stop()
            for p in PROMPTS:
                Runtime(tiny("qwen3_5"), store=store).prefill(p)
            store.drain_remote()
            before = store.stats()
            assert before["remote_backlog"] == 3 and before["remote_dropped"] > 0, before
            redis_server.start()
            wait_for(lambda: store.stats()["remote_backlog"] == 0, "the backlog was not sent")
            st = store.stats()  # the three kept keys are sent (a node's merges count one write each)
            assert st["remote_writes"] >= 3 and st["remote_dropped"] == before["remote_dropped"], st
        assert len(list(redis_server.client().scan_iter(match=NS + b"*"))) == 3


def test_a_record_gone_from_the_local_tiers_before_the_remote_returns_is_dropped(tmp_path, redis_server):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        with open_store(tmp_path / "a", remote=redis_server.url, **OPEN) as store:
            redis_server.stop()
            Runtime(tiny("llama"), store=store).prefill(PROMPTS[0])
            store.drain_remote()
            assert store.stats()["remote_backlog"] > 0
            for e in store.entries():
                if not e.key.startswith(b"n"):  # pages and checkpoints; node merges need no local copy
                    store.delete(e.key)
            redis_server.start()
            wait_for(lambda: store.stats()["remote_backlog"] == 0, "the backlog was not worked off")
            st = store.stats()
            assert st["remote_dropped"] > 0 and st["remote_writes"] > 0, st  # the pages dropped, the node merges sent
    assert not [k for k in redis_server.client().scan_iter(match=NS + b"*") if not k[len(NS):].startswith(b"n")]


@pytest.mark.parametrize("size", [0, 1, 300 << 10, 3 << 20])  # empty, tiny, > one 16 KiB header read, several MB
def test_the_mget_reader_returns_each_value_exactly_and_stays_in_step(redis_server, size):
    """Values of every size come back byte for byte; one over max_value and a missing key are None,
    and the connection stays in step for the next lookup."""
    c = redis_server.client()
    big = bytes((7 * i) % 251 for i in range(size))
    c.set(NS + b"a", big)
    c.set(NS + b"over", b"x" * (4 << 20))
    c.set(NS + b"b", b"tail\r\n$-1\r\n")  # protocol bytes inside a value are data
    tier = RemoteTier(redis_server.url, timeout=2.0, max_value=(4 << 20) - 1)
    try:
        for _ in range(2):  # the same pooled connection, twice
            assert tier.get_values([b"a", b"missing", b"over", b"b"]) == [big, None, None, b"tail\r\n$-1\r\n"]
        assert tier.get_values([b"b"]) == [b"tail\r\n$-1\r\n"]
        # one reused buffer: each value is right while it is the current one
        assert [(i, bytes(v)) for i, v in tier.stream([b"b", b"a", b"over", b"b"], reuse=True)] == [
            (0, b"tail\r\n$-1\r\n"), (1, big), (3, b"tail\r\n$-1\r\n")]
        st = tier.stats()
        assert st["remote_reads"] == 8 and st["remote_errors"] == 0, st
    finally:
        tier.close()


def test_a_lookup_abandoned_part_way_does_not_desync_the_connection(redis_server):
    c = redis_server.client()
    for k in (b"a", b"b", b"c"):
        c.set(NS + k, k * (200 << 10))
    tier = RemoteTier(redis_server.url, timeout=2.0)
    try:
        it = tier.stream([b"a", b"b", b"c"])
        assert next(it) == (0, bytearray(b"a" * (200 << 10)))
        it.close()  # the caller stopped reading: the rest of the reply must not reach the next lookup
        assert tier.get_values([b"c", b"a"]) == [b"c" * (200 << 10), b"a" * (200 << 10)]
    finally:
        tier.close()


def test_a_prompt_resumed_whole_takes_one_round_trip(tmp_path, redis_server):
    """Pages, nodes and the checkpoint at the prompt's end come in ONE MGET (the hybrid needs that checkpoint)."""
    long = [(5 * i) % 61 + 2 for i in range(16 * 6 + 5)]
    model = tiny("qwen3_5")
    with open_store(tmp_path / "a", remote=redis_server.url, **OPEN) as store:
        want = digest(Runtime(model, store=store).prefill(long))
    c = redis_server.client()
    c.config_resetstat()
    with open_store(tmp_path / "b", remote=redis_server.url, **OPEN) as store:
        assert digest(Runtime(model, store=store).prefill(long)) == want
        assert store.stats()["hit_tokens"] == len(long)
        calls = {k: v["calls"] for k, v in c.info("commandstats").items()}
    assert calls.get("cmdstat_mget") == 1 and "cmdstat_get" not in calls, calls


def test_the_mget_reader_over_tls(tmp_path):
    """rediss://: the reader works on redis-py's TLS socket (values of several reads, twice, in step)."""
    import shutil
    import socket

    from redis_util import binary, free_port

    exe, openssl = binary(), shutil.which("openssl")
    if exe is None or openssl is None:
        pytest.skip("needs redis-server (or valkey-server) and openssl")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True, timeout=60)
    port = free_port()
    proc = subprocess.Popen([exe, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                             "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                pytest.skip(f"{exe} has no TLS support here (exited {proc.returncode})")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "TLS server did not listen"
                time.sleep(0.05)
        url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none"
        import redis

        big = bytes(range(256)) * 4096  # 1 MiB: many TLS records
        redis.Redis.from_url(url, socket_timeout=5).set(NS + b"a", big)
        redis.Redis.from_url(url, socket_timeout=5).set(NS + b"b", b"yy")
        tier = RemoteTier(url, timeout=2.0)
        try:
            for _ in range(2):
                assert tier.get_values([b"a", b"missing", b"b"]) == [big, None, b"yy"]
            assert tier.stats()["remote_errors"] == 0
        finally:
            tier.close()
    finally:
        proc.kill()
        proc.wait(10)
