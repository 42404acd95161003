"""The one request engine (serve/engine.py), driven in-process through the Scheduler on the
shipped target: no request changes what another gets (a failing sampler, seeds, batching), and
what a request delivered is what it publishes."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import mlx_lm
import pytest

from segcache import open_store
from segcache.controls import Controls
from segcache.sampling import Sampler
from segcache.serve.engine import Chunk, Engine, Failure, Finish, GenRequest
from segcache.serve.worker import Job, Scheduler
from serve_util import TARGET

TEXT = open(TARGET.parent / "heldout_stdlib.txt").read()


@pytest.fixture(scope="module")
def loaded():
    return mlx_lm.load(str(TARGET))


def serve(loaded, requests, *, concurrency=4, store=None, **kwargs):
    """Run `requests` (GenRequests) through a fresh engine; returns {id: (text, last event)}."""
    model, tok = loaded
    engine = Engine(model, tok, store=store, decode_concurrency=concurrency, **kwargs)
    sched = Scheduler(engine, max_queue=len(requests), max_running=concurrency, begin_step=engine.begin_step)
    events = {r.id: [] for r in requests}
    for r in requests:
        sched.submit(Job(r, events[r.id].append))
    for _ in range(5000):
        if not sched.step():
            break
    assert not sched.pending() and len(engine.decoder) == 0
    return {rid: ("".join(e.text for e in ev if isinstance(e, Chunk)), ev[-1]) for rid, ev in events.items()}


def sampled(rid, prompt, seed, **kw):
    return GenRequest(rid, prompt, 12, temperature=1.0, top_p=0.9, seed=seed, **kw)


class Broken(Sampler):
    """A sampler that raises while a step is built (as a filter given an impossible value would)."""

    def sample(self, logprobs, keys):
        keys.next()  # it drew from its stream before failing
        raise ValueError("this sampler cannot sample")


@pytest.mark.parametrize("concurrency", (1, 4))
def test_a_failing_sampler_fails_its_request_only_and_changes_nothing_later(loaded, concurrency, monkeypatch):
    tok = loaded[1]
    prompt = tok.encode(TEXT[:200])
    made = Controls.sampler
    monkeypatch.setattr(Controls, "sampler",
                        lambda self, tok: Broken(self.temperature) if self.temperature == 1.25 else made(self, tok))
    bad = GenRequest("bad", prompt, 12, temperature=1.25)
    seeded = [sampled(f"s{i}", prompt, seed=i) for i in range(3)]
    unseeded = [sampled(f"u{i}", prompt, seed=None) for i in range(3)]
    got = serve(loaded, [bad, *seeded[:1], *unseeded[:1]] + seeded[1:] + unseeded[1:], concurrency=concurrency)
    assert isinstance(got["bad"][1], Failure)
    for r in seeded + unseeded:
        assert isinstance(got[r.id][1], Finish), r.id
    # the seeded requests draw what they draw on a fresh engine, alone and in a batch
    fresh = serve(loaded, [sampled(f"s{i}", prompt, seed=i) for i in range(3)], concurrency=1)
    assert [got[f"s{i}"][0] for i in range(3)] == [fresh[f"s{i}"][0] for i in range(3)]
    assert len({got[f"s{i}"][0] for i in range(3)}) > 1  # they sampled


def test_seeded_rows_draw_the_same_alone_and_batched_with_any_neighbours(loaded):
    tok = loaded[1]
    prompts = [tok.encode(TEXT[i * 300 : i * 300 + 200]) for i in range(4)]
    alone = {i: serve(loaded, [sampled("r", prompts[i], seed=40 + i)], concurrency=1)["r"][0] for i in range(4)}
    batched = serve(loaded, [sampled(f"r{i}", prompts[i], seed=40 + i) for i in range(4)], concurrency=4)
    assert {i: batched[f"r{i}"][0] for i in range(4)} == alone


@pytest.mark.parametrize("concurrency", (1, 3))
@pytest.mark.parametrize("drafting", ({}, {"prompt_lookup": True}), ids=("plain", "lookup"))
def test_a_stop_string_inside_a_round_publishes_what_was_delivered(loaded, tmp_path, concurrency, drafting):
    """A stop string ends a request inside a step's tokens: the published prefix is prompt + the
    tokens the client took (the one that completes the stop included), never a token past it."""
    model, tok = loaded
    prompt = tok.encode(TEXT[1000:1300])
    whole = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=40)
    cut = len(whole) // 2
    stop = whole[cut : cut + 3]
    assert stop.strip() and whole.find(stop) == cut
    with open_store(tmp_path / "s") as store:
        got = serve(loaded, [GenRequest("x", prompt, 40, stops=[stop])], concurrency=concurrency, store=store,
                    **drafting)
        text, finish = got["x"]
        assert text == whole[:cut] and finish.reason == "stop"
        # every published checkpoint is of a prefix of prompt + the delivered tokens
        delivered = finish.usage.completion_tokens
        ends = [e.tokens for e in store.entries() if e.kind == "ckpt"]
        assert max(ends) == len(prompt) + delivered, (ends, len(prompt), delivered)


def choices_of(loaded, req, concurrency, **kwargs):
    """{index: text} of a request with n choices, and its Finish events."""
    model, tok = loaded
    engine = Engine(model, tok, decode_concurrency=concurrency, **kwargs)
    sched = Scheduler(engine, max_running=concurrency, begin_step=engine.begin_step)
    events = []
    sched.submit(Job(req, events.append))
    for _ in range(5000):
        if not sched.step():
            break
    texts = {}
    for e in events:
        if isinstance(e, Chunk):
            texts[e.index] = texts.get(e.index, "") + e.text
    finishes = [e for e in events if isinstance(e, Finish)]
    return texts, finishes, engine


@pytest.mark.parametrize("concurrency", (1, 4))
def test_n_choices_share_one_prefill_and_each_draws_its_own_seeded_stream(loaded, concurrency, tmp_path):
    tok = loaded[1]
    prompt = tok.encode(TEXT[2000:2400])
    req = lambda: GenRequest("n", prompt, 16, temperature=1.0, seed=11, n=4)  # noqa: E731
    with open_store(tmp_path / "s") as store:
        texts, finishes, engine = choices_of(loaded, req(), concurrency, store=store)
        assert store.stats()["prefills"] == 1  # the prompt was prefilled (and published) once
    assert sorted(texts) == [0, 1, 2, 3] and sorted(f.index for f in finishes) == [0, 1, 2, 3]
    assert [f.last for f in finishes].count(True) == 1 and finishes[-1].last
    assert all(f.usage.prompt_tokens == len(prompt) for f in finishes)
    assert len(set(texts.values())) > 1  # independent samples
    again, _, _ = choices_of(loaded, req(), 4 if concurrency == 1 else 1)  # the other mode, no store
    assert again == texts  # every choice reproducible from the seed, batched or one after another
    alone = serve(loaded, [GenRequest("one", prompt, 16, temperature=1.0, seed=11)], concurrency=1)["one"][0]
    assert texts[0] == alone  # choice 0 draws what a request of one choice with that seed draws


def test_controls_reach_the_round_and_greedy_speculation_keeps_them(loaded):
    """A request's penalties and bias (Controls) apply at every position the target computes,
    speculative or not: the text equals plain greedy decoding with those processors."""
    from segcache.processors import make_processors
    from segcache.testing.decode import plain_decode

    model, tok = loaded
    prompt = tok.encode("import os\nimport sys\n\ndef main(argv):\n    ")
    fields = dict(repetition_penalty=1.3, repetition_context_size=16, presence_penalty=0.5, logit_bias={"17": 3.0})
    want, _ = plain_decode(model, prompt, max_tokens=32, eos=tok.eos_token_ids,
                           processors=make_processors(vocab_size=1536, repetition_penalty=1.3,
                                                      repetition_context_size=16, presence_penalty=0.5,
                                                      logit_bias={17: 3.0}))
    detok = tok.detokenizer  # as the engine streams it
    for t in want:
        if t in tok.eos_token_ids:
            break
        detok.add_token(t)
    detok.finalize()
    want_text = detok.text
    plain_text = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=32)
    assert want_text != plain_text  # the controls change the text
    for concurrency, drafting in ((1, {}), (1, {"prompt_lookup": True}), (3, {"prompt_lookup": True})):
        got = serve(loaded, [GenRequest("c", prompt, 32, controls=Controls(**fields))],
                    concurrency=concurrency, **drafting)["c"][0]
        assert got == want_text, (concurrency, drafting)


@pytest.mark.parametrize("concurrency", (1, 3))
def test_an_ended_rows_last_text_goes_out_before_it_leaves_and_its_finish_after(loaded, tmp_path, concurrency):
    """The last text of a request that ended is sent while its row is still in the decoder (its
    leave: a forward, the publish, keeping it hot, costs a decode step or more at long context);
    its Finish only once it left, was kept hot and published, and no other request's event comes
    between the two. The texts are mlx-lm's own greedy ones."""
    from segcache.serve.hot import HotRuntimes

    model, tok = loaded
    prompts = [tok.encode(TEXT[3000 + 400 * i : 3300 + 400 * i]) for i in range(2)]
    wanted = [mlx_lm.generate(model, tok, prompt=p, max_tokens=n) for p, n in zip(prompts, (6, 14))]
    with open_store(tmp_path / "s") as store:
        engine = Engine(model, tok, store=store, decode_concurrency=concurrency, hot=HotRuntimes(4))
        sched = Scheduler(engine, max_running=concurrency, begin_step=engine.begin_step)
        seen = []  # (request, event, rows in the decoder, hot runtimes kept) as each event arrives

        def deliver(rid):
            return lambda e: seen.append((rid, e, len(engine.decoder), engine.hot.kept))

        for i, (p, n) in enumerate(zip(prompts, (6, 14))):
            sched.submit(Job(GenRequest(f"r{i}", p, n), deliver(f"r{i}")))
        for _ in range(5000):
            if not sched.step():
                break
        for i, rid in enumerate(("r0", "r1")):
            mine = [(k, e, rows, kept) for k, (r, e, rows, kept) in enumerate(seen) if r == rid]
            assert "".join(e.text for _, e, _, _ in mine if isinstance(e, Chunk)) == wanted[i]
            (k_fin, fin, rows_fin, kept_fin), (k_last, last, rows_last, kept_last) = mine[-1], mine[-2]
            assert isinstance(fin, Finish) and fin.reason == "length" and isinstance(last, Chunk)
            assert k_fin == k_last + 1  # nothing of another request between them
            assert rows_last == rows_fin + 1 and kept_fin == kept_last + 1  # it left in between, kept hot
            # published at the Finish: the whole of prompt + answer resumes from the store
            ends = [e.tokens for e in store.entries() if e.kind == "ckpt"]
            assert len(prompts[i]) + fin.usage.completion_tokens in ends
    # with concurrency 3 both decoded together: r0 ended while r1 still ran
    if concurrency > 1:
        assert [rows for r, e, rows, _ in seen if r == "r0" and isinstance(e, Finish)] == [1]
