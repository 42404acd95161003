"""One request's life (segcache/session/): `stream_generate` and the server's engine run the same
Session, so for the same prompt and answer they publish the same records, the EOS included."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import functools

import mlx.core as mx
import mlx_lm
import pytest

from segcache import Runtime, open_store
from segcache.batch.decoder import BatchDecoder
from segcache.generation import stream_generate
from segcache.serve.engine import Chunk, Engine, Failure, Finish, GenRequest, Progress
from segcache.serve.worker import Job, Scheduler
from segcache.session.session import Session
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer

PROMPT = "def add(a, b):\n    return a + b\n\ndef add("


@functools.lru_cache(maxsize=None)
def model(family: str):
    return models.build(family, seed=0)


@functools.lru_cache(maxsize=None)
def eos_case(family: str):
    """(prompt ids, a tokenizer whose EOS greedy decoding emits at its 10th token or earlier)."""
    tk = test_tokenizer.tokenizer(eos=False)
    prompt = tk.encode(PROMPT)
    free = [r.token for r in mlx_lm.stream_generate(model(family), tk, mx.array(prompt), max_tokens=12)]
    return prompt, test_tokenizer.tokenizer(eos=False, eos_token_ids=[free[9]])


def records(store) -> list:
    return sorted((e.key, e.kind, e.tokens) for e in store.entries())


def served(family, tk, prompt, store, concurrency, whole=True, **drafting):
    """Serve the prompt through the engine (its sessions `whole` or not); its events."""
    engine = Engine(model(family), tk, store=store, decode_concurrency=concurrency, checkpoint_interval=0,
                    vocab_size=models.VOCAB, whole_prompt=whole, **drafting)
    sched = Scheduler(engine, max_queue=1, max_running=concurrency, begin_step=engine.begin_step)
    events = []
    sched.submit(Job(GenRequest("x", list(prompt), 30), events.append))
    for _ in range(500):
        if not sched.step():
            break
    assert not sched.pending() and len(engine.decoder) == 0
    return events


@pytest.mark.parametrize("whole", [False, True], ids=["prompt-1", "whole"])
@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
@pytest.mark.parametrize("drafting", [{}, {"prompt_lookup": True}], ids=["plain", "lookup"])
def test_stream_generate_and_the_engine_publish_the_same_records(tmp_path, family, drafting, whole):
    """Whole or not (the server's sessions are whole by default), the same records; a whole
    session's are the other's and the whole prompt's end with its logits."""
    prompt, tk = eos_case(family)
    target = model(family)
    with open_store(tmp_path / "generate") as store:
        rt = Runtime(target, store=store)
        out = list(stream_generate(target, tk, prompt, max_tokens=30, runtime=rt, whole_prompt=whole, **drafting))
        assert out[-1].finish_reason == "stop"  # it ended on its EOS ...
        answer = [r.token for r in out]
        assert rt.tokens == prompt + answer  # ... which the runtime holds, fed
        want = records(store)
    # the published prompt + answer reaches the EOS: a checkpoint there
    assert max(t for _, kind, t in want if kind == "ckpt") == len(prompt) + len(answer)
    if whole:  # both ends of the prompt: all but its last token (as without `whole`) and all of it
        assert {len(prompt) - 1, len(prompt)} <= {t for _, kind, t in want if kind == "ckpt"}
    for concurrency in (1, 3):
        with open_store(tmp_path / f"served{concurrency}") as store:
            events = served(family, tk, prompt, store, concurrency, whole, **drafting)
            finish = events[-1]
            assert isinstance(finish, Finish) and finish.reason == "stop"
            assert finish.usage.completion_tokens == len(answer)
            assert "".join(e.text for e in events if isinstance(e, Chunk)) == "".join(r.text for r in out)
            assert records(store) == want, concurrency


def test_a_session_keeps_its_invariants_through_its_life(tmp_path):
    """Driven by hand: resumed, fed in chunks (a Progress each), joined, stepped, settled, left;
    `check()` holds at every point, and a second session resumes what the first published."""
    family = "qwen3_5"
    prompt, tk = eos_case(family)
    target = model(family)
    with open_store(tmp_path / "s") as store:
        history = prompt + [7, 8, 9] * 20
        L = len(history) - 1  # the prefill holds all but the last token
        decoder = BatchDecoder(target, one_row=True)
        session = Session(decoder, Runtime(target, store=store), history, checkpoints=[30], prefill_step=16)
        session.check()
        plan = session.begin()
        session.check()
        assert plan.resume.tokens == 0 and plan.stops == [30, L]
        seen = []
        for progress in session.feed(16):
            assert isinstance(progress, Progress) and progress.total == len(history)
            seen.append(progress.processed)
            session.check()
        assert seen == sorted({*range(16, 30, 16), *range(30, L, 16)})  # chunks end at each stop
        assert session.prefilled and [s.length for s in plan.snaps] == [30, L]
        session.join(0, session.ready(), max_tokens=8)
        session.check()
        emitted = session.step(0)
        session.check()
        rt = session.leave(0)
        session.check()
        assert rt.tokens == history + [t for t, _, _ in emitted] and not session.rows
        nxt = rt.tokens + [5, 6]
        again = Session(BatchDecoder(target, one_row=True), Runtime(target, store=store), nxt)
        assert again.begin().resume.restored == len(rt.tokens)  # prompt + answer, as published
        again.check()


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_a_whole_prompt_computes_logits_at_its_end_only(tmp_path, family):
    """The forwards before the prompt's end evaluate the layers' states and no logits (the last
    layer's attention at every query of a chunk would be wasted, 1.9x the chunk's forward after a
    long context), so the checkpoints inside the prompt hold none, and the prompt's end holds a
    from-scratch forward's logits."""
    prompt, _ = eos_case(family)
    target = model(family)
    history = prompt + [7, 8, 9] * 20
    with open_store(tmp_path / "s") as store:
        session = Session(BatchDecoder(target, one_row=True), Runtime(target, store=store), history,
                          checkpoints=[30], prefill_step=16, whole=True)
        plan = session.begin()
        for _ in session.feed(16):
            pass
        assert [s.length for s in plan.snaps] == [30, len(history) - 1, len(history)]
        assert plan.snaps[0].logits is None and plan.snaps[1].logits is None
        ref = target(mx.array([history]))[:, -1, :]
        assert mx.allclose(plan.snaps[2].logits, ref, atol=1e-4).item()
        assert mx.array_equal(plan.logits, plan.snaps[2].logits).item()
        # a later prompt of exactly all but the last token resumes before it, not from logits it lacks
        again = Session(BatchDecoder(target, one_row=True), Runtime(target, store=store), history[:-1] + [5],
                        whole=True)
        resumed = again.begin().resume
        assert resumed.tokens == len(history) - 1 and resumed.logits is None


def test_the_surfaces_see_progress_unless_told_not_to():
    """A request's `Progress` events reach its HTTP side; the surfaces' event stream passes them
    on (keepalives, pings) unless told not to, as a non-streaming collect is."""
    import asyncio

    from segcache.serve.engine import Usage
    from segcache.serve.pipeline import Run

    def events_of(progress):
        async def main():
            queue = asyncio.Queue()
            for e in (Progress(3, 8), Progress(6, 8), Chunk("hi"), Finish("stop", Usage(8, 1, 0))):
                queue.put_nowait(e)
            run = Run(GenRequest("r", [1] * 8, 4), Job(GenRequest("r", [1] * 8, 4), lambda e: None), queue)
            return [type(e).__name__ async for e in run.events_of(progress=progress)]

        return asyncio.run(main())

    assert events_of(False) == ["Chunk", "Finish"]
    assert events_of(True) == ["Progress", "Progress", "Chunk", "Finish"]


def test_a_batch_rows_last_token_forward_that_fails_fails_its_prompt_only(tmp_path, monkeypatch):
    """A whole session's prompt prefilled as a row of the padded batch feeds its last token alone
    on the row's runtime: a failure there fails that request (publishing nothing of its prompt), as a
    failed batch forward does, and the engine serves the next request as before."""
    family = "qwen3_5"
    prompt, tk = eos_case(family)
    target = model(family)
    prompts = {"a": prompt + [5, 6, 7], "b": prompt[:12] + [9, 9]}
    forward = Runtime.forward

    def failing(rt, tokens, *args, **kwargs):
        if len(tokens) == 1 and list(tokens) == prompts["a"][-1:] and rt.tokens == prompts["a"][:-1]:
            raise RuntimeError("the last token's forward fails")
        return forward(rt, tokens, *args, **kwargs)

    monkeypatch.setattr(Runtime, "forward", failing)
    with open_store(tmp_path / "s") as store:
        engine = Engine(target, tk, store=store, decode_concurrency=3, checkpoint_interval=0, vocab_size=models.VOCAB)
        sched = Scheduler(engine, max_queue=4, max_running=3, begin_step=engine.begin_step)
        events = {rid: [] for rid in prompts}
        for rid, ids in prompts.items():
            sched.submit(Job(GenRequest(rid, list(ids), 8), events[rid].append))
        for _ in range(300):
            if not sched.step():
                break
        assert isinstance(events["a"][-1], Failure) and isinstance(events["b"][-1], Finish)
        ends = {t for _, kind, t in records(store) if kind == "ckpt"}
        assert len(prompts["b"]) in ends and not ends & {len(prompts["a"]) - 1, len(prompts["a"])}  # none of a's
        want = "".join(r.text for r in stream_generate(target, tk, prompts["b"], max_tokens=8))
        assert "".join(e.text for e in events["b"] if isinstance(e, Chunk)) == want
        assert engine._prefilling == 0 and len(engine.decoder) == 0


@pytest.mark.parametrize("concurrency", [1, 3], ids=["alone", "batch"])
def test_a_request_cancelled_mid_prefill_keeps_what_it_computed(tmp_path, concurrency):
    """A client that gives up while its prompt is prefilled (Claude Code after 300 s without a
    content event) leaves the prefix computed so far in the store: its retry resumes there and
    answers as a fresh run does. Alone (chunks on its runtime) and as a PrefillBatch row."""
    target = model("qwen3_5")
    tk = test_tokenizer.tokenizer(eos=False)
    prompt = tk.encode(PROMPT) + [7, 8, 9] * 60
    want = mlx_lm.generate(target, tk, prompt=prompt, max_tokens=4)
    with open_store(tmp_path / "s") as store:
        engine = Engine(target, tk, store=store, decode_concurrency=concurrency, checkpoint_interval=32,
                        prefill_step=32, vocab_size=models.VOCAB)
        sched = Scheduler(engine, max_queue=2, max_running=concurrency, begin_step=engine.begin_step)
        events = []
        job = Job(GenRequest("gone", list(prompt), 4), events.append)
        sched.submit(job)
        for _ in range(100):
            sched.step()
            if any(isinstance(e, Progress) and e.processed >= 100 for e in events):
                break
        fed = max(e.processed for e in events if isinstance(e, Progress))
        assert 64 <= fed < len(prompt) - 1  # cancelled mid-prefill
        job.cancel()
        for _ in range(100):
            if not sched.step():
                break
        assert not any(isinstance(e, Chunk) for e in events)
        kept = max(e.tokens for e in store.entries() if e.kind == "ckpt")
        assert kept == fed  # where it stopped
        again = []
        sched.submit(Job(GenRequest("retry", list(prompt), 4), again.append))
        for _ in range(200):
            if not sched.step():
                break
        assert [e for e in again if isinstance(e, Progress)][0].processed == kept  # resumed there
        assert isinstance(again[-1], Finish)
        assert "".join(e.text for e in again if isinstance(e, Chunk)) == want
