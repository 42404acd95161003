"""`segcache serve --decode-concurrency N`: a joining prompt is prefilled in chunks, one per
scheduler step, while the running rows decode between them (serve/engine.py). Driven
in-process through the Scheduler, so steps are counted, never timed."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import math

import mlx_lm
import pytest

from segcache import Runtime, open_store
from segcache.serve.engine import Chunk, Engine, Finish, GenRequest, Progress
from segcache.store import Resume
from segcache.serve.worker import Job, Scheduler
from segcache.session.session import prompt_checkpoints
from serve_util import TARGET

TEXT = open(TARGET.parent / "heldout_stdlib.txt").read()
CHUNK = 64


@pytest.fixture(scope="module")
def loaded():
    return mlx_lm.load(str(TARGET))


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded[1]
    return {
        "a": tok.encode(TEXT[:300]),
        "long": tok.encode(TEXT[5000:7400]),  # ~1,000 tokens: many chunks of CHUNK
        "c": tok.encode(TEXT[9000:9250]),
    }


def _prefilled_alone(model, store, engine, ids):
    """What a server's whole-prompt session publishes for `ids` (session.py): `Runtime.prefill` of
    the whole prompt, checkpointed at the request's positions and at both of the prompt's ends."""
    checkpoints = prompt_checkpoints((), len(ids), engine.checkpoint_interval) + [len(ids) - 1]
    Runtime(model, store=store).prefill(ids, checkpoints=checkpoints)


def _alone(loaded, ids, n):
    model, tok = loaded
    return mlx_lm.generate(model, tok, prompt=ids, max_tokens=n)


class Harness:
    """An Engine of 4 rows under a Scheduler, stepped by hand; per step the engine's counters."""

    def __init__(self, loaded, store=None, prompt_concurrency=1):
        model, tok = loaded
        self.engine = Engine(model, tok, decode_concurrency=4, prompt_concurrency=prompt_concurrency,
                             store=store)
        self.engine.prefill_chunk = CHUNK
        self.sched = Scheduler(self.engine, max_running=4, begin_step=self.engine.begin_step)
        self.events: dict[str, list] = {}  # Chunks and Finishes
        self.progress: dict[str, list] = {}  # Progress events, apart: they say nothing of the output
        self.jobs: dict[str, Job] = {}
        self.trace = []  # (decode_steps, prefill_chunks) after each scheduler step

    def submit(self, rid, ids, max_tokens):
        self.events[rid], self.progress[rid] = [], []

        def deliver(event):
            (self.progress if isinstance(event, Progress) else self.events)[rid].append(event)

        self.jobs[rid] = job = Job(GenRequest(rid, list(ids), max_tokens), deliver)
        self.sched.submit(job)
        return job

    def step(self):
        self.sched.step()
        self.trace.append((self.engine.decode_steps, self.engine.prefill_chunks))

    def text(self, rid):
        return "".join(e.text for e in self.events[rid] if isinstance(e, Chunk))

    def finish(self, rid):
        return next((e for e in self.events[rid] if isinstance(e, Finish)), None)

    def until(self, cond, limit=500):
        for _ in range(limit):
            if cond():
                return
            self.step()
        raise AssertionError(f"condition not reached after {limit} steps")

    def run(self, limit=2000):
        for _ in range(limit):
            if not self.sched.pending():
                return
            self.step()
        raise AssertionError(f"not done after {limit} steps: {self.sched.pending()} jobs pending")


def _chunks(n_tokens):
    return math.ceil(n_tokens / CHUNK)


def test_long_prompt_joins_in_chunks_between_decode_steps_and_every_row_is_exact(loaded, prompts):
    h = Harness(loaded)
    h.submit("a", prompts["a"], 48)
    h.until(lambda: h.events["a"])  # a is decoding
    start = len(h.trace)
    h.submit("long", prompts["long"], 8)
    h.submit("c", prompts["c"], 8)  # waits for the prefill slot (prompt concurrency 1)
    h.run()
    # every row token-identical to the request served alone
    for rid, n in (("a", 48), ("long", 8), ("c", 8)):
        assert h.text(rid) == _alone(loaded, prompts[rid], n), rid
    trace = h.trace[start - 1 :]
    steps = [(d1 - d0, c1 - c0) for (d0, c0), (d1, c1) in zip(trace, trace[1:])]
    want = _chunks(len(prompts["long"]) - 1) + _chunks(len(prompts["c"]) - 1)
    assert sum(c for _, c in steps) == want
    # one chunk per scheduler step at most (prompt concurrency 1), and a decode step of the
    # running rows in every step that fed a chunk: between any two chunks a decodes
    assert all(c <= 1 for _, c in steps)
    assert all(d == 1 for d, c in steps if c)
    assert len(h.events["a"]) > 1 + want // 2  # a kept streaming while the long prompt joined
    # the joining prompt told its progress: where it resumed, then after each chunk but the last
    n, total = len(prompts["long"]) - 1, len(prompts["long"])  # fed by the prefill; the prompt's length
    assert [(p.processed, p.total) for p in h.progress["long"]] == \
        [(0, total)] + [(min(k * CHUNK, n), total) for k in range(1, _chunks(n))]


def test_cancel_mid_prefill_frees_the_slot_the_runtime_and_keeps_only_what_it_computed(loaded, prompts, tmp_path):
    with open_store(tmp_path / "store") as store:
        h = Harness(loaded, store=store)
        h.submit("a", prompts["a"], 40)
        h.until(lambda: h.events["a"])
        prefills = store.stats()["prefills"]
        job = h.submit("long", prompts["long"], 8)
        chunks = h.engine.prefill_chunks
        h.until(lambda: h.engine.prefill_chunks >= chunks + 3)
        assert h.engine._prefilling == 1
        before = {(e.key, e.tokens) for e in store.entries() if e.kind == "ckpt"}
        job.cancel()
        h.step()
        assert job not in h.sched.running
        assert h.engine._prefilling == 0
        assert "long" not in h.engine._buffers and "long" not in h.engine.decoder.rows
        assert h.engine.decoder.batch.ids == ["a"]
        # the half-fed prompt is published as far as it was fed (a retry resumes there), no further
        assert store.stats()["prefills"] == prefills + 1
        kept = {(e.key, e.tokens) for e in store.entries() if e.kind == "ckpt"} - before
        assert kept and all(0 < n < len(prompts["long"]) - 1 for _, n in kept)
        # the slot is free: the next prompt is prefilled and served, and a is undisturbed
        h.submit("c", prompts["c"], 8)
        h.run()
        assert h.text("c") == _alone(loaded, prompts["c"], 8)
        assert h.text("a") == _alone(loaded, prompts["a"], 40)
        assert [e for e in h.events["long"] if not isinstance(e, Progress)] == []  # its prefill's progress only
        assert len(h.engine.decoder) == 0 and h.engine._buffers == {} and h.engine._prefilling == 0


def test_chunk_joined_prompt_publishes_as_runtime_prefill_and_resumes_from_the_store(loaded, prompts, tmp_path):
    model = loaded[0]
    with open_store(tmp_path / "served") as served, open_store(tmp_path / "alone") as alone:
        h = Harness(loaded, store=served, prompt_concurrency=2)
        h.submit("a", prompts["a"], 200)
        h.until(lambda: h.events["a"])
        chunks = h.engine.prefill_chunks
        h.submit("long", prompts["long"], 8)
        h.until(lambda: "long" in h.engine.decoder.rows)
        assert h.engine.prefill_chunks - chunks == _chunks(len(prompts["long"]) - 1)  # it came in chunks
        # what the chunked prefills published is what Runtime.prefill publishes (a still runs)
        for rid in ("a", "long"):
            _prefilled_alone(model, alone, h.engine, prompts[rid])
        assert sorted((e.key, e.kind, e.tokens) for e in served.entries()) == sorted(
            (e.key, e.kind, e.tokens) for e in alone.entries())
        n = len(prompts["long"]) - 1
        grid = set(range(256, n, 256)) | {n}  # the checkpoint interval and the prompt's end
        assert grid <= {e.tokens for e in served.entries() if e.kind == "ckpt"}
        h.run()
        assert h.finish("long").usage.cached_tokens == 0
        # the same prompt again, and one that extends it, resume from what the chunked join stored
        more = prompts["long"] + prompts["c"]
        h.submit("again", prompts["long"], 8)
        h.submit("more", more, 8)
        h.run()
        assert h.finish("again").usage.cached_tokens == len(prompts["long"])  # whole, with its last logits
        assert h.finish("more").usage.cached_tokens >= len(prompts["long"]) - 1
        assert h.text("again") == _alone(loaded, prompts["long"], 8)
        assert h.text("more") == _alone(loaded, more, 8)


def test_prefill_steps_yield_the_resume_then_between_forwards_and_end_as_prefill(loaded, prompts, tmp_path):
    model = loaded[0]
    ids = prompts["long"]
    with open_store(tmp_path / "a") as a, open_store(tmp_path / "b") as b:
        want = Runtime(model, store=a).prefill(ids, step_size=100, checkpoints=[150])
        rt = Runtime(model, store=b)
        steps = rt.prefill_steps(ids, step_size=100, checkpoints=[150])
        seen = []
        while True:
            try:
                seen.append(next(steps))
            except StopIteration as stop:
                got = stop.value
                break
        # resume (nothing stored), then before each forward but the first: chunks end at 100, 150, 250, ...
        fed = sorted({*range(100, 150, 100), *range(150, len(ids), 100)})
        assert seen == [Resume(0, 0, "-")] + fed
        assert (got == want).all().item()
        assert sorted((e.key, e.kind, e.tokens) for e in a.entries()) == sorted(
            (e.key, e.kind, e.tokens) for e in b.entries())
        again = Runtime(model, store=b).prefill_steps(ids + [1])
        assert next(again) == Resume(len(ids), len(ids), "ram")  # the first step resumes from the store, from RAM
        again.close()  # stopped there: nothing more fed, nothing published
        assert b.stats()["prefills"] == 1


def test_cold_prompts_arriving_together_are_prefilled_in_shared_forwards(loaded, prompts, tmp_path):
    """Several prompts joining at once advance together, one forward per scheduler step for all of
    them (each row feeds up to its next stop, shorter rows padded with per-row masks): the
    forwards mlx-lm's BatchGenerator takes for them (ceil(longest / width), here one; equal
    counts took one per distinct length), each answer as the request alone, and the store holds
    what each prompt's own `Runtime.prefill` would have published."""
    model, tok = loaded
    texts = [TEXT[i * 700 : i * 700 + 400 + 60 * i] for i in range(4)]
    ids = {f"p{i}": tok.encode(t) for i, t in enumerate(texts)}
    with open_store(tmp_path / "served") as served, open_store(tmp_path / "alone") as alone:
        h = Harness(loaded, store=served, prompt_concurrency=4)
        sizes = []
        step = h.engine.prefill_batch.step
        h.engine.prefill_batch.step = lambda budget: (sizes.append((len(h.engine.prefill_batch), budget)), step(budget))[1]
        for rid, p in ids.items():
            h.submit(rid, p, 12)
        h.run()
        for rid, p in ids.items():
            assert h.text(rid) == _alone(loaded, p, 12), rid
        # nothing decoded while they all joined: the first forward took them together, unstalled
        assert sizes[0] == (len(ids), h.engine.prefill_step)
        width = h.engine.prefill_step // len(ids)
        assert len({len(p) for p in ids.values()}) == len(ids)  # of different lengths,
        assert max(len(p) - 1 for p in ids.values()) < min(width, h.engine.checkpoint_interval)  # no stop before
        assert h.engine.prefill_chunks == len(sizes) == math.ceil(max(len(p) - 1 for p in ids.values()) / width)
        for p in ids.values():
            _prefilled_alone(model, alone, h.engine, p)
        # (the served store holds the finished requests' prompt + answer records too)
        assert {(e.key, e.kind, e.tokens) for e in alone.entries() if e.kind != "node"} <= {
            (e.key, e.kind, e.tokens) for e in served.entries()}


def test_a_prefill_forward_stalls_decoding_rows_one_chunk_per_joining_prompt_at_most(loaded, prompts):
    """While rows decode, a forward of the prefill batch feeds at most `prefill_chunk` tokens per
    prompt joining (each advances as if fed alone, one chunk per scheduler step; the running rows'
    stall is those chunks in one forward), and prompts joining together share it."""
    h = Harness(loaded, prompt_concurrency=3)
    h.submit("a", prompts["a"], 60)
    h.until(lambda: h.events["a"])
    fed = []
    step = h.engine.prefill_batch.step

    def counting(budget):
        joining = len(h.engine.prefill_batch)
        before = sum(h.engine.prefill_batch.batch.lengths)
        out = step(budget)
        fed.append((len(h.engine.decoder), joining, sum(h.engine.prefill_batch.batch.lengths) + sum(
            r.position for r in out if r.done) - before))
        return out

    h.engine.prefill_batch.step = counting
    for rid, p in (("long", prompts["long"]), ("c", prompts["c"]), ("d", prompts["a"][:150])):
        h.submit(rid, p, 6)
    h.run()
    assert fed and all(n <= CHUNK * joining for rows, joining, n in fed if rows)
    assert any(n > CHUNK for rows, joining, n in fed if rows)  # several joining: more than one chunk
    for rid, p in (("long", prompts["long"]), ("c", prompts["c"]), ("d", prompts["a"][:150])):
        assert h.text(rid) == _alone(loaded, p, 6), rid


def test_a_lone_prompt_is_fed_on_its_own_runtime_and_publishes_as_runtime_prefill(loaded, prompts, tmp_path):
    """Alone at a decode concurrency above 1, a prompt is fed on its own Runtime: the prefill
    batch's rows never hold it (nothing copied into the batch or out of it at its stops), and it
    answers and publishes what its own `Runtime.prefill` would."""
    model, tok = loaded
    p = prompts["long"][:300]  # a checkpoint at 256 on the way
    with open_store(tmp_path / "served") as served, open_store(tmp_path / "alone") as alone:
        h = Harness(loaded, store=served)
        batch, copies = h.engine.prefill_batch.batch, []
        for name in ("join", "to_runtime"):
            setattr(batch, name, lambda *a, f=getattr(batch, name), name=name: (copies.append(name), f(*a))[1])
        h.submit("a", p, 6)
        h.run()
        assert len(prompt_checkpoints((), len(p), h.engine.checkpoint_interval)) >= 1
        assert h.engine.prefill_chunks >= 2  # it stopped on its way
        assert copies == [] and h.text("a") == _alone(loaded, p, 6)
        _prefilled_alone(model, alone, h.engine, p)
        assert {(e.key, e.kind, e.tokens) for e in alone.entries() if e.kind != "node"} <= {
            (e.key, e.kind, e.tokens) for e in served.entries()}


def test_a_prompt_fed_alone_while_no_row_decodes_takes_whole_steps_and_chunks_once_one_does(loaded, prompts, tmp_path):
    """Beside a batch decoder, a mostly restored prompt is fed alone, cut in `prefill_chunk`s only
    while rows decode between them: with none decoding its rest goes in `prefill_step` forwards (an
    agent's next turn in one, not two). Both exact."""
    long = prompts["long"]
    left = len(long) - 600

    def next_turn(decoding: bool):
        with open_store(tmp_path / f"s{decoding}") as store:
            h = Harness(loaded, store=store)
            h.engine.prefill_step = 4 * CHUNK
            h.submit("turn1", long[:600], 4)
            h.run()
            if decoding:
                h.submit("other", prompts["a"], 200)
                h.until(lambda: h.events["other"])
            before = h.engine.prefill_chunks
            h.submit("turn2", long, 8)
            h.run()
            assert h.text("turn2") == _alone(loaded, long, 8)
            assert h.progress["turn2"][0].processed >= 600  # resumed: fed alone, not in the prefill batch
            return h.engine.prefill_chunks - before

    alone, beside = next_turn(False), next_turn(True)
    assert alone <= math.ceil(left / (4 * CHUNK)) + 1 < math.ceil(left / CHUNK) <= beside
