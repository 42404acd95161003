"""`segcache serve` on two ranks over loopback (MLX's ring backend, as `mlx.launch --backend ring -n 2`).

One deployment of the shipped demo target, tensor parallel (each rank holds half
of its heads), with prompt lookup and batching on, answers through the `openai`
client exactly what a one-process server of the same model answers (greedy);
then one rank is killed mid-stream (the other stops, saying why, no hang), and
a restart of both ranks (now with the demo draft model, replicated on each
rank) resumes every prompt from each rank's own store.

`make test-long` (SEGCACHE_LONG=1) runs the same on a pipeline-parallel
deployment too (each rank two of the target's four layers).

Every server here is a real process on a free loopback port; every wait is
bounded; the test stops every process it started.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from segcache.testing import ranks

from serve_util import DRAFT, TARGET, Server, free_port

START_TIMEOUT = 120  # seconds for both ranks to load and answer /health (2 loaded cores)
LONG = os.environ.get("SEGCACHE_LONG") == "1"
MODES = ["tensor", "pipeline"] if LONG else ["tensor"]
RANK_TIMEOUT = "20"  # seconds a rank waits for the other in a step (the tiny model's steps take milliseconds)
LOST_EXIT = 75  # a rank that lost the group (segcache.distributed.channel.LOST_EXIT)

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
]
CHAT = [{"role": "user", "content": "write a function that adds two numbers"}]


class Deployment:
    """Both ranks of `segcache serve` under the ring backend; rank 0 answers HTTP on `port`."""

    def __init__(self, directory: Path, store: Path, *args, model: Path = TARGET):
        self.port = free_port()
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        argv = ["-m", "segcache.cli", "serve", "--model", str(model), "--port", str(self.port),
                "--prompt-cache-dir", str(store), "--rank-timeout", RANK_TIMEOUT, *map(str, args)]
        self.ranks = ranks.start(argv, 2, directory=directory, env=env, name=f"serve-{self.port}-rank")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        import time

        import httpx

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            for r, p in enumerate(self.ranks.procs):
                if p.poll() is not None:
                    raise RuntimeError(f"rank {r} exited with {p.returncode}:\n{self.ranks.log(r)[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a start-up takes seconds: ask often, so a ready deployment waits little
        raise RuntimeError(f"the deployment did not answer /health in {START_TIMEOUT} s:\n{self.ranks.log(0)[-3000:]}")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=120, max_retries=0)


def answers(client) -> dict:
    """Greedy answers to every prompt, sent at once (so the ranks batch them), and to a chat."""
    out: dict = {}

    def complete(prompt):
        r = client.completions.create(model="default_model", prompt=prompt, max_tokens=32, temperature=0)
        details = r.usage.prompt_tokens_details
        out[prompt] = (r.choices[0].text, details.cached_tokens if details else 0, r.usage.prompt_tokens)

    threads = [threading.Thread(target=complete, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    r = client.chat.completions.create(model="default_model", messages=CHAT, max_tokens=32, temperature=0)
    out["chat"] = (r.choices[0].message.content, 0, r.usage.prompt_tokens)
    return out


def pipelined(directory: Path) -> Path:
    """The target with the weight index mlx-lm's pipeline loading reads (one file holds every weight)."""
    import json
    import shutil

    import mlx.core as mx

    shutil.copytree(TARGET, directory)
    names = mx.load(str(directory / "model.safetensors")).keys()
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in names}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


@pytest.fixture(scope="module", params=MODES)
def served(request, tmp_path_factory):
    """The two-rank deployment and a one-process server, both fresh, answering the same requests."""
    root = tmp_path_factory.mktemp("dist-serve")
    mode = request.param
    flags = ("--prompt-lookup", "--decode-concurrency", "4") + (("--pipeline",) if mode == "pipeline" else ())
    model = pipelined(root / "target") if mode == "pipeline" else TARGET
    group = Deployment(root, root / "store", *flags, model=model)
    one = Server(root / "one-store", *flags, model=TARGET)
    try:
        one.launch()  # starts up beside the ranks
        group.wait_ready()
        one.wait_ready()
        yield {"root": root, "group": group, "got": answers(group.client()), "want": answers(one.client()),
               "mode": mode, "model": model, "flags": flags}
    finally:
        one.stop()
        group.ranks.stop(signal.SIGKILL)


def test_two_ranks_answer_as_one_process(served):
    """Batched, prompt-lookup greedy answers of the tensor-parallel deployment: the one-process
    server's text, every prompt; and rank 1 ran every request too (its own log lines)."""
    got, want = served["got"], served["want"]
    assert len(got) == len(want) == len(PROMPTS) + 1
    for key in want:
        assert got[key][0] == want[key][0], key
        assert got[key][0]  # the demo target writes something for each
    rank1 = served["group"].ranks.log(1)
    assert f"rank 1 of 2 ({served['mode']} parallel" in rank1
    assert rank1.count("lookup accepted") >= len(PROMPTS) + 1, rank1[-3000:]
    store = served["root"] / "store"
    assert sorted(p.name for p in store.iterdir()) == ["rank-0-of-2", "rank-1-of-2"]


def test_a_killed_rank_stops_the_other(served):
    """Rank 1 killed while rank 0 streams an answer: the stream ends with an error event, rank 0
    stops by itself (exit 75) saying why, within bounded time; nothing hangs."""
    group = served["group"]
    client = group.client()
    stream = client.completions.create(model="default_model", prompt=PROMPTS[0] * 4, max_tokens=1000,
                                       temperature=0, stream=True)
    texts, error = [], None
    try:
        for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
            if len(texts) == 2:
                group.ranks.procs[1].send_signal(signal.SIGKILL)
    except Exception as exc:  # the server may end the stream with an error event
        error = exc
    status = group.ranks.wait(0, 60)
    log = group.ranks.log(0)
    assert status == LOST_EXIT, log[-3000:]
    # The ring raises at rank 0's next message (RankLostError), or, when rank 1 died inside one of the
    # model's collectives, rank 0's step waits until its deadline (--rank-timeout) ends it: exit 75 both ways.
    assert "start every rank again" in log, log[-3000:]
    assert "RankLostError" in log or "waited past its deadline" in log, log[-3000:]
    # the stream ends with the server's error event, not a dropped connection
    import openai

    assert isinstance(error, openai.APIError) and not isinstance(error, openai.APIConnectionError), repr(error)
    assert len(texts) < 1000


def test_restart_resumes_from_each_rank_store(served, tmp_path):
    """Both ranks started again on the same store, now drafting with the demo draft model (whole on
    each rank): every prompt resumes from the store (cached: all of it, with its end's logits: the
    server's sessions are whole; every rank must hold it, or none resumes) and the answers are unchanged."""
    group = served["group"]
    group.ranks.stop(signal.SIGKILL)  # whatever the last test left
    flags = ["--draft-model", DRAFT, "--decode-concurrency", "4"]
    flags += ["--pipeline"] if served["mode"] == "pipeline" else []
    again = Deployment(served["root"], served["root"] / "store", *flags, model=served["model"])
    try:
        again.wait_ready()
        got = answers(again.client())
        for prompt in PROMPTS:
            text, cached, prompt_tokens = got[prompt]
            assert text == served["want"][prompt][0], prompt
            assert cached == prompt_tokens, (prompt, cached, prompt_tokens)
        assert got["chat"][0] == served["want"]["chat"][0]
        rank1 = again.ranks.log(1)
        assert rank1.count("(disk)") >= len(PROMPTS) and "draft accepted" in rank1, rank1[-3000:]
        again.ranks.procs[0].send_signal(signal.SIGTERM)  # rank 0 stops, and tells rank 1 to
        # rank 0 ends as a one-process server does (uvicorn re-raises SIGTERM once it has shut down)
        assert again.ranks.wait(0, 60) in (0, -signal.SIGTERM), again.ranks.log(0)[-3000:]
        assert again.ranks.wait(1, 60) == 0, again.ranks.log(1)[-3000:]
    finally:
        again.ranks.stop(signal.SIGKILL)


# -- the scheduler of one rank, in one process (a group of one: its own messages) ------------------


def _run(sched, jobs, cancel=None) -> int:
    """Step `sched` until its jobs are done. `cancel`: (job, its events): the HTTP side cancels it
    once it has 3 events; returns how many it had then (-1: never cancelled)."""
    for job in jobs:
        sched.submit(job)
    at = -1
    for _ in range(5000):
        if cancel is not None and at < 0 and len(cancel[1]) >= 3:
            cancel[0].cancel()
            at = len(cancel[1])
        if not sched.pending():
            break
        sched.step()
    assert not sched.pending()
    return at


def test_a_request_crosses_the_wire_whole():
    """Every field of a GenRequest (its Controls included) survives msgpack; a request without a
    seed gets one (the same in its fields and its controls), one with a seed keeps it."""
    import msgpack

    from segcache.controls import Controls
    from segcache.serve.ranks import decode_request, encode_request, seeded
    from segcache.serve.engine import GenRequest

    controls = Controls(temperature=0.7, top_k=5, logit_bias={3: -1.5, 7: 2.0},
                        response_format={"type": "json_object"}, repetition_penalty=1.1)
    req = GenRequest(id="cmpl-1", ids=[1, 2, 3], max_tokens=9, checkpoints=[2], stops=["\n\n"], top_logprobs=2,
                     cache_salt="salt", n=2, controls=controls)
    seeded(req)
    assert isinstance(req.seed, int) and req.controls.seed == req.seed
    wire = msgpack.unpackb(msgpack.packb(encode_request(req), use_bin_type=True), raw=False, strict_map_key=False)
    back = decode_request(wire)
    for f in ("id", "ids", "max_tokens", "checkpoints", "stops", "top_logprobs", "cache_salt", "n", "seed", "controls"):
        assert getattr(back, f) == getattr(req, f), f
    fixed = GenRequest(id="cmpl-2", ids=[1], max_tokens=1, seed=42)
    assert seeded(fixed).seed == 42 and fixed.controls is None


def test_the_group_scheduler_alone_serves_as_the_scheduler():
    """On a group of one (its messages come back to it), the group scheduler admits, batches and
    cancels as the plain Scheduler does: the same events for the same requests, a cancelled one
    stops at the step after its flag, and `stop()` ends its loop."""
    import mlx_lm

    from segcache.distributed import Channel
    from segcache.serve.ranks import GroupScheduler
    from segcache.serve.engine import Chunk, Engine, Finish, GenRequest
    from segcache.serve.worker import Job, Scheduler
    from serve_util import TARGET

    model, tok = mlx_lm.load(str(TARGET))
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n"]

    def jobs(out):
        return [Job(GenRequest(id=f"r{i}", ids=tok.encode(p), max_tokens=24), out.setdefault(f"r{i}", []).append)
                for i, p in enumerate(prompts)]

    def text(events):
        return "".join(e.text for e in events if isinstance(e, Chunk))

    want, got = {}, {}
    engine = Engine(model, tok, prompt_lookup=True, decode_concurrency=2)
    _run(Scheduler(engine, max_running=2, begin_step=engine.begin_step), jobs(want))
    engine = Engine(model, tok, prompt_lookup=True, decode_concurrency=2, group=Channel())
    assert engine.decoder.gate is None  # each rank would time its own steps
    sched = GroupScheduler(engine, Channel(), max_running=2)
    mine = jobs(got)
    at = _run(sched, mine, cancel=(mine[0], got["r0"]))
    for rid in ("r1", "r2"):  # r2 waited for a free row, then ran as alone
        assert text(got[rid]) == text(want[rid]) and isinstance(got[rid][-1], Finish)
    assert at == len(got["r0"]) == 3  # cancelled at the next step: nothing more came
    assert text(want["r0"]).startswith(text(got["r0"])) and isinstance(want["r0"][-1], Finish)
    assert len(engine.decoder) == 0 and sched.lost is None
    sched.stop()
    assert sched.step() is False  # the stop decision: every rank leaves its loop
