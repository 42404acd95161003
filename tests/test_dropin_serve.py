"""`segcache serve` with mlx_lm.server's flags against mlx_lm.server itself (issue 25).

`--kv-bits 4`: the greedy text of mlx_lm.server run with the same flags, and
after a restart the prompt resumes from quantized pages on disk with the same
text. `--adapter-path`: the text of mlx_lm.server with the same adapter, and
the per-request `adapters` field (one adapter per server).
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import mlx_lm
import pytest

from serve_util import START_TIMEOUT, TARGET, Server, free_port
from test_dropin_lora import make_adapter

SOURCE = open(TARGET.parent / "heldout_other.txt").read()
PROMPT = SOURCE[3000:4400]  # ~490 tokens (a page and a tail), where 4-bit KV changes the greedy text
KV = ["--kv-bits", "4", "--quantized-kv-start", "0"]


class MlxServer:
    """`mlx_lm.server` as a subprocess on a free loopback port (stop it in a finally)."""

    def __init__(self, *args, log_path):
        self.args = [str(a) for a in args]
        self.log_path = log_path
        self.proc = None

    def __enter__(self):
        self.port = free_port()
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(TARGET), "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, open(self.log_path).read()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a start-up takes seconds: ask often, so a ready server waits little
        raise RuntimeError(f"mlx_lm.server did not answer in {START_TIMEOUT} s:\n{open(self.log_path).read()}")

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def complete(url: str, n: int = 32, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0.0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _last_tier(srv) -> str:
    return [m.group(1) for m in re.finditer(r"cached \d+ \(([^)]*)\)", srv.log())][-1]


def test_kv_bits_text_of_mlx_lm_server_and_a_restart_resumes_quantized_pages(tmp_path):
    store = tmp_path / "store"
    # the same prompt without --kv-bits in another store, for its bytes at the end: that server
    # starts up beside the others
    plain_store = tmp_path / "plain"
    plain = Server(plain_store, log_path=tmp_path / "plain.log").launch()
    try:
        srv = Server(store, *KV, log_path=tmp_path / "serve.log").launch()  # starts up beside mlx_lm.server
        try:
            with MlxServer(*KV, log_path=tmp_path / "mlx.log") as ref:
                want = complete(f"http://127.0.0.1:{ref.port}")["choices"][0]["text"]
            model, tok = mlx_lm.load(str(TARGET))  # the flags matter here: unquantized, the text differs
            assert mlx_lm.generate(model, tok, tok.encode(PROMPT), max_tokens=32) != want
            first = complete(srv.wait_ready().url)
            assert first["choices"][0]["text"] == want
        finally:
            assert srv.stop() in (0, -signal.SIGTERM)  # flushes the store
        srv = Server(store, *KV, log_path=tmp_path / "serve.log").start()
        try:
            again = complete(srv.url)
            assert again["choices"][0]["text"] == want
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= again["usage"]["prompt_tokens"] - 1 and "disk" in _last_tier(srv)
        finally:
            srv.stop()
        complete(plain.wait_ready().url)
    finally:
        plain.stop()  # flushes its store

    # the quantized records are at most 0.35x the plain ones' bytes
    from segcache import open_store

    with open_store(store) as q, open_store(plain_store) as p:
        ratio = q.stats()["disk_bytes"] / p.stats()["disk_bytes"]
    assert ratio <= 0.35, ratio


def test_adapter_path_text_of_mlx_lm_server_and_the_adapters_field(tmp_path):
    adapter = make_adapter(tmp_path / "adapter", seed=3, scale=8.0)
    srv = Server(tmp_path / "store", "--adapter-path", adapter, log_path=tmp_path / "serve.log").launch()
    try:  # ours starts up beside mlx_lm.server
        with MlxServer("--adapter-path", adapter, log_path=tmp_path / "mlx.log") as ref:
            want = complete(f"http://127.0.0.1:{ref.port}")["choices"][0]["text"]
        assert complete(srv.wait_ready().url)["choices"][0]["text"] == want
        assert complete(srv.url, adapters=adapter)["choices"][0]["text"] == want  # the served one: honoured
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                                          "adapters": str(tmp_path / "another")}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "adapters"
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, says", [
    (["--kv-bits", "7"], "kv_bits=7"),
])
def test_flags_mlx_cannot_serve_stop_with_a_message(tmp_path, flags, says):
    cmd = [sys.executable, "-m", "segcache.cli", "serve", "--model", str(TARGET), "--port", str(free_port()),
           "--prompt-cache-dir", str(tmp_path / "store"), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr
