"""`segcache serve` across restarts: SIGTERM lets a request in flight end and
flushes the store; after SIGTERM and after SIGKILL the next turn resumes from
disk with the same text as mlx-lm computing it cold."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json
import re
import signal

import httpx
import mlx_lm
import pytest
from mlx_lm.server import convert_chat

from serve_util import TARGET, Server

SYSTEM = open(TARGET.parent / "heldout_other.txt").read()[:1200]

@pytest.fixture(scope="module")
def ref():
    return mlx_lm.load(str(TARGET))

def _turn(srv, ref, messages, n=24):
    r = srv.client().chat.completions.create(model="target", messages=messages, max_tokens=n)
    ids = ref[1].encode(convert_chat(messages))
    assert r.choices[0].message.content == mlx_lm.generate(*ref, prompt=ids, max_tokens=n)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, ids

def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n

def _last_tier(srv) -> str:
    lines = [m.group(1) for m in re.finditer(r"cached \d+ \(([^)]*)\)", srv.log())]
    return lines[-1]

def test_restart_by_sigterm_and_by_sigkill_resumes_from_disk(tmp_path, ref):
    store = tmp_path / "store"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def load(path):"}]
    srv = Server(store, log_path=tmp_path / "serve.log").launch()
    try:
        # a long streamed request in flight when SIGTERM arrives still ends whole (its reference
        # computed while the server starts up); the signal lands after its first chunk, so
        # any length past one token is in flight, and 100 are still decoding at the signal
        ids = ref[1].encode("def handle(request):\n")
        want = mlx_lm.generate(*ref, prompt=ids, max_tokens=100)
        a1, _, ids1 = _turn(srv.wait_ready(), ref, msgs)
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"prompt": "def handle(request):\n", "max_tokens": 100, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        chunks = [first] + rest
        assert chunks[-1] == "data: [DONE]"
        text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1])
        assert text == want
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)
        assert "prefix store flushed and closed" in srv.log()
    finally:
        srv.stop()

    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "def save(path):"}]
    srv = Server(store, log_path=tmp_path / "serve.log").start()
    try:
        a2, cached, ids2 = _turn(srv, ref, msgs)
        assert cached > len(ids1) // 2 and "disk" in _last_tier(srv)
    finally:
        srv.stop(signal.SIGKILL)  # right after the answer: nothing more is flushed on the way out

    msgs += [{"role": "assistant", "content": a2}, {"role": "user", "content": "def close(self):"}]
    srv = Server(store, log_path=tmp_path / "serve.log").start()
    try:
        _, cached, ids3 = _turn(srv, ref, msgs)
        # from turn 2's prompt: its records reached disk before its answer ended

        assert cached >= len(ids2) - 1 and "disk" in _last_tier(srv)
    finally:
        srv.stop()
