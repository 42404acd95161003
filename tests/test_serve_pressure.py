"""`segcache serve` under load (issue 33, items 2 and 3): a crash loses at most one flush
interval of prompts, and a client that gave up while queued frees its queue slot at once.

8 long streams are killed with SIGKILL while none has finished: the flush timer had written
their prompts (published when each prefill ended), so after a restart every one of the 8
prompts resumes from disk. With --max-queue 4 and the decode rows full, 4 queued clients
disconnect: a new request is admitted within 2 s instead of a 429 until a row ends.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json
import re
import signal
import threading
import time

import httpx

from segcache.store import open_store
from serve_util import TARGET, Server

TEXT = open(TARGET.parent / "heldout_other.txt").read()
LONG = 4000  # max_tokens of the streams: none ends within the test


def _prompts(n: int, chars: int = 700) -> list[str]:
    step = max(1, (len(TEXT) - chars) // n)
    return [f"# part {i}\n" + TEXT[i * step : i * step + chars] for i in range(n)]


def _stream(url: str, prompt: str, seen: list, i: int, done: list) -> None:
    """Stream a long completion; seen[i] counts the chunks received, done[i] whether it ended."""
    body = {"prompt": prompt, "max_tokens": LONG, "stream": True, "temperature": 0}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=httpx.Timeout(600, connect=10)) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done[i] = True
                elif line.startswith("data: "):
                    seen[i] += 1
    except httpx.HTTPError:
        pass  # the server was killed


def _wait(what, cond, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _settled(path, least: int, quiet: float):
    """A condition for `_wait`: at least `least` checkpoints on disk, and none new for `quiet` s."""
    seen = {"count": -1, "since": time.monotonic()}

    def cond() -> bool:
        n, now = _ckpts_on_disk(path), time.monotonic()
        if n != seen["count"]:
            seen["count"], seen["since"] = n, now
        return n >= least and now - seen["since"] >= quiet

    return cond


def _ckpts_on_disk(path) -> int:
    try:
        with open_store(path, ram_bytes=0, disk_bytes=1 << 40, create=False) as s:
            return sum(1 for e in s.entries() if e.kind == "ckpt" and e.tokens >= 100)  # not a branch point
    except Exception:  # not created yet, or busy: ask again
        return 0


def test_kill_9_mid_stream_loses_no_prompt(tmp_path):
    store = tmp_path / "store"
    prompts = _prompts(8)
    srv = Server(store, "--decode-concurrency", 8, "--flush-interval", 1, log_path=tmp_path / "serve.log").start()
    seen, done = [0] * 8, [False] * 8
    threads = [threading.Thread(target=_stream, args=(srv.url, p, seen, i, done), daemon=True)
               for i, p in enumerate(prompts)]
    try:
        for t in threads:
            t.start()
        _wait("every stream's first chunk", lambda: all(seen), 300)
        # each prompt was published when its prefill ended; the timer writes it within its interval.
        # A prompt holds a checkpoint on the 256-token grid and one at its end, so a count alone
        # can be reached by half the prompts: wait until the count has stopped growing for more
        # than two flush intervals (nothing is published while the answers run)
        _wait("the prompts' checkpoints on disk, no more coming", _settled(store, 8, quiet=2.5), 90)
        assert not any(done), "a stream ended: the answers must still be running at the kill"
        srv.stop(signal.SIGKILL)
    finally:
        srv.stop(signal.SIGKILL)
        for t in threads:
            t.join(30)
    assert not any(done)
    srv = Server(store, log_path=tmp_path / "serve.log").start()
    try:
        for p in prompts:
            r = srv.post("/v1/completions", json.dumps({"prompt": p, "max_tokens": 1}))
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached >= usage["prompt_tokens"] // 2, usage
        tiers = re.findall(r"cached \d+ \(([^)]*)\)", srv.log())[-8:]
        assert all("disk" in t for t in tiers), tiers
    finally:
        srv.stop()


def _pending(srv) -> int:
    return httpx.get(srv.url + "/stats", timeout=10).json()["pending"]


def test_queued_clients_that_leave_free_their_slots(tmp_path):
    srv = Server(tmp_path / "store", "--decode-concurrency", 2, "--max-queue", 4,
                 log_path=tmp_path / "serve.log").start()
    seen, done = [0] * 2, [False] * 2
    running = [threading.Thread(target=_stream, args=(srv.url, p, seen, i, done), daemon=True)
               for i, p in enumerate(_prompts(2))]
    clients = []
    try:
        for t in running:
            t.start()
        _wait("both rows decoding", lambda: all(seen), 300)
        body = {"prompt": "def queued():", "max_tokens": 8, "stream": True}
        for _ in range(4):  # they queue behind the two rows: their headers come, no token
            c = httpx.Client(timeout=30)
            r = c.send(c.build_request("POST", srv.url + "/v1/completions", json=body), stream=True)
            assert r.status_code == 200
            clients.append((c, r))
        assert _pending(srv) == 6
        r = srv.post("/v1/completions", json.dumps({"prompt": "def late():", "max_tokens": 1}))
        assert r.status_code == 429  # the queue is full
        for c, r in clients:  # the clients give up
            r.close()
            c.close()

        def admitted() -> bool:  # a streamed answer's headers come once it is queued; a 429 at once
            body = {"prompt": "def late():", "max_tokens": 1, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                return r.status_code == 200

        _wait("a new request admitted", admitted, 2)
        assert not any(done)
        log = srv.log()
        assert len(re.findall(r"client gone after [\d.]+ s in the queue", log)) >= 4, log[-3000:]
    finally:
        for c, r in clients:
            c.close()
        srv.stop(signal.SIGKILL)
        for t in running:
            t.join(30)
