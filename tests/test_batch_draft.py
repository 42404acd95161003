"""Batched speculative rounds with a draft model (a second BatchRuntime): each row's greedy
tokens equal the same request generated alone, rows accept 0, some and all drafts in
one round, rows come and go mid-way, and the sampling rules stay exact per row."""

import random

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler as mlx_sampler

from conftest import tiny
from segcache.acceptors import GreedyMatch, make_acceptor
from segcache.drafters import make_decoder
from segcache.generation import stream_generate
from segcache.runtime import Runtime
from segcache.sampling import Sampler
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from test_batch_decode import MAX, PROMPTS  # the same mixed-length rows (lookup-friendly repeats)

K = 4
# (target, (draft family, seed)): hybrid and dense both ways, and a draft equal to the target
PAIRS = [("qwen3_5", ("llama", 3)), ("llama", ("qwen3_5", 1)), ("qwen3_next", ("qwen3_5", 2)), ("llama", ("llama", 0))]


def alone(model, prompt, n=MAX, **kwargs):
    tk = test_tokenizer.tokenizer(eos=False)
    return [r.token for r in stream_generate(model, tk, prompt, max_tokens=n, **kwargs)]


def start(dec, model, rid, prompt, max_tokens=MAX, **kwargs):
    rt = Runtime(model)
    if len(prompt) > 1:
        rt.forward(prompt[:-1])
    dec.add(rid, rt, prompt[-1], max_tokens=max_tokens, **kwargs)


def run(dec, model, prompts, *, join_at=None, late=(), max_tokens=MAX):
    """Step until every row is done; rows in `late` join after `join_at` steps. Returns tokens per row."""
    got = {i: [] for i in range(len(prompts))}
    waiting = list(late)
    for i in range(len(prompts)):
        if i not in waiting:
            start(dec, model, i, prompts[i], max_tokens)
    steps = 0
    while dec.rows or waiting:
        if steps == join_at:
            for i in waiting:
                start(dec, model, i, prompts[i], max_tokens)
            waiting = []
        for rid, emitted in dec.step().items():
            got[rid].extend(t for t, _, _ in emitted)
            if len(got[rid]) >= max_tokens:
                dec.remove(rid)
        dec.check()
        steps += 1
    return got


@pytest.mark.parametrize("min_prob", (0.0, 0.25))
@pytest.mark.parametrize("target,draft", PAIRS)
def test_each_row_as_alone_with_a_draft_model_joins_and_leaves(target, draft, min_prob):
    model, draft_model = tiny(target), tiny(*draft)
    dec = make_decoder(model, num_draft_tokens=K, draft_model=draft_model, draft_min_prob=min_prob)
    got = run(dec, model, PROMPTS, join_at=2, late=(3, 4))
    for i, p in enumerate(PROMPTS):
        assert got[i] == alone(model, p), f"row {i}"
        # and as the single-sequence speculative generation with the same draft
        assert got[i] == alone(model, p, draft_model=draft_model, num_draft_tokens=K), f"row {i}"
    drafted = sum(s.drafted for s in dec.rows.values())
    assert not dec.rows and drafted == 0  # every row left both batches
    assert not dec.batch.rows and not dec.drafter.rows.rows
    if (target, draft[0], draft[1]) == ("llama", "llama", 0):  # the draft is the target: all accepted
        dec = make_decoder(model, num_draft_tokens=K, draft_model=draft_model, draft_min_prob=min_prob, gate=False)
        for i, p in enumerate(PROMPTS):
            start(dec, model, i, p)
        states = list(dec.rows.values())
        dec.step()
        assert all(s.accepted == s.drafted > 0 for s in states)


def test_rows_finish_early_and_the_rest_continue():
    model = tiny("qwen3_5")
    dec = make_decoder(model, num_draft_tokens=3, draft_model=model, gate=False)  # accepts all: rows near the end draft fewer
    for i in range(3):
        start(dec, model, i, PROMPTS[i], max_tokens=2 + 5 * i)  # near max_tokens rows draft fewer
    got = {i: [] for i in range(3)}
    while dec.rows:
        for rid, emitted in dec.step().items():
            got[rid].extend(t for t, _, _ in emitted)
            assert len(got[rid]) <= 2 + 5 * rid
            if len(got[rid]) == 2 + 5 * rid:
                assert dec.runtime(rid).tokens == PROMPTS[rid] + got[rid]
                dec.remove(rid)
        dec.check()
    for i in range(3):
        assert got[i] == alone(model, PROMPTS[i], 2 + 5 * i)


def _disagreeing_draft(family, z):
    """The target's own weights but token z's embedding: the draft agrees with the target
    exactly until z is fed to it."""
    draft = models.build(family, seed=0)
    emb = draft.language_model.model.embed_tokens if family.startswith("qwen3") else draft.model.embed_tokens
    w = mx.array(emb.weight)
    w[z] = mx.random.normal(w[z].shape, key=mx.random.key(7)) * 3
    emb.weight = w
    mx.eval(draft.parameters())
    return draft


@pytest.mark.parametrize("family", ("qwen3_5", "llama"))
def test_one_round_with_rows_accepting_none_some_and_all(family):
    model = tiny(family)
    rng = random.Random(0)
    cands = []
    for _ in range(60):
        p = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 9))]
        cands.append((p, alone(model, p, K + 1)))
    # z: a token some row's next K-1 target tokens contain, and others' never see
    for z in range(1, 64):
        clean = [p for p, c in cands if z not in p and z not in c]
        some = [(p, c.index(z)) for p, c in cands if z not in p and z in c[: K - 1]]
        if clean and some:
            break
    else:
        pytest.fail("no token to disagree on")
    zero = clean[1] + [z]  # its pending token is z: the draft's first draft comes from the wrong embedding
    prompts = [clean[0], some[0][0], zero]
    dec = make_decoder(model, num_draft_tokens=K, draft_model=_disagreeing_draft(family, z), gate=False)
    for i, p in enumerate(prompts):
        start(dec, model, i, p)
    states = [dec.rows[i] for i in range(3)]
    out = dec.step()
    dec.check()
    assert [s.per_round for s in states] == [[K], [some[0][1] + 1], [0]]
    assert [len(out[i]) for i in range(3)] == [K + 1, some[0][1] + 2, 1]
    got = run_rest(dec, out)
    for i, p in enumerate(prompts):
        assert got[i] == alone(model, p), f"row {i}"


def run_rest(dec, out):
    got = {rid: [t for t, _, _ in em] for rid, em in out.items()}
    while dec.rows:
        for rid, emitted in dec.step().items():
            got[rid].extend(t for t, _, _ in emitted)
            if len(got[rid]) >= MAX:
                dec.remove(rid)
        dec.check()
    return got


@pytest.mark.parametrize("sampler", (Sampler(1.0, top_k=1), mlx_sampler(temp=1.0, top_k=1)),
                         ids=("exact-with-q", "sampler-match"))
def test_sampling_rules_per_row(sampler):
    """top_k=1 sampling is greedy in distribution: with exact speculative sampling (q from
    the draft batch) or the match rule, every row emits the greedy tokens."""
    model, draft_model = tiny("qwen3_5"), tiny("llama", 3)
    dec = make_decoder(model, num_draft_tokens=K, draft_model=draft_model, gate=False)
    for i, p in enumerate(PROMPTS):
        start(dec, model, i, p, acceptor=make_acceptor(sampler) if i % 2 else None)
    got = run_rest(dec, {i: [] for i in range(len(PROMPTS))})
    for i, p in enumerate(PROMPTS):
        assert got[i] == alone(model, p), f"row {i}"


def test_exact_sampling_uses_each_rows_q():
    """With the target as its own draft, exact speculative sampling accepts every draft
    (p == q, so min(1, p/q) = 1) only if each row's q is the distribution its drafts were
    drawn from; a point mass (no q) or another row's q rejects some."""
    model = tiny("llama")
    mx.random.seed(3)
    dec = make_decoder(model, num_draft_tokens=K, draft_model=model, gate=False)
    for i, p in enumerate(PROMPTS):
        start(dec, model, i, p, acceptor=make_acceptor(Sampler(1.5)))
    states = list(dec.rows.values())
    run_rest(dec, {i: [] for i in range(len(PROMPTS))})
    assert sum(s.drafted for s in states) >= 3 * len(PROMPTS)
    assert all(s.accepted == s.drafted for s in states), [(s.accepted, s.drafted) for s in states]


def test_draft_runtime_prefix_is_caught_up_and_a_wrong_one_refused():
    model, draft_model = tiny("qwen3_5"), tiny("llama", 3)
    dec = make_decoder(model, num_draft_tokens=K, draft_model=draft_model, gate=False)
    p = PROMPTS[0]
    drt = Runtime(draft_model)
    drt.forward(p[:4])  # a prefix, e.g. resumed from the prefix store
    start(dec, model, 0, p, draft_runtime=drt)
    assert dec.drafter.rows.tokens(0) == p[:4]  # the rest is fed when the row first drafts
    wrong = Runtime(draft_model)
    wrong.forward([9, 9])
    with pytest.raises(ValueError, match="not a prefix"):
        start(dec, model, 1, PROMPTS[1], draft_runtime=wrong)
    assert dec.batch.ids == [0] and dec.drafter.rows.ids == [0]  # the refused row changed nothing
    first = dec.step()[0]
    assert dec.drafter.rows.tokens(0)[: len(p) - 1] == p[:-1]  # caught up in its first round
    got = run_rest(dec, {0: first})
    assert got[0] == alone(model, p)


def test_shipped_models_each_row_as_mlx_lm_alone():
    """The shipped hybrid target with the shipped draft, rows joining mid-way: each row's
    greedy tokens equal mlx-lm's own generate for the prompt alone."""
    import mlx_lm

    from segcache.demo import MODELS_DIR

    target, tok = mlx_lm.load(str(MODELS_DIR / "target"))
    draft, _ = mlx_lm.load(str(MODELS_DIR / "draft"))
    text = (MODELS_DIR / "heldout_stdlib.txt").read_text()
    prompts = [tok.encode(text[i * 1500 : i * 1500 + 150 + 50 * i]) for i in range(4)]
    n = 24
    ref = []
    for p in prompts:
        ref.append([r.token for r in mlx_lm.stream_generate(target, tok, p, max_tokens=n)])
    dec = make_decoder(target, num_draft_tokens=K, draft_model=draft, draft_min_prob=0.25, gate=False)
    got = run(dec, target, prompts, join_at=3, late=(2, 3), max_tokens=n)
    for i in range(len(prompts)):
        assert got[i] == ref[i], f"row {i}"


class Flaky(GreedyMatch):
    """Greedy, but its accept fails once (as an MLX error mid-round would)."""

    failed = False

    def accept(self, logprobs, drafts, q, choices):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom")
        return super().accept(logprobs, drafts, q, choices)


def test_a_failed_step_changes_neither_batch():
    model, draft_model = tiny("qwen3_5"), tiny("qwen3_next", 1)
    dec = make_decoder(model, num_draft_tokens=K, draft_model=draft_model, gate=False)
    for i, p in enumerate(PROMPTS[:3]):
        start(dec, model, i, p, acceptor=Flaky() if i == 1 else None)
    with pytest.raises(RuntimeError, match="boom"):
        dec.step()
    assert not dec.batch.branch_open and not dec.drafter.rows.branch_open
    dec.check()  # both batches hold each row's history but the pending token, as before the step
    got = run_rest(dec, {i: [] for i in range(3)})
    for i, p in enumerate(PROMPTS[:3]):
        assert got[i] == alone(model, p), f"row {i}"
