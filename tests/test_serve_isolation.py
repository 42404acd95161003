"""Prefix-cache isolation in `segcache serve` (issue 24, item 4).

The threat: after one client sent "my bank PIN is 4831...", another guessing the
prompt read `cached_tokens` (and the time to first token) to learn whether it was
cached. With `--prompt-cache-isolation per-key` a key shares cached prefixes only
with itself; a request's `cache_salt` (vLLM's field) is a domain of its own.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serve_util import TARGET, Server

SECRET = "My bank PIN is 4831 and the card number ends in 9920. Remember it for me, please."


def cached(srv, key=None, **body):
    """(status, cached_tokens or the error body) of a non-streamed completion."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": SECRET, "max_tokens": 2, **body}, headers=headers,
                   timeout=120)
    if r.status_code != 200:
        return r.status_code, r.json()
    usage = r.json()["usage"]
    return 200, usage["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The two tests' servers, each with a store of its own, launched together (ready:
    `wait_ready`) so that their start-ups share the cores."""
    d = tmp_path_factory.mktemp("isolation")
    keys_file = d / "keys.txt"
    keys_file.write_text("# one key per line\nbob-key\n\ncarol-key\n")
    per_key = Server(d / "per-key", "--api-key", "alice-key", "--api-key-file", keys_file,
                     "--prompt-cache-isolation", "per-key", log_path=d / "per-key.log")
    salted = Server(d / "salted", log_path=d / "salted.log")
    try:
        yield {"per-key": per_key.launch(), "salted": salted.launch()}
    finally:
        per_key.stop()
        salted.stop()


def test_per_key_isolation_keeps_each_keys_prefixes_to_itself(servers):
    srv = servers["per-key"]
    try:
        srv.wait_ready()
        assert cached(srv, "alice-key") == (200, 0)
        status, got = cached(srv, "alice-key")
        assert status == 200 and got > 10  # the same key shares its own prefix
        assert cached(srv, "bob-key") == (200, 0)  # another key guessing the whole prompt: nothing cached
        assert cached(srv, "carol-key", cache_salt="x") == (200, 0)
        assert cached(srv, "bob-key")[1] == got  # bob now shares with himself
        # alice's salts are domains of her own, inside her key's
        assert cached(srv, "alice-key", cache_salt="tab-1") == (200, 0)
        assert cached(srv, "alice-key", cache_salt="tab-1")[1] == got
        status, body = cached(srv, "dave-key")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert "alice-key" not in srv.log() and "bob-key" not in srv.log()
    finally:
        srv.stop()


def test_cache_salt_separates_requests_and_the_same_salt_shares(servers):
    srv = servers["salted"]
    try:
        srv.wait_ready()
        assert cached(srv, cache_salt="tenant-a") == (200, 0)
        assert cached(srv, cache_salt="tenant-b") == (200, 0)  # another salt never shares
        assert cached(srv) == (200, 0)  # nor does no salt
        status, got = cached(srv, cache_salt="tenant-a")
        assert status == 200 and got > 10  # the same salt does
        assert cached(srv)[1] == got  # and so do requests without one, among themselves
        for bad in ("", 7, ["a"]):
            status, body = cached(srv, cache_salt=bad)
            assert status == 400 and body["error"]["param"] == "cache_salt", body
    finally:
        srv.stop()


def test_per_key_isolation_without_keys_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "segcache.cli", "serve", "--model", str(TARGET),
                           "--prompt-cache-isolation", "per-key", "--prompt-cache-dir", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 2 and "needs API keys" in done.stderr


def _env():
    """This tree's package first (as serve_util's servers), and no key from the environment."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    env.pop("SEGCACHE_API_KEY", None)
    return env


@pytest.mark.parametrize("content", ["missing-file", "two keys"])
def test_a_bad_keys_file_is_refused(tmp_path, content):
    path = tmp_path / "keys.txt"
    if content != "missing-file":
        path.write_text("one two\n")
    done = subprocess.run([sys.executable, "-m", "segcache.cli", "serve", "--model", str(TARGET),
                           "--api-key-file", str(path), "--prompt-cache-dir", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 2 and "key" in done.stderr
