"""A DFlash drafter's context segment in the prefix store (store/drafter_records.py, keyed with
the drafter's identity): saved with the prompt and resumed with it bitwise equal to a cold
prefill's, so a prompt resumed from the store drafts its first block with no forward of its
prefix; another drafter's records are other keys (the target resumes, the context is recomputed).
DFlash and DFlash2 drafters alike (their context segments are one kind). Through the server's
padded prefill batch (session/hidden.py carry_segment) and its hot conversations (the row's
context handed back at release) the segment goes on with the prompt, so a row joins with no
forward of its context."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import mlx.core as mx
import pytest

from segcache import Runtime, open_store
from segcache.dflash import ContextSegment
from segcache.dflash.drafter import DFlash
from segcache.generation import stream_generate
from segcache.serve.engine import Chunk, Engine, Finish, GenRequest
from segcache.serve.hot import HotRuntimes
from segcache.serve.worker import Job, Scheduler
from segcache.session.session import Session
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from segcache.testing.dflash import random_drafter
from test_mtp_store import Calls

P, STEP = 16, 8
PROMPT = [(t * 5 + 3) % 60 + 2 for t in range(45)]


@pytest.fixture(scope="module", params=("dflash", "dflash2"))
def target(tmp_path_factory, request):
    model = models.build("qwen3_5")
    return model, random_drafter(model, tmp_path_factory.mktemp("d"), seed=5, layers=2,
                                 dflash2=request.param == "dflash2")


def _state(rt):
    seg = rt.drafters.get("dflash")
    return seg.held, seg.kv.keys[..., : seg.held, :], seg.kv.values[..., : seg.held, :], seg.tail


def _first_draft_calls(monkeypatch, calls) -> list:
    seen = []
    draft = DFlash.draft

    def first(self, states, widths):
        if not seen:
            seen.append(calls.n)
        return draft(self, states, widths)

    monkeypatch.setattr(DFlash, "draft", first)
    return seen


def test_a_resumed_prompt_drafts_its_first_block_with_no_forward(target, tmp_path, monkeypatch):
    model, drafter = target
    L = len(PROMPT) - 1
    tk = test_tokenizer.tokenizer(eos=False)
    plain = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6)]
    with open_store(tmp_path / "s", page_tokens=P) as st:
        cold = Runtime(model, store=st, dflash=drafter)
        cold.prefill(PROMPT[:L], step_size=STEP)
        want = _state(cold)
        kinds = sorted(e.kind for e in st.entries())
        assert kinds.count("dpage") == (L - 1) // P and kinds.count("dckpt") == 1
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st:  # another process: from disk
        rt = Runtime(model, store=st, dflash=drafter)
        with Calls(model) as calls:
            resume = next(rt.prefill_steps(PROMPT[:L], step_size=STEP))
        assert resume.restored == L and calls.n == 0
        got = _state(rt)
        assert got[0] == want[0] == L - 1
        for x, y in zip(got[1:], want[1:]):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item()
        rt.check()
    calls = Calls(model)
    seen = _first_draft_calls(monkeypatch, calls)
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:
        out = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6, dflash=drafter,
                                                runtime=Runtime(model, store=st), prefill_step_size=STEP)]
    assert out == plain and seen == [0]  # the context came from the store with the target's layers

    other = random_drafter(model, tmp_path / "other", seed=6, layers=2)
    seen.clear()
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:
        calls.n = 0
        out = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6, dflash=other,
                                                runtime=Runtime(model, store=st), prefill_step_size=STEP)]
    # the target resumed; the other drafter's context recomputed: the prefix forwarded once more in blocks
    assert out == plain and seen == [-(-(len(PROMPT) - 1) // STEP)]


class Joins:
    """Records, at every `Session.join`, the joining runtime's segment and the target forwards the
    join itself ran (by the session's history)."""

    def __init__(self, monkeypatch, calls):
        self.seen: dict[tuple, tuple] = {}
        join = Session.join

        def recorded(session, row, draft, **kw):
            seg = session.runtime.drafters.get("dflash")
            state = None if seg is None or seg.stale else _state(session.runtime)
            before = calls.n
            join(session, row, draft, **kw)
            self.seen[tuple(session.history)] = (state, calls.n - before)

        monkeypatch.setattr(Session, "join", recorded)


def _serve(engine, requests: dict, sched=None) -> dict:
    sched = sched or Scheduler(engine, max_queue=4, max_running=3, begin_step=engine.begin_step)
    events = {rid: [] for rid in requests}
    for rid, ids in requests.items():
        sched.submit(Job(GenRequest(rid, list(ids), 8), events[rid].append))
    for _ in range(500):
        if not sched.step():
            break
    assert all(isinstance(ev[-1], Finish) for ev in events.values())
    return {rid: "".join(e.text for e in ev if isinstance(e, Chunk)) for rid, ev in events.items()}


def test_a_prompt_prefilled_in_the_padded_batch_carries_its_context(target, monkeypatch):
    """Two cold prompts prefilled together as rows of the engine's padded `PrefillBatch`: each one's
    segment at its join is bitwise what a cold prefill's segment builds from the same forwards' tapped
    outputs in the same blocks (the batch's for its row, pads cut, then the last token's own forward),
    and within the batches' tolerance of a prefill on a Runtime of its own (as the target's layers are,
    test_batch_padded.py); the join runs no forward (the context is not recomputed), and greedy answers
    equal plain decoding's."""
    model, drafter = target
    tk = test_tokenizer.tokenizer(eos=False)
    prompts = {"a": PROMPT, "b": PROMPT[:30] + [7, 9, 11]}
    plain = {rid: tk.decode([r.token for r in stream_generate(model, tk, p, max_tokens=8)]) for rid, p in prompts.items()}
    engine = Engine(model, tk, decode_concurrency=3, dflash=drafter, vocab_size=models.VOCAB, checkpoint_interval=0)
    tap = ContextSegment(drafter).tap
    batch, blocks = engine.prefill_batch, {rid: [] for rid in prompts}  # (tapped rows, count) per forward
    step = batch.step

    def recording(budget):
        rows = list(batch.ids)
        out = step(budget)
        assert len(rows) == 2  # a padded forward of both
        for i, rid in enumerate(rows):
            blocks[rid].append((tap.last[i : i + 1, : batch.fed[rid]], batch.fed[rid]))
        return out

    reached = Session.reached

    def last_forward(session, fed, seconds, stop=None):
        reached(session, fed, seconds, stop)
        if stop is not None and stop.position == len(session.history) - 1:  # then its last token, alone
            rid = next(r for r, p in prompts.items() if p == session.history)
            blocks[rid].append((tap.last, 1))

    batch.step = recording
    monkeypatch.setattr(Session, "reached", last_forward)
    calls = Calls(model)
    joins = Joins(monkeypatch, calls)
    with calls:
        assert _serve(engine, prompts) == plain
    for rid, ids in prompts.items():
        state, forwards = joins.seen[tuple(ids)]
        assert forwards == 0 and state is not None, rid
        assert state[0] == len(ids) - 1
        ref, cold, at = ContextSegment(drafter), Runtime(model, dflash=drafter), 0
        for h, n in blocks[rid]:
            ref.extend(h, ids[at : at + n])
            cold.forward(ids[at : at + n])
            at += n
        assert at == len(ids) and [n for _, n in blocks[rid]][-1] == 1
        want = (ref.held, ref.kv.keys[..., : ref.held, :], ref.kv.values[..., : ref.held, :], ref.tail)
        for x, y in zip(state[1:], want[1:]):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item(), rid
        for x, y in zip(state[1:], _state(cold)[1:]):
            assert mx.abs(x - y).max().item() <= 1e-4, rid


def test_a_hot_conversations_next_turn_joins_with_no_forward_of_its_context(target, monkeypatch):
    """A row released at its end hands its context back to its runtime (as the MTP head's drafter
    does), so the conversation's next turn, on a clone of that hot runtime, joins with its segment:
    no forward recomputes the context; the answer equals plain decoding's."""
    model, drafter = target
    tk = test_tokenizer.tokenizer(eos=False)
    calls = Calls(model)
    joins = Joins(monkeypatch, calls)
    for concurrency in (1, 3):
        engine = Engine(model, tk, decode_concurrency=concurrency, dflash=drafter, vocab_size=models.VOCAB,
                        checkpoint_interval=0, hot=HotRuntimes(4))
        sched = Scheduler(engine, max_queue=4, max_running=concurrency, begin_step=engine.begin_step)
        answer = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=8)]
        assert _serve(engine, {"t1": PROMPT}, sched)["t1"] == tk.decode(answer)
        nxt = PROMPT + answer + [5, 6, 7]  # the conversation's next turn: every delivered token fed
        plain = tk.decode([r.token for r in stream_generate(model, tk, nxt, max_tokens=8)])
        with calls:
            assert _serve(engine, {"t2": nxt}, sched)["t2"] == plain
        state, forwards = joins.seen[tuple(nxt)]
        assert state is not None and forwards == 0, concurrency
        assert state[0] == len(nxt) - 1
