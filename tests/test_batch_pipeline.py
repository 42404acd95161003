"""Pipelined plain batched decoding (BatchDecoder, no drafter): the next step's forward is
fed in a one-token branch before this step's tokens are read. Rows are token-identical to
the same request alone on mlx-lm's own caches, rows join and leave between pipelined steps
(dense, hybrid Gated DeltaNet, sliding window), a leaving row's runtime holds exactly its
history, and seeded sampling draws what the unpipelined decoder draws.

Tolerance as tests/test_batch.py (docs/batching.md): logits within TOL, same greedy tokens.
"""

import functools

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler as mlx_sampler

from conftest import tiny
from segcache.acceptors import make_acceptor
from segcache.batch import BatchDecoder, BatchRuntime
from segcache.errors import BranchError, InvariantError
from segcache.runtime import Runtime
from segcache.sampling import Sampler
from segcache.testing import models

TOL = 1e-4
PROMPTS = [list(range(1, 21)), [9, 8, 7], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
MAX = [12, 5, 9, 14, 7]


@functools.lru_cache(maxsize=None)
def model_of(family: str):
    if family == "llama_swa":  # one sliding-window layer (window 8) and one full layer
        return models.build("llama", layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    return tiny(family)


FAMILIES = ("llama", "qwen3_5", "qwen3_next", "llama_swa", "gemma3_text")


@functools.lru_cache(maxsize=None)
def alone(family: str, prompt: tuple, n: int) -> list:
    """Greedy tokens of the prompt alone on mlx-lm's own caches (the independent reference)."""
    model = model_of(family)
    cache = make_prompt_cache(model)
    logits = model(mx.array(list(prompt), dtype=mx.uint32)[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        tok = mx.argmax(logits).item()
        out.append(tok)
        logits = model(mx.array([[tok]], dtype=mx.uint32), cache=cache)[0, -1]
    return out


def solo(model, tokens):
    rt = Runtime(model)
    if tokens:
        rt.forward(tokens)
    return rt


def add(dec, model, rid, prompt, max_tokens, acceptor=None):
    dec.add(rid, solo(model, prompt[:-1]), prompt[-1], max_tokens=max_tokens, acceptor=acceptor)


def last_logits(rt, token):
    return rt.forward([token])[0, -1].astype(mx.float32)


def assert_runtime_holds(model, rt, tokens, what):
    """`rt` holds exactly `tokens`: its next logits equal a Runtime fed them alone."""
    assert rt.tokens == tokens, what
    ref = solo(model, tokens)
    diff = mx.abs(last_logits(rt, 4) - last_logits(ref, 4)).max().item()
    assert diff <= TOL, f"{what}: logits differ by {diff}"


def drive(dec, model, joins, eos=None, on_leave=None):
    """Run to completion: joins {step: [row ids]}; a row leaves at its max tokens or at an `eos`
    token (as the server: the decoder does not know it). Returns tokens per row; check() every step."""
    got, step = {}, 0
    while dec.rows or any(s >= step for s in joins):
        for rid in joins.get(step, []):
            add(dec, model, rid, PROMPTS[rid], MAX[rid])
            got[rid] = []
            dec.check()
        for rid, emitted in dec.step().items():
            got[rid] += [t for t, _, _ in emitted]
        dec.check()
        for rid in list(dec.rows):
            if len(got[rid]) >= MAX[rid] or (eos is not None and got[rid][-1] == eos.get(rid)):
                if on_leave is not None:
                    on_leave(dec, rid, got[rid])
                dec.remove(rid)
                dec.check()
        step += 1
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_joining_and_leaving_between_pipelined_steps_generate_as_alone(family):
    model = model_of(family)
    dec = BatchDecoder(model)  # plain: pipelined by default
    assert dec.pipeline
    got = drive(dec, model, {0: [0, 1, 2], 3: [3], 6: [4]})
    for rid, toks in got.items():
        assert toks == alone(family, tuple(PROMPTS[rid]), MAX[rid]), f"row {rid}"
    unpiped = drive(BatchDecoder(model, pipeline=False), model, {0: [0, 1, 2], 3: [3], 6: [4]})
    assert got == unpiped


@pytest.mark.parametrize("family", FAMILIES)
def test_a_leaving_row_runtime_holds_its_history_never_the_lookahead(family):
    model = model_of(family)
    dec = BatchDecoder(model)
    # row 2 meets its "end of sequence" early: the token it emits 4th
    eos = {2: alone(family, tuple(PROMPTS[2]), 4)[-1]}
    seen = []

    def on_leave(dec, rid, toks):
        history = PROMPTS[rid] + toks
        assert dec._ahead is not None  # a lookahead is in flight: the row fed its pending token in it
        assert_runtime_holds(model, dec.runtime(rid), history, f"runtime({rid})")
        assert_runtime_holds(model, dec.held(rid), history[:-1], f"held({rid})")
        dec.check()  # copies: the batch is untouched
        seen.append(rid)

    got = drive(dec, model, {0: [0, 1, 2], 2: [3, 4]}, eos=eos, on_leave=on_leave)
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert got[2] == alone(family, tuple(PROMPTS[2]), 4)
    for rid in (0, 1, 3, 4):
        assert got[rid] == alone(family, tuple(PROMPTS[rid]), MAX[rid]), f"row {rid}"


@pytest.mark.parametrize("strategy", ("states", "replay"))
def test_hybrid_rows_under_each_recurrent_strategy(strategy):
    model = model_of("qwen3_5")
    dec = BatchDecoder(model, recurrent_strategy=strategy)
    got = drive(dec, model, {0: [0, 1], 2: [2], 4: [3, 4]})
    for rid, toks in got.items():
        assert toks == alone("qwen3_5", tuple(PROMPTS[rid]), MAX[rid]), f"row {rid}"


@pytest.mark.parametrize("family", ("llama", "qwen3_5"))
@pytest.mark.parametrize("sampler", (Sampler(1.5, top_k=20), mlx_sampler(temp=1.5, top_p=0.9)),
                         ids=("segcache", "mlx-lm"))
def test_seeded_sampling_rows_draw_as_unpipelined(family, sampler):
    model = model_of(family)
    runs = []
    for pipeline in (True, False):
        mx.random.seed(7)
        dec = BatchDecoder(model, pipeline=pipeline)
        got, step = {}, 0
        while step < 12:
            for rid in {0: [0, 1], 3: [2]}.get(step, []):  # a join mid-way rolls the lookahead back
                add(dec, model, rid, PROMPTS[rid], 12, acceptor=make_acceptor(sampler))
                got[rid] = []
            for rid, emitted in dec.step().items():
                got[rid] += [t for t, _, _ in emitted]
            dec.check()
            if step == 6:
                dec.remove(1)
            step += 1
        runs.append(got)
    assert runs[0] == runs[1]
    assert len(set(runs[0][0])) > 1  # it sampled (not one token over and over)


def test_logprobs_are_each_rows_own():
    model = model_of("qwen3_5")
    dec = BatchDecoder(model)
    for rid in (0, 1):
        add(dec, model, rid, PROMPTS[rid], 5)
    for _ in range(3):
        out = dec.step()
    for rid in (0, 1):
        history = dec.rows[rid].history
        ref = solo(model, history[:-2]).forward([history[-2]])[0, -1]
        ref = ref - mx.logsumexp(ref)
        diff = mx.abs(out[rid][0][1] - ref).max().item()
        assert diff <= TOL and out[rid][0][0] == history[-1]


def test_the_last_row_leaving_drops_the_lookahead():
    model = model_of("llama")
    dec = BatchDecoder(model)
    add(dec, model, 0, PROMPTS[0], 5)
    dec.step()
    assert dec.batch.branch_open
    dec.remove(0)
    assert not dec.batch.branch_open and dec._ahead is None
    dec.check()
    assert dec.step() == {}


def test_check_catches_a_lookahead_out_of_step():
    model = model_of("llama")
    dec = BatchDecoder(model)
    for rid in (0, 1):
        add(dec, model, rid, PROMPTS[rid], 5)
    dec.step()
    dec.check()
    h = dec.rows[1].history
    h[-1] = h[-1] + 1  # the decoder thinks row 1's pending token is one its lookahead never fed
    with pytest.raises(InvariantError):
        dec.check()


def test_array_forward_needs_a_branch_and_fill_records_the_ids():
    model = model_of("llama")
    br = BatchRuntime(model)
    br.join("a", solo(model, [1, 2]))
    br.join("b", solo(model, [3]))
    with pytest.raises(BranchError):
        br.forward(mx.array([[4], [5]]))
    br.fork()
    br.forward(mx.array([[4], [5]]))
    assert br.tokens("a") == [1, 2, None]
    br.check()  # unread tokens in the open branch
    with pytest.raises(BranchError):
        br.commit([1, 1])  # never committed unread
    assert br.tokens("a") == [1, 2, None] and br.branch_open
    with pytest.raises(ValueError):
        br.fill([[4, 4], [5]])
    br.fill([[4], [5]])
    br.check()
    br.commit([1, 1])
    assert br.tokens("a") == [1, 2, 4] and br.tokens("b") == [3, 5]
    rt = br.to_runtime("b")
    assert_runtime_holds(model, rt, [3, 5], "to_runtime after an array forward")
