"""`segcache serve` with many clients and with its guards on: 8 concurrent
streams each identical to the request alone, a client leaving mid-stream,
the bounded queue (429), the API key (401), CORS, and EOS."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json
import socket
import threading
import time

import httpx
import mlx_lm
import pytest

from serve_util import TARGET, Server

TEXT = open(TARGET.parent / "heldout_stdlib.txt").read()
PROMPTS = [TEXT[i * 1500 : i * 1500 + 300 + 90 * i] for i in range(8)]


@pytest.fixture(scope="module")
def ref():
    return mlx_lm.load(str(TARGET))


def _stream(client, prompt, n, out, i):
    text, chunks = [], 0
    for ev in client.completions.create(model="target", prompt=prompt, max_tokens=n, stream=True):
        text.append(ev.choices[0].text)
        chunks += 1
    out[i] = ("".join(text), chunks)


def test_eight_concurrent_streams_and_a_client_leaving(tmp_path, ref):
    srv = Server(tmp_path / "store", "--ram-bytes", "2M", "--disk-bytes", "256M", "--max-queue", "16",
                 log_path=tmp_path / "serve.log").launch()
    try:
        n = 40
        want = [mlx_lm.generate(*ref, prompt=ref[1].encode(p), max_tokens=n) for p in PROMPTS]  # while it starts up
        srv.wait_ready()
        out = [None] * len(PROMPTS)
        left = {}

        def leaver():
            body = {"prompt": TEXT[20000:20400], "max_tokens": 400, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                got = [line for line, _ in zip((x for x in r.iter_lines() if x.startswith("data: ")), range(3))]
            left["chunks"] = got  # the connection closes here, mid-stream

        threads = [threading.Thread(target=leaver)]
        threads += [threading.Thread(target=_stream, args=(srv.client(), p, n, out, i)) for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        assert len(left["chunks"]) == 3
        for (text, chunks), w in zip(out, want):
            assert text == w
            assert chunks > 10  # streamed as produced, not in one piece
        # the leaver's request stopped early: its log line says cancelled, with fewer tokens than asked
        deadline = time.monotonic() + 30
        while (st := httpx.get(srv.url + "/stats", timeout=30).json())["pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert st["pending"] == 0
        cancelled = [line for line in srv.log().splitlines() if line.endswith(", cancelled")]
        assert len(cancelled) == 1 and "generated 400 tok" not in cancelled[0]
        store = st["store"]
        assert store["ram_bytes"] <= store["ram_budget"] == 2 << 20
        assert store["disk_bytes"] <= store["disk_budget"] == 256 << 20
        assert store["ram_evictions"] > 0  # the budget was binding, and held
        # a non-streaming client that leaves is noticed too (the handler polls for it)
        body = json.dumps({"prompt": TEXT[30000:30300], "max_tokens": 3000}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.5)
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/stats", timeout=30).json()["pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
        cancelled = [line for line in srv.log().splitlines() if line.endswith(", cancelled")]
        assert len(cancelled) == 2 and "generated 3000 tok" not in cancelled[1]
        # every request alone again (now resumed from the cache): the same text
        for p, w in zip(PROMPTS[:3], want):
            assert srv.client().completions.create(model="target", prompt=p, max_tokens=n).choices[0].text == w
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, ref):
    """The target with '\\n' as an extra EOS token (mlx-lm reads eos_token_id from config.json)."""
    d = tmp_path_factory.mktemp("eos-model")
    for f in TARGET.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((TARGET / "config.json").read_text())
    newline = ref[1].encode("\n")
    assert len(newline) == 1
    cfg["eos_token_id"] = [0, newline[0]]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


KEY = "s3cret-key"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, eos_model):
    """The servers of the tests below, each with a store (or a blocked store path) of its own,
    launched together (ready: `wait_ready`) so that their start-ups share the cores; each
    test talks to its own. (The test above runs alone: its client that leaves after 0.5 s
    must have been admitted by then.)"""
    d = tmp_path_factory.mktemp("clients")
    blocker = d / "not-a-dir"
    blocker.write_text("a file where the store directory should be")
    started = {}
    try:
        # one request running at a time (the queue test counts on it), one waiting at most
        started["guarded"] = Server(d / "guarded", "--api-key", KEY, "--max-queue", "1", "--allowed-origins",
                                    "http://ok.example", "--decode-concurrency", "1", model=eos_model,
                                    log_path=d / "guarded.log").launch()
        started["plain"] = Server(d / "plain", log_path=d / "plain.log").launch()
        started["blocked"] = Server(blocker, log_path=d / "blocked.log").launch()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def test_api_key_cors_queue_and_eos(servers, eos_model):
    key = KEY
    srv = servers["guarded"].wait_ready()
    try:
        url = srv.url
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = srv.post("/v1/completions", json.dumps({"prompt": "x"}), headers=headers)
            assert r.status_code == 401
        good = {"Authorization": f"Bearer {key}"}
        assert httpx.get(url + "/v1/models", headers=good, timeout=10).status_code == 200
        import openai

        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").models.list()
        client = srv.client(key)

        # CORS: the allowed origin only
        pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        r = httpx.options(url + "/v1/completions", headers={"Origin": "http://ok.example", **pre}, timeout=10)
        assert r.headers.get("access-control-allow-origin") == "http://ok.example"
        r = httpx.options(url + "/v1/completions", headers={"Origin": "http://evil.example", **pre}, timeout=10)
        assert "access-control-allow-origin" not in r.headers

        # EOS ends the completion with finish_reason "stop"; its text is not returned
        model, tok = mlx_lm.load(str(eos_model))
        ids = tok.encode("import os")
        tokens = list(mlx_lm.stream_generate(model, tok, ids, max_tokens=50))
        assert tokens[-1].finish_reason == "stop"
        r = client.completions.create(model="default_model", prompt="import os", max_tokens=50)
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == mlx_lm.generate(model, tok, prompt=ids, max_tokens=50)
        assert "\n" not in r.choices[0].text and r.usage.completion_tokens == len(tokens)

        # the queue holds one waiting request: of four at once, some get 429 with Retry-After
        codes, retry = [], []

        def call():
            r = srv.post("/v1/completions", json.dumps({"prompt": TEXT[:200], "max_tokens": 300}), headers=good)
            codes.append(r.status_code)
            if r.status_code == 429:
                retry.append(r.headers.get("retry-after"))
                assert r.json()["error"]["code"] == "rate_limit_exceeded"

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert 429 in codes and 200 in codes and all(c in (200, 429) for c in codes)
        assert all(v and v.isdigit() for v in retry)
        assert client.completions.create(model="default_model", prompt="x = 1", max_tokens=3).choices[0].text is not None
    finally:
        srv.stop()


def test_cors_is_off_by_default(servers):
    srv = servers["plain"].wait_ready()
    try:
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://any.example"}, timeout=10)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers  # cross-origin: refused
        r = httpx.get(srv.url + "/v1/models", timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert oct(srv.cache_dir.stat().st_mode & 0o777) == oct(0o700)
    finally:
        srv.stop()


def test_a_store_that_cannot_open_is_served_without(servers, ref):
    srv = servers["blocked"]
    try:
        ids = ref[1].encode("def f(x):")
        want = mlx_lm.generate(*ref, prompt=ids, max_tokens=8)
        srv.wait_ready()
        for _ in range(2):
            r = srv.client().completions.create(model="target", prompt="def f(x):", max_tokens=8)
            assert r.choices[0].text == want
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert "serving without it" in srv.log()
        assert httpx.get(srv.url + "/stats", timeout=10).json()["store"] is None
    finally:
        srv.stop()
