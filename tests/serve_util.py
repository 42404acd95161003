"""A real `segcache serve` process on 127.0.0.1 for the serve tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from segcache.demo import MODELS_DIR

TARGET = MODELS_DIR / "target"
DRAFT = MODELS_DIR / "draft"
START_TIMEOUT = 90  # seconds for a server to answer /health (2 loaded cores: be generous)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`segcache serve --model MODEL --prompt-cache-dir CACHE [args]` as a subprocess.

    Always stop it (`stop()` in a finally or a fixture's teardown).
    """

    def __init__(self, cache_dir, *args, model=TARGET, log_path=None):
        self.cache_dir = Path(cache_dir)
        self.args = [str(a) for a in args]
        self.model = Path(model)
        self.log_path = Path(log_path or self.cache_dir.parent / f"serve-{os.getpid()}-{id(self)}.log")
        self.proc = None
        self.port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        """Launch the process and wait (bounded) until it answers /health."""
        return self.launch().wait_ready()

    def launch(self) -> "Server":
        """Launch the process without waiting for it (`wait_ready` next): servers launched
        together start up side by side."""
        self.port = free_port()
        cmd = [sys.executable, "-m", "segcache.cli", "serve", "--model", str(self.model), "--port", str(self.port),
               "--prompt-cache-dir", str(self.cache_dir), *self.args]
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self) -> "Server":
        """Wait until the launched process answers /health (killed after START_TIMEOUT s)."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"segcache serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a start-up takes seconds: ask often, so a ready server waits little
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"segcache serve did not answer /health in {START_TIMEOUT} s:\n{self.log()}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """Send `sig` and wait for the process (SIGKILL after `timeout`); returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, api_key: str = "none"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, timeout=120, max_retries=0)

    def post(self, path: str, content: bytes | str, headers=None) -> httpx.Response:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        return httpx.post(self.url + path, content=content, headers=hdrs, timeout=120)


def stream_completion(url: str, prompt: str, max_tokens: int, out: list, i: int) -> None:
    """Stream `/v1/completions` for `prompt` and put the whole text at out[i] (a thread's target)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"]
                if choice:
                    text.append(choice[0]["text"])
    out[i] = "".join(text)
