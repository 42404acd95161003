"""The MTP head's segment in the prefix store (segcache.store.drafter_records): a prompt's
drafter pages and boundary state are saved with it and resumed with it (bitwise what a cold
prefill fed in the same blocks builds, against the head on mlx-lm's KVCache), so a prompt
resumed from the store with MTP on runs no forward of its prefix before its first draft (the
first step forwards the prompt's last token alone; a prompt stored whole, none); another head's
records are other keys (the target still resumes, the head is recomputed); a store written
without them, or a record that does not fit, resumes the target and recomputes the head."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import mlx.core as mx
import pytest

from segcache import Runtime, open_store
from segcache import prefill as store_prefill
from segcache.generation import stream_generate
from segcache.mtp import MTPHead
from segcache.mtp.drafter import MTP
from segcache.mtp.module import _text_parts
from segcache.serve.engine import Chunk, Engine, Finish, GenRequest
from segcache.serve.worker import Job, Scheduler
from segcache.session.session import Session
from segcache.store import drafter_records
from segcache.store.record import Record
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from segcache.testing.mtp_machine import mtp_machine_for
from segcache.testing.statemachine import run_machine
from test_mtp_decode import fitted
from test_mtp_state import held, reference, same

P = 16  # tokens a page: prompts span pages and a checkpoint tail
STEP = 8  # prefill blocks
PROMPT = [(t * 5 + 3) % 60 + 2 for t in range(45)]


@pytest.fixture(scope="module", params=("qwen3_next", "qwen3_5"))
def target(request):
    model = models.build(request.param)
    return model, MTPHead.build(model)


def blocks(ids, start=0, step=STEP):
    return [ids[i : min(i + step, len(ids))] for i in range(start, len(ids), step)]


class Calls:
    """Counts the target backbone's forwards (every model call, and the head's recompute, runs it),
    and keeps the positions each fed (`fed`)."""

    def __init__(self, model):
        self.cls = type(_text_parts(model)[1])
        self.n = 0
        self.fed: list[int] = []

    def __enter__(self):
        orig = self.orig = self.cls.__call__

        def counted(module, inputs, *args, **kwargs):
            self.n += 1
            self.fed.append(inputs.shape[1])
            return orig(module, inputs, *args, **kwargs)

        self.cls.__call__ = counted
        return self

    def __exit__(self, *exc):
        self.cls.__call__ = self.orig


def test_resumed_segment_equals_a_cold_prefill_bitwise(target, tmp_path):
    model, head = target
    L = len(PROMPT) - 4
    with open_store(tmp_path / "s", page_tokens=P) as st:
        cold = Runtime(model, store=st, mtp=head)
        cold.prefill(PROMPT[:L], step_size=STEP)
        ref = reference(model, head, blocks(PROMPT[:L]))
        for x, y in zip(held(cold), ref):
            same(x, y)
        kinds = sorted(e.kind for e in st.entries())
        assert kinds.count("dpage") == (L - 1) // P and kinds.count("dckpt") == 1
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st:  # another process: from disk
        rt = Runtime(model, store=st, mtp=head)
        with Calls(model) as calls:
            resume = next(rt.prefill_steps(PROMPT[:L], step_size=STEP))
        assert resume.restored == L and calls.n == 0
        for x, y in zip(held(rt), ref):
            same(x, y)
        rt.check()
        # a longer prompt resumes there and goes on: the blocks it computes feed the head
        more = Runtime(model, store=st, mtp=head)
        more.prefill(PROMPT, step_size=STEP)
        for x, y in zip(held(more), reference(model, head, blocks(PROMPT[:L]) + blocks(PROMPT, L))):
            same(x, y)
        more.check()


def _generate(model, head, store, prompt, n=6):
    tk = test_tokenizer.tokenizer(eos=False)
    rt = Runtime(model, store=store)
    return [r.token for r in stream_generate(model, tk, prompt, max_tokens=n, mtp=head, num_draft_tokens=2,
                                             runtime=rt, prefill_step_size=STEP)]


def _count_before_first_draft(monkeypatch, calls) -> list:
    """A list that gets the positions of the model's calls so far (`calls.fed[-calls.n:]`) when MTP
    first drafts; it holds nothing until then, and is cleared to count again."""
    before_draft = []
    draft = MTP.draft

    def first_draft(self, states, widths):
        if not before_draft:
            before_draft.append(calls.fed[len(calls.fed) - calls.n:])
        return draft(self, states, widths)

    monkeypatch.setattr(MTP, "draft", first_draft)
    return before_draft


def test_a_stored_prompt_with_mtp_runs_no_forward_before_its_first_draft(target, tmp_path, monkeypatch):
    model, head = target
    tk = test_tokenizer.tokenizer(eos=False)
    plain = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6)]
    with open_store(tmp_path / "s", page_tokens=P) as st:
        assert _generate(model, head, st, PROMPT) == plain  # cold: computes and stores the prompt
    calls = Calls(model)
    before_draft = _count_before_first_draft(monkeypatch, calls)
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:
        assert _generate(model, head, st, PROMPT) == plain
    # the head's state came from the store with the target's: before the first draft only the
    # first step's forward of the prompt's last token (which gives the first token), no prefix
    assert before_draft == [[1]]

    # another head: the target's records resume, the head's are other keys (recomputed: the prefix
    # forwarded once more, in the prefill's blocks)
    other = MTPHead.build(model)
    before_draft.clear()
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:
        calls.n = 0
        rt = Runtime(model, store=st, mtp=other)
        # (the whole prompt: the checkpoint at its last token holds no logits, a generation's
        # prefill computed none, so a prefill wanting them of PROMPT[:-1] could not end on it)
        resume = next(rt.prefill_steps(PROMPT, step_size=STEP))
        assert resume.restored == len(PROMPT) - 1 and rt.drafters.get("mtp").stale
        calls.n = 0
        assert _generate(model, other, st, PROMPT) == plain
    assert before_draft == [[len(b) for b in blocks(PROMPT[:-1])] + [1]]


def test_a_prompt_stored_whole_runs_no_forward_before_its_first_token(target, tmp_path, monkeypatch):
    """`whole_prompt`: the prompt's end is checkpointed with its logits (and the head's records), so
    a later generation of it resumes all of it and takes the first token from the stored logits."""
    model, head = target
    tk = test_tokenizer.tokenizer(eos=False)
    plain = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6)]
    calls = Calls(model)
    before_draft = _count_before_first_draft(monkeypatch, calls)
    with open_store(tmp_path / "s", page_tokens=P) as st:  # cold: computes the whole prompt
        for mtp in (head, None):
            rt = Runtime(model, store=st)
            gen = stream_generate(model, tk, PROMPT, max_tokens=6, mtp=mtp, num_draft_tokens=2, runtime=rt,
                                  prefill_step_size=STEP, whole_prompt=True)
            assert [r.token for r in gen] == plain
    for mtp in (head, None):
        before_draft.clear()
        with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:  # from disk
            calls.n = 0
            rt = Runtime(model, store=st)
            gen = stream_generate(model, tk, PROMPT, max_tokens=6, mtp=mtp, num_draft_tokens=2, runtime=rt,
                                  prefill_step_size=STEP, whole_prompt=True)
            first = next(gen)
            assert calls.n == 0 and first.token == plain[0]  # the stored logits: no forward
            assert [first.token] + [r.token for r in gen] == plain
            assert rt.tokens == PROMPT + plain[:-1] or rt.tokens == PROMPT + plain
        if mtp is not None:  # the head resumed with the prompt: the next forward is the first token's
            assert before_draft == [[1]]


def test_a_store_without_drafter_records_resumes_and_recomputes(target, tmp_path):
    model, head = target
    tk = test_tokenizer.tokenizer(eos=False)
    plain = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6)]
    with open_store(tmp_path / "s", page_tokens=P) as st:
        Runtime(model, store=st).prefill(PROMPT[:-1], step_size=STEP)  # published without a head
        assert not [e for e in st.entries() if e.kind.startswith("d")]
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st:
        rt = Runtime(model, store=st, mtp=head)
        # (the whole prompt: the checkpoint at its last token holds no logits, a generation's
        # prefill computed none, so a prefill wanting them of PROMPT[:-1] could not end on it)
        resume = next(rt.prefill_steps(PROMPT, step_size=STEP))
        assert resume.restored == len(PROMPT) - 1 and rt.drafters.get("mtp").stale
        rt.check()
        assert _generate(model, head, st, PROMPT) == plain


def test_a_drafter_record_that_does_not_fit_is_dropped_never_served(target, tmp_path):
    model, head = target
    L = 40
    with open_store(tmp_path / "s", page_tokens=P) as st:
        rt = Runtime(model, store=st, mtp=head)
        rt.prefill(PROMPT[:L], step_size=STEP)
        pc = rt.prefix_cache()
        ix = pc._prompt(rt, PROMPT[:L])
        seg = rt.drafters.get("mtp")
        key = drafter_records.ckpt_key(ix, seg, L)
        good = st.get(key)
        bad = dict(good.arrays, hidden=mx.zeros((1, 2, good.arrays["hidden"].shape[2])))
        st.delete(key)
        st.put(key, Record("dckpt", L, bad, dict(good.meta), good.cost, good.parent))
        again = Runtime(model, store=st, mtp=head)
        resume = next(again.prefill_steps(PROMPT[:L], step_size=STEP))
        assert resume.restored == L and again.drafters.get("mtp").stale
        assert not st.contains(key)
        again.check()


def serve_once(model, head, tk, st, prompt, max_tokens):
    """One request through the server's engine with MTP (rows batched, 2 drafts a round) on store
    `st`, run to its end."""
    engine = Engine(model, tk, store=st, decode_concurrency=3, checkpoint_interval=0, vocab_size=models.VOCAB,
                    mtp=head, num_draft_tokens=2)
    sched = Scheduler(engine, max_queue=2, max_running=3, begin_step=engine.begin_step)
    events = []
    sched.submit(Job(GenRequest("x", list(prompt), max_tokens), events.append))
    for _ in range(200):
        if not sched.step():
            break
    assert isinstance(events[-1], Finish)


def test_a_prompt_the_engine_prefilled_in_a_padded_batch_stores_the_heads_state(target, tmp_path, monkeypatch):
    model, head = target
    joined = []
    join_batch = Session.join_batch
    monkeypatch.setattr(Session, "join_batch", lambda self, *a: (joined.append(1), join_batch(self, *a)))
    tk = test_tokenizer.tokenizer(eos=False)
    plain = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6)]
    with open_store(tmp_path / "s", page_tokens=P) as st:
        serve_once(model, head, tk, st, PROMPT, 6)
        assert joined == [1]  # it was prefilled as a row of the padded batch
        ends = sorted(e.tokens for e in st.entries() if e.kind == "dckpt")
        # the prompt's two ends (but its last token, and whole: the server's sessions are whole), and
        # the answer's end (6 fed)
        assert ends == [len(PROMPT) - 1, len(PROMPT), len(PROMPT) + 6 - 1 + 1]
    calls = Calls(model)
    before_draft = _count_before_first_draft(monkeypatch, calls)
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:
        assert _generate(model, head, st, PROMPT) == plain
    assert before_draft == [[1]]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_mtp_state_machine(family):
    """Random joins (resumed from the store), steps, settles, failed rounds and leaves of MTP rows."""
    machine = mtp_machine_for(*fitted(family))
    run_machine(machine, examples=6, steps=14)
    done = machine.stats
    assert done.get("head resumed") and done.get("accepted a draft") and done.get("settled"), done
    assert done.get("failed draft"), done


class _Ranks:
    """The other ranks as `ranks.Agreement` reports them: they found the same resume; the second
    `restored` call (the drafters') answers `drafters` for them."""

    def __init__(self, drafters: bool):
        self.drafters, self.calls = drafters, []

    def resume(self, held, tokens, stops):
        return tokens, tuple(stops)

    def restored(self, ok):
        self.calls.append(ok)
        return ok if len(self.calls) == 1 else ok and self.drafters


def test_across_ranks_the_head_resumes_on_every_rank_or_on_none(target, tmp_path):
    model, head = target
    L = len(PROMPT) - 1
    with open_store(tmp_path / "s", page_tokens=P) as st:
        Runtime(model, store=st, mtp=head).prefill(PROMPT[:L], step_size=STEP)
        for others, live in ((True, True), (False, False)):
            rt = Runtime(model, store=st, mtp=head)
            ranks = _Ranks(others)
            plan = store_prefill.begin(rt, PROMPT[:L], 0, agree=ranks)
            assert plan.resume.restored == L and ranks.calls == [True, True]
            assert rt.drafters.get("mtp").stale is not live
            rt.check()


def serve_counted(model, head, tk, st, prompt, max_tokens, concurrency, calls):
    """One request through the engine (MTP with `head`, or plain: None) on store `st`: (its text,
    its usage, the target's forwards counted when its first chunk came)."""
    engine = Engine(model, tk, store=st, decode_concurrency=concurrency, checkpoint_interval=0,
                    vocab_size=models.VOCAB, mtp=head, num_draft_tokens=2 if head is not None else 4)
    sched = Scheduler(engine, max_queue=2, max_running=concurrency, begin_step=engine.begin_step)
    events, first = [], []

    def deliver(event):
        if isinstance(event, Chunk) and not first:
            first.append(calls.n)
        events.append(event)

    calls.n = 0
    sched.submit(Job(GenRequest("x", list(prompt), max_tokens), deliver))
    for _ in range(200):
        if not sched.step():
            break
    assert isinstance(events[-1], Finish)
    return "".join(e.text for e in events if isinstance(e, Chunk)), events[-1].usage, first[0]


@pytest.mark.parametrize("concurrency", [1, 3], ids=["one-row", "batched"])
def test_a_prompt_the_server_stored_whole_runs_no_forward_before_its_first_token(target, tmp_path, concurrency):
    """The server's sessions are whole: a prompt it served once is stored with its end's logits (and
    the head's records), so served again after a restart (from disk) it runs no target forward before
    its first token, with MTP and without, and answers as plain greedy decoding."""
    model, head = target
    tk = test_tokenizer.tokenizer(eos=False)
    plain = tk.decode([r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6)])
    calls = Calls(model)
    for mtp in (head, None):
        with open_store(tmp_path / f"s{mtp is None}", page_tokens=P) as st, calls:  # cold: computed, published
            text, usage, before = serve_counted(model, mtp, tk, st, PROMPT, 6, concurrency, calls)
            assert text == plain and usage.cached_tokens == 0 and before > 0
            ends = {e.tokens for e in st.entries() if e.kind == "ckpt"}
            assert {len(PROMPT) - 1, len(PROMPT)} <= ends  # both ends of the prompt
        with open_store(tmp_path / f"s{mtp is None}", page_tokens=P, ram_bytes=0) as st, calls:  # restarted
            text, usage, before = serve_counted(model, mtp, tk, st, PROMPT, 6, concurrency, calls)
            assert text == plain and usage.cached_tokens == len(PROMPT)
            assert before == 0, mtp  # the stored logits gave the first token
