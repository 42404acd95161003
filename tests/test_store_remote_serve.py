"""Item 5 of issue 14: two `segcache serve` processes with their own disks share one Redis:
a conversation started on one continues on the other from the remote."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import time

import mlx_lm
from mlx_lm.server import convert_chat

from serve_util import TARGET, Server

SYSTEM = open(TARGET.parent / "heldout_other.txt").read()[:1200]


def _settled(srv, timeout=30.0) -> int:
    """Wait (bounded) until the remote's key count stops growing: the write-through is done."""
    c, last, since = srv.client(), -1, time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = c.dbsize()
        if n != last:
            last, since = n, time.monotonic()
        elif n and time.monotonic() - since > 0.5:
            return n
        time.sleep(0.1)
    raise AssertionError(f"remote still changing (or empty: {last} keys) after {timeout} s")


def test_a_conversation_started_on_one_server_continues_on_another(tmp_path, redis_server):
    flags = ["--prompt-cache-remote", redis_server.url]
    one = Server(tmp_path / "one", *flags, log_path=tmp_path / "one.log")
    two = Server(tmp_path / "two", *flags, log_path=tmp_path / "two.log")
    try:
        one.launch(), two.launch()  # both start up at once, while the reference loads here
        ref = mlx_lm.load(str(TARGET))
        one.wait_ready(), two.wait_ready()
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def load(path):"}]
        r1 = one.client().chat.completions.create(model="target", messages=msgs, max_tokens=16)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        _settled(redis_server)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "def save(path):"}]
        r2 = two.client().chat.completions.create(model="target", messages=msgs, max_tokens=16)
        ids = ref[1].encode(convert_chat(msgs))
        assert r2.choices[0].message.content == mlx_lm.generate(*ref, prompt=ids, max_tokens=16)
        assert r2.usage.prompt_tokens_details.cached_tokens > len(ref[1].encode(SYSTEM)) // 2, two.log()
    finally:
        one.stop()
        two.stop()
