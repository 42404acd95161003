"""`segcache serve --decode-concurrency 8`: 8 concurrent clients in one batch, plain, with
prompt lookup and with a draft model, each answer equal to the request served alone (mlx-lm's generate);
a client that disconnects frees its row at once; Ctrl-C ends the process cleanly."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import signal
import threading
import time

import httpx
import mlx_lm
import pytest

from serve_util import DRAFT, TARGET, Server, stream_completion

TEXT = open(TARGET.parent / "heldout_stdlib.txt").read()
PROMPTS = [TEXT[i * 1500 : i * 1500 + 200 + 60 * i] for i in range(8)]
N = 24


@pytest.fixture(scope="module")
def ref():
    model, tok = mlx_lm.load(str(TARGET))
    return [mlx_lm.generate(model, tok, prompt=tok.encode(p), max_tokens=N) for p in PROMPTS]


DRAFTING = ([], ["--prompt-lookup"], ["--draft-model", DRAFT])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per entry of DRAFTING, each with a store of its own, launched together (ready:
    `wait_ready`), so that their start-ups share the cores with each other and with the
    references computed here; each test talks to its own server only."""
    started = []
    try:
        for i, drafting in enumerate(DRAFTING):
            d = tmp_path_factory.mktemp(f"batch{i}")
            started.append(Server(d / "store", "--decode-concurrency", "8", "--prompt-concurrency", "2", *drafting,
                                  log_path=d / "serve.log").launch())
        yield started
    finally:
        for srv in started:
            srv.stop()


@pytest.mark.parametrize("drafting", DRAFTING, ids=("plain", "lookup", "draft"))
def test_eight_clients_in_one_batch_each_as_alone(servers, ref, drafting):
    srv = servers[DRAFTING.index(drafting)].wait_ready()
    try:
        assert httpx.get(srv.url + "/stats", timeout=30).json()["max_running"] == 8  # batched, not one at a time
        out = [None] * len(PROMPTS)
        left = {}

        def leaver():
            body = {"prompt": TEXT[20000:20300], "max_tokens": 1000, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                left["chunks"] = [x for x, _ in zip((x for x in r.iter_lines() if x.startswith("data: ")), range(3))]

        threads = [threading.Thread(target=leaver)]
        threads += [threading.Thread(target=stream_completion, args=(srv.url, p, N, out, i)) for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        assert out == ref
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/stats", timeout=30).json()["pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
        cancelled = [line for line in srv.log().splitlines() if line.endswith(", cancelled")]
        assert len(cancelled) == 1, srv.log()[-3000:]
        generated = int(cancelled[0].split("generated ")[1].split(" tok")[0])
        assert generated < 200  # freed when the client left, not run on to max_tokens
        done = [line for line in srv.log().splitlines() if ", ttft " in line and line.endswith((", length", ", stop"))]
        assert len(done) == len(PROMPTS), srv.log()[-3000:]
        # the batched rows' log lines carry their rate and, speculative, their acceptance
        assert all(" tok/s" in line and ", -, " not in line for line in done), done
        if drafting:
            mode = "draft" if "--draft-model" in drafting else "lookup"
            # every row names its drafter; under load the cost gate may keep a row plain throughout
            assert all(f", {mode} accepted " in line or f", {mode} drafted nothing," in line for line in done), done
            assert any(f", {mode} accepted " in line for line in done), done
        # a prompt served again resumes from the store: whole (its end's logits stored), and cached
        # counts the target's tokens only
        usage = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2},
                           timeout=120).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"], usage
        again = [line for line in srv.log().splitlines() if f"prompt {usage['prompt_tokens']} tok, cached " in line]
        assert again and " (ram)" in again[-1], again  # the log names the tier the resume read
        # Ctrl-C ends it cleanly: no abort at exit from MLX streams left to the interpreter's teardown
        assert srv.stop(signal.SIGINT) in (0, -signal.SIGINT), srv.log()[-2000:]
        assert "terminate called" not in srv.log()
    finally:
        srv.stop()
