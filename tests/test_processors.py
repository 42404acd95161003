"""Logits processors and samplers: mlx-lm's semantics bit for bit, exact under speculation.

References are mlx-lm's own `make_logits_processors` / `make_sampler` (what
mlx_lm.server builds for a request), applied one position at a time as its
`generate_step` does, and `mx.random.seed` for the random draws.
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import functools
import math
import os
import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler as mlx_make_sampler

from segcache import Runtime
from segcache.drafters import make_decoder
from segcache.errors import ParamError
from segcache.processors import Processors, make_processors, normalize
from segcache.sampling import Keys, Sampler, make_sampler, speculative_accept
from segcache.testing import models
from segcache.testing.decode import plain_decode
from test_generate_sampling import chi2, chi2_critical

TARGET = os.path.join(os.path.dirname(segcache.__file__), "models", "target")

CONTROLS = {
    "repetition": dict(repetition_penalty=1.5, repetition_context_size=20),
    "repetition_all": dict(repetition_penalty=1.3, repetition_context_size=0),
    "presence": dict(presence_penalty=1.5, presence_context_size=20),
    "frequency": dict(frequency_penalty=0.8, frequency_context_size=20),
    "logit_bias": dict(logit_bias={17: 4.0, 293: -50.0, 262: 2.5}),
    "all": dict(logit_bias={17: 2.0}, repetition_penalty=1.2, repetition_context_size=8,
                presence_penalty=0.5, presence_context_size=0, frequency_penalty=0.4,
                frequency_context_size=12),
}


@functools.lru_cache(maxsize=None)
def shipped():
    return mlx_lm.load(TARGET)


def reference_rows(logits, history, drafts, kwargs):
    """mlx-lm's processors on each position j: history + drafts[:j], one row at a time."""
    procs = make_logits_processors(**kwargs)
    rows = []
    for j in range(logits.shape[0]):
        tokens = mx.array(list(history) + list(drafts[:j]))
        row = logits[j : j + 1]
        for p in procs:
            row = p(tokens, row)
        rows.append(row - mx.logsumexp(row, keepdims=True))
    return mx.concatenate(rows)


# -- each processor against mlx-lm's, position by position -----------------------------


@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16, mx.float16))
@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_processors_equal_mlx_lm_at_every_verify_position(name, dtype):
    kwargs = dict(CONTROLS[name])
    vocab = 512
    rng = random.Random(name)
    for trial in range(12):
        k = rng.randint(0, 6)
        # A small alphabet, so contexts repeat tokens and windows cut through repeats.
        history = [rng.randrange(40) for _ in range(rng.randint(1, 30))]
        drafts = [rng.randrange(40) for _ in range(k)]
        logits = (mx.random.normal((k + 1, vocab), key=mx.random.key(trial)) * 4).astype(dtype)
        want = reference_rows(logits, history, drafts, kwargs)
        procs = make_processors(vocab_size=vocab, **kwargs)
        got = procs.process(logits, history, drafts)
        assert got.dtype == want.dtype
        assert mx.array_equal(got, want).item(), f"{name}: trial {trial} differs from mlx-lm"
        # Unevaluated arrays (a draft model's lazy chain) give the same rows.
        lazy = procs.process(logits, mx.array(history), mx.array(drafts, dtype=mx.int32))
        assert mx.array_equal(lazy, want).item()
        # Only the last `window` history tokens are read.
        if procs.window > 0:
            assert mx.array_equal(procs.process(logits, history[-procs.window :], drafts), want).item()
        # A drafter's step: the position after history + drafts.
        nxt = procs.process_next(logits[k], history, drafts)
        assert mx.array_equal(nxt, want[k : k + 1]).item()


def test_processors_leave_the_callers_logits_alone():
    logits = mx.random.normal((3, 64), key=mx.random.key(1))
    before = mx.array(logits) + 0
    make_processors(vocab_size=64, **CONTROLS["all"]).process(logits, [1, 2, 3, 2], [5, 6])
    assert mx.array_equal(logits, before).item()


def test_window_reports_what_process_reads():
    assert make_processors(vocab_size=8).window == -1 and not make_processors(vocab_size=8)
    assert make_processors(vocab_size=8, logit_bias={1: 1.0}).window == -1
    assert make_processors(vocab_size=8, presence_penalty=1.0, presence_context_size=7,
                           frequency_penalty=1.0, frequency_context_size=3).window == 7
    assert make_processors(vocab_size=8, repetition_penalty=1.1, repetition_context_size=0,
                           presence_penalty=1.0).window == 0
    # A penalty of 0 (mlx_lm.server's default) is off, as in mlx-lm.
    assert not make_processors(vocab_size=8, repetition_penalty=0.0, presence_penalty=0.0)


def test_bad_controls_name_their_field():
    cases = [
        (lambda: make_processors(vocab_size=8, logit_bias={8: 1.0}), "logit_bias"),
        (lambda: make_processors(vocab_size=8, logit_bias={-1: 1.0}), "logit_bias"),
        (lambda: make_processors(vocab_size=8, repetition_penalty=-1.0), "repetition_penalty"),
        (lambda: make_processors(vocab_size=8, presence_penalty=1.0, presence_context_size=-1),
         "presence_context_size"),
        (lambda: Sampler(1.0, top_k=-1), "top_k"),
        (lambda: Sampler(1.0, top_p=1.5), "top_p"),
        (lambda: Sampler(1.0, min_p=-0.1), "min_p"),
        (lambda: Sampler(1.0, xtc_probability=0.5, xtc_threshold=0.7), "xtc_threshold"),
        (lambda: Sampler(1.0, xtc_probability=2.0), "xtc_probability"),
        (lambda: Sampler(-1.0), "temperature"),
    ]
    for make, field in cases:
        with pytest.raises(ParamError) as e:
            make()
        assert e.value.param == field and isinstance(e.value, ValueError)


# -- samplers and keys ------------------------------------------------------------------


SAMPLERS = [
    dict(temp=1.0),
    dict(temp=0.7, top_p=0.9),
    dict(temp=1.2, top_k=20),
    dict(temp=1.0, min_p=0.05),
    dict(temp=1.0, top_p=0.95, min_p=0.02, top_k=30),
    dict(temp=1.0, xtc_probability=0.5, xtc_threshold=0.05, xtc_special_tokens=[1, 2]),
    dict(temp=0.9, top_p=0.9, xtc_probability=1.0, xtc_threshold=0.1, top_k=10),
]


@pytest.mark.parametrize("kwargs", SAMPLERS, ids=lambda k: ",".join(k))
def test_sampler_draws_what_mlx_lm_draws_after_seeding(kwargs):
    lp = normalize(mx.random.normal((1, 300), key=mx.random.key(5)) * 3)
    mx.random.seed(17)
    want = [mlx_make_sampler(**kwargs)(lp).item() for _ in range(40)]
    keys = Keys(17)
    got = [Sampler(**dict(kwargs)).sample(lp, keys).item() for _ in range(40)]
    assert got == want


def test_keys_are_the_seeded_global_sequence_and_leave_it_alone():
    mx.random.seed(3)
    want = [mx.random.uniform().item() for _ in range(5)]
    mx.random.seed(99)
    state = mx.array(mx.random.state[0])
    keys = Keys(3)
    assert [mx.random.uniform(key=keys.next()).item() for _ in range(5)] == want
    assert mx.array_equal(mx.random.state[0], state).item()  # the global generator untouched
    a, b = Keys(3).spawn(0), Keys(3).spawn(1)
    assert mx.array_equal(a.next(), Keys(3).next()).item()  # choice 0 is the request's own stream
    assert not mx.array_equal(a.next(), b.next()).item()
    assert mx.array_equal(Keys(3).spawn(2).next(), Keys(3).spawn(2).next()).item()  # reproducible
    assert Keys().seed != Keys().seed


@pytest.mark.parametrize("kwargs", SAMPLERS, ids=lambda k: ",".join(k))
def test_probs_rows_are_the_single_row_distribution(kwargs):
    s = Sampler(**kwargs)
    lp = normalize(mx.random.normal((5, 300), key=mx.random.key(9)) * 3)
    p = s.probs(lp)
    assert mx.allclose(p.sum(axis=-1), mx.ones(5), atol=1e-5).item()
    for j in range(5):
        assert mx.array_equal(p[j : j + 1], s.probs(lp[j : j + 1])).item()


@pytest.mark.parametrize("kwargs", [SAMPLERS[5], SAMPLERS[6]], ids=("xtc", "xtc_topk"))
def test_xtc_probs_is_the_distribution_sample_draws_from(kwargs):
    s = Sampler(**kwargs)
    lp = normalize(mx.array([[3.0, 2.8, 2.5, 1.0, 0.5, 0.0, -1.0, -2.0]]))
    keys = Keys(23)
    n = 2000
    counts = {}
    for _ in range(n):
        t = s.sample(lp, keys).item()
        counts[t] = counts.get(t, 0) + 1
    probs = s.probs(lp)[0].tolist()
    stat, df = chi2(counts, probs, n)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} at df {df}"
    # Power: the distribution without XTC is far from the samples.
    plain = mx.softmax(s.logits(lp), axis=-1)[0].tolist()
    stat_plain, df_plain = chi2(counts, plain, n)
    assert stat_plain > 3 * chi2_critical(df_plain)


def test_draw_returns_the_distribution_it_drew_from():
    s = Sampler(1.0, xtc_probability=0.5, xtc_threshold=0.1)
    lp = normalize(mx.array([[2.0, 1.5, 1.0, 0.0, -1.0]]))
    keys = Keys(4)
    n, counts = 2000, {}
    for _ in range(n):
        t, q = s.draw(lp[0], keys.next())
        counts[t.item()] = counts.get(t.item(), 0) + 1
    assert mx.array_equal(q, s.probs(lp[0])).item()
    stat, df = chi2(counts, q.tolist(), n)
    assert stat < chi2_critical(df)


def test_speculative_accept_with_a_key_is_reproducible_and_global_free():
    p = mx.softmax(mx.random.normal((4, 16), key=mx.random.key(0)), axis=-1)
    q = mx.softmax(mx.random.normal((3, 16), key=mx.random.key(1)), axis=-1)
    mx.random.seed(5)
    state = mx.array(mx.random.state[0])
    runs = [speculative_accept(p, q, [3, 5, 7], key=mx.random.key(i)) for i in range(20)]
    assert runs == [speculative_accept(p, q, [3, 5, 7], key=mx.random.key(i)) for i in range(20)]
    assert len(set(runs)) > 1
    assert mx.array_equal(mx.random.state[0], state).item()


# -- plain decoding on the shipped target: mlx-lm's generate_step, token for token ----


SHIPPED = [
    ("repetition", dict(temp=0.0)),
    ("presence", dict(temp=0.0)),
    ("frequency", dict(temp=0.0)),
    ("logit_bias", dict(temp=0.0)),
    ("repetition_all", dict(temp=0.8, top_p=0.9)),
    ("all", dict(temp=1.0, min_p=0.05, top_k=40)),
    (None, dict(temp=1.0, xtc_probability=0.6, xtc_threshold=0.1)),
]


@pytest.mark.parametrize("control,sampling", SHIPPED, ids=lambda x: x if isinstance(x, str) else None)
def test_plain_decoding_equals_mlx_lm_on_the_shipped_target(control, sampling):
    """What mlx_lm.server runs for a request with these fields and a seed: its
    sampler and processors (xtc_special_tokens as the server builds them),
    `mx.random.seed(seed)`, `generate_step` on the prompt."""
    model, tokenizer = shipped()
    prompt = tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n    return ")
    special = list(tokenizer.encode("\n")) + list(tokenizer.eos_token_ids)
    kwargs = CONTROLS.get(control, {})
    n = 32
    mx.random.seed(11)
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=mlx_make_sampler(**sampling, xtc_special_tokens=special),
                          logits_processors=make_logits_processors(**kwargs))
    want = [(t, lp) for t, lp in steps]
    sampler = make_sampler(**sampling, xtc_special_tokens=special)
    got, logprobs = plain_decode(model, prompt, max_tokens=n, processors=make_processors(vocab_size=1536, **kwargs),
                                 sampler=sampler, keys=Keys(11) if sampler else None)
    assert got == [t for t, _ in want]
    for (_, a), b in zip(want, logprobs):
        assert mx.array_equal(a, b).item()  # the same processed logprobs, bit for bit
    if control is not None:  # the control changes the output (the test has power)
        plain, _ = plain_decode(model, prompt, max_tokens=n, sampler=sampler, keys=Keys(11) if sampler else None)
        assert plain != got


# -- exact speculative sampling against the processed target distribution -------------


class Biased:
    """The target's own weights with a fixed logit bias: a draft that agrees often, not always."""

    def __init__(self, inner, seed=11, scale=1.0):
        self.inner = inner
        self.bias = mx.random.normal((models.VOCAB,), key=mx.random.key(seed)) * scale

    def __call__(self, inputs, cache=None, **kwargs):
        return self.inner(inputs, cache=cache, **kwargs) + self.bias


@functools.lru_cache(maxsize=None)
def tiny_target():
    return models.build("llama", seed=3)


@functools.lru_cache(maxsize=4096)
def raw_logits(model_id, tokens):
    m = tiny_target() if model_id == "target" else Biased(tiny_target())
    out = m(mx.array(tokens)[None])[0].astype(mx.float32)
    mx.eval(out)
    return out


SPEC_RUNS = 1500


@pytest.mark.parametrize("control", ("presence", "logit_bias"))
def test_exact_speculative_sampling_follows_the_processed_target(control):
    """Two drafts sampled from the (processed) draft distribution, verified with
    `speculative_accept` against the target processed at each position: the
    first emitted token follows the processed target, and so does the second
    given the first (whose distribution depends on the first through the penalty)."""
    kwargs = {"presence": dict(presence_penalty=3.0, presence_context_size=20),
              "logit_bias": dict(logit_bias={5: 4.0, 9: 2.0, 12: -4.0})}[control]
    history = (1, 7, 3, 9, 2, 7, 4)
    sampler = Sampler(1.0)
    procs = make_processors(vocab_size=models.VOCAB, **kwargs)
    keys = Keys(31)
    first, second = {}, {}
    from_draft = 0
    for _ in range(SPEC_RUNS):
        drafts, qs = [], []
        for j in range(2):  # the drafter's steps, each on the draft's processed logits
            logits = raw_logits("draft", history + tuple(drafts))[-1]
            d, q = sampler.draw(procs.process_next(logits, history, drafts)[0], keys.next())
            drafts.append(d.item())
            qs.append(q)
        logits = raw_logits("target", history + tuple(drafts))[len(history) - 1 :]
        p = sampler.probs(procs.process(logits, history, drafts))
        n, tok = speculative_accept(p, mx.stack(qs), drafts, key=keys.next())
        emitted = drafts[:n] + [tok]
        from_draft += n > 0
        first[emitted[0]] = first.get(emitted[0], 0) + 1
        if len(emitted) > 1:
            second.setdefault(emitted[0], {})
            second[emitted[0]][emitted[1]] = second[emitted[0]].get(emitted[1], 0) + 1

    def processed(tokens):
        lp = procs.process(raw_logits("target", tokens)[-1:], tokens, ())
        return sampler.probs(lp)[0].tolist()

    p0 = processed(history)
    stat, df = chi2(first, p0, SPEC_RUNS)
    assert df >= 5 and stat < chi2_critical(df), f"first token: chi2 {stat:.1f} at df {df}"
    # Power: the unprocessed target is rejected by the same samples.
    raw = sampler.probs(normalize(raw_logits("target", history)[-1:]))[0].tolist()
    stat_raw, df_raw = chi2(first, raw, SPEC_RUNS)
    assert stat_raw > chi2_critical(df_raw)
    assert 0.2 * SPEC_RUNS < from_draft < 0.95 * SPEC_RUNS  # both paths ran
    # The second token, given the most frequent first token t (drafted and accepted
    # in most of those runs: its position saw history + t in the verify).
    t = max(second, key=lambda x: sum(second[x].values()))
    n_t = sum(second[t].values())
    assert n_t > 150
    stat2, df2 = chi2(second[t], processed(history + (t,)), n_t)
    assert stat2 < chi2_critical(df2), f"second token: chi2 {stat2:.1f} at df {df2}"


# -- the engine's round: greedy speculation with a control equals plain greedy ---------


def speculative_greedy(model, draft_model, prompt, procs: Processors, *, width, max_tokens, eos=(), rows=1):
    """Greedy decoding of `prompt` on the decoder (the one speculative round), `rows` copies
    of it (one row: a Runtime alone; more: a batch), drafting with `draft_model` (None:
    prompt lookup). Returns the first row's tokens (asserting every row's are the same)
    and the drafts proposed and accepted over all rows."""
    dec = make_decoder(model, num_draft_tokens=width, draft_model=draft_model, gate=False, one_row=rows == 1)
    for r in range(rows):
        rt = Runtime(model)
        rt.forward(prompt[:-1])
        dec.add(r, rt, prompt[-1], max_tokens=max_tokens, processors=procs if r == 0 else procs.fork(),
                stop_tokens=eos)
    states = dict(dec.rows)
    got = {r: [] for r in range(rows)}
    while dec.rows:
        for rid, emitted in dec.step().items():
            got[rid] += [t for t, _, _ in emitted]
        dec.check()
        for rid in [r for r, st in dec.rows.items() if st.finished]:
            dec.remove(rid)
    assert all(got[r] == got[0] for r in got)
    stats = {"drafted": sum(st.drafted for st in states.values()),
             "accepted": sum(st.accepted for st in states.values())}
    return got[0], stats


@pytest.mark.parametrize("control", ("repetition", "presence", "frequency", "logit_bias", "all"))
def test_greedy_speculation_with_a_control_is_plain_greedy(control):
    model, tokenizer = shipped()
    prompt = tokenizer.encode("import os\nimport sys\n\ndef main(argv):\n    ")
    kwargs = CONTROLS[control]
    want, _ = plain_decode(model, prompt, max_tokens=40, processors=make_processors(vocab_size=1536, **kwargs))
    # The draft: the shipped target with a bias, so some drafts are rejected.
    bias = mx.random.normal((1536,), key=mx.random.key(2)) * 2.0

    class Draft:
        def __init__(self):
            self.inner = model

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, inputs, cache=None, **kwargs):
            return self.inner(inputs, cache=cache, **kwargs) + bias

    for draft, rows in ((Draft(), 1), (Draft(), 3), (None, 1), (None, 3)):  # a draft model or prompt lookup
        got, stats = speculative_greedy(model, draft, prompt, make_processors(vocab_size=1536, **kwargs),
                                        width=3, max_tokens=40, rows=rows)
        assert got == want, (draft, rows)
        if draft is not None:
            assert 0 < stats["accepted"] < stats["drafted"]  # drafts were accepted and rejected
