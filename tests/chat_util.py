"""`segcache serve`'s app in this process, on 127.0.0.1, for the chat-surface tests.

The same Server, Engine, Scheduler and Worker `segcache serve` builds, with
uvicorn on a thread: a scripted model per tool-parser family costs a load of
a tiny model, not a process start.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

from serve_util import free_port

START_TIMEOUT = 30


class LocalServer:
    """Serve the model directory `model_dir` until `stop()` (use as a context manager).

    Args:
        model_dir: an mlx-lm model directory.
        store_dir: a prefix store directory, or None to serve without one.
        chat_template, template_args: as --chat-template, --chat-template-args.
        api_key: as --api-key; api_keys: several.
        isolation: as --prompt-cache-isolation.
        engine: more `Engine` arguments (draft_model as a directory, prompt_lookup, decode_concurrency, ...).
        settings: more `Settings` fields (the server-wide sampling defaults, ...).
    """

    def __init__(self, model_dir, *, store_dir=None, chat_template=None, template_args=None, api_key=None,
                 api_keys=(), isolation="none", engine=None, settings=None):
        self.model_dir = Path(model_dir)
        self.store_dir = store_dir
        self.chat_template = chat_template
        self.template_args = template_args
        self.api_keys = tuple(api_keys) or ((api_key,) if api_key else ())
        self.isolation = isolation
        self.engine_args = dict(engine or {})
        self.settings_args = dict(settings or {})
        self.port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LocalServer":
        import mlx_lm
        import uvicorn

        from segcache.serve.app import DEFAULT_MODEL, Server, Settings, build_app
        from segcache.serve.chat import Prompter
        from segcache.serve.cli import _config, _lookup
        from segcache.serve.engine import Engine
        from segcache.serve.worker import Scheduler, Worker

        self.model, self.tokenizer = mlx_lm.load(str(self.model_dir))
        self.store = None
        if self.store_dir is not None:
            from segcache.store import open_store

            self.store = open_store(self.store_dir, ram_bytes=64 << 20, disk_bytes=256 << 20)
        name = self.model_dir.name
        settings = Settings(served_name=name, names={name, DEFAULT_MODEL}, vocab_size=len(self.tokenizer),
                            context_length=_lookup(_config(self.model_dir), "max_position_embeddings"),
                            api_keys=self.api_keys, isolation=self.isolation, **self.settings_args)
        engine = dict(self.engine_args)
        if engine.get("draft_model") is not None:
            engine["draft_model"] = mlx_lm.load(str(engine["draft_model"]))[0]
        self.engine = Engine(self.model, self.tokenizer, store=self.store, **engine)
        self.worker = Worker(Scheduler(self.engine, max_running=self.engine.decode_concurrency,
                                       begin_step=self.engine.begin_step))
        self.prompter = Prompter(self.tokenizer, self.chat_template, self.template_args)
        app = build_app(Server(settings, self.prompter, self.worker.scheduler, self.worker, self.store))
        self.port = free_port()
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="off"))
        self.worker.start()
        self.thread = threading.Thread(target=self.uvicorn.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.__exit__()
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(START_TIMEOUT)
        self.worker.stop(START_TIMEOUT)
        if self.store is not None:
            self.store.close()

    def openai(self, api_key: str = "none"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, timeout=60, max_retries=0)

    def anthropic(self, api_key: str = "none"):
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key=api_key, timeout=60, max_retries=0)


class MlxLmServer:
    """`mlx_lm.server --model MODEL` as a subprocess on a free loopback port (a context manager)."""

    def __init__(self, model_dir, log_path, *args):
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.args = [str(a) for a in args]
        self.proc = None
        self.port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "MlxLmServer":
        import subprocess
        import sys

        import httpx

        self.port = free_port()
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited:\n{self.log_path.read_text(errors='replace')}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a start-up takes seconds: ask often, so a ready server waits little
        self.__exit__()
        raise RuntimeError("mlx_lm.server did not answer /health in 90 s")

    def __exit__(self, *exc) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=60, max_retries=0)


@contextlib.contextmanager
def warnings_logged(name: str = "segcache.serve"):
    """The messages of the warnings `name` logs inside the block (a handler of the test's own:
    a filter the server installs on the root handlers cannot hide them)."""
    records: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger(name)
    handler = _Handler(logging.WARNING)
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(min(old or logging.WARNING, logging.WARNING))
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
