import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import math

import mlx.core as mx
import pytest

from segcache import Runtime
from segcache.acceptors import make_acceptor
from segcache.batch.gate import DRAFT_MIN_PROB
from segcache.drafters import make_decoder
from segcache.generation import stream_generate
from segcache.lookup import PromptLookup
from segcache.mtp import forward_with_hidden
from segcache.mtp.drafter import HiddenStates
from segcache.sampling import Sampler, match_accept, speculative_accept
from segcache.testing import models
from test_generate import model, prompt_ids, tok

RUNS = 1000
ROWS = 50  # generations per decoder step (one batched verify forward)
TEMP = 1.0
ALPHA = 1e-3


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """Upper `alpha` quantile of chi-square(df), by the Wilson-Hilferty cube approximation.

    (X/df)^(1/3) is close to normal with mean 1 - 2/(9df) and variance 2/(9df);
    for alpha = 1e-3 (z = 3.0902) this gives 29.76 at df = 10 and 45.44 at df = 20,
    the tabulated values being 29.59 and 45.31 (within 1.2% from df = 5 up,
    slightly above: a hair more lenient than exact). With fixed seeds the test is
    deterministic; alpha is the chance a correct sampler would fail for an
    arbitrary choice of seed.
    """
    z = {1e-3: 3.090232}[alpha]
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2(counts: dict, probs: list, n: int):
    """(statistic, df): categories with expected count >= 5, the rest pooled."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = [t for t in order if n * probs[t] >= 5]
    pooled = [t for t in order if n * probs[t] < 5]
    cells = [([t], probs[t]) for t in kept]
    rest = sum(probs[t] for t in pooled)
    if n * rest >= 5:
        cells.append((pooled, rest))
    elif cells:  # too little mass to stand alone: pool it into the smallest cell
        toks, p = cells.pop()
        cells.append((toks + pooled, p + rest))
    stat = 0.0
    for toks, p in cells:
        observed = sum(counts.get(t, 0) for t in toks)
        stat += (observed - n * p) ** 2 / (n * p)
    return stat, len(cells) - 1


def test_chi2_critical_matches_tables():
    for df, table in [(5, 20.515), (10, 29.588), (20, 45.315), (40, 73.402)]:
        assert 0 <= chi2_critical(df) - table < 0.012 * table


class Biased:
    """The target's own weights with a fixed random logit bias: a draft that agrees often, not always."""

    def __init__(self, inner, seed=11, scale=1.5):
        self.inner = inner
        self.bias = mx.random.normal((models.VOCAB,), key=mx.random.key(seed)) * scale

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, inputs, cache=None, **kwargs):
        return self.inner(inputs, cache=cache, **kwargs) + self.bias


def batched_first_tokens(target, prompt, runs, seed, *, rows=ROWS, draft_model=None, mtp=None, decoder=None,
                         runtime=None):
    """The first generated token of `runs` sampled generations, and how many came from a draft.

    Each generation is a row of one decoder (the speculative round `stream_generate` runs on a
    lone row), `rows` at a time, so one batched forward verifies all of them: its acceptor is
    the one `stream_generate` makes for a `Sampler` (exact speculative sampling on mlx's global
    state), 2 drafts a round by `draft_model`, else the MTP head `mtp`, else prompt lookup. The
    prompt is prefilled once and shared by clones (a draft model's too; the MTP head's rows take
    the prompt's hidden states, as a prefill collects them). `decoder`: a batched decoder of
    that drafter made by the caller instead. `runtime`: the prompt but its last token prefilled
    by the caller (one made with `mtp=` carries the head's state in its clones)."""
    rt = runtime
    if rt is None:
        rt = Runtime(target)
        rt.forward(prompt[:-1])
    drt = None
    if draft_model is not None:
        drt = Runtime(draft_model)
        drt.forward(prompt[:-1])
    elif mtp is not None and runtime is None:
        drt = HiddenStates(forward_with_hidden(target, mx.array(prompt[:-1])[None])[1])
    dec = decoder
    if dec is None:  # not `decoder or ...`: a decoder with no rows is falsy
        dec = make_decoder(target, num_draft_tokens=2, draft_model=draft_model, mtp=mtp, gate=False,
                           draft_min_prob=DRAFT_MIN_PROB if draft_model is not None else 0.0)
    mx.random.seed(seed)
    counts, from_draft = {}, 0
    for start in range(0, runs, rows):
        for i in range(start, min(runs, start + rows)):
            dec.add(i, rt.clone(), prompt[-1], acceptor=make_acceptor(Sampler(TEMP)), max_tokens=4,
                    draft_runtime=drt.clone() if drt is not None else None)
        for i, emitted in dec.step().items():
            token, _, drafted = emitted[0]
            counts[token] = counts.get(token, 0) + 1
            from_draft += drafted
            dec.remove(i)
        dec.check()
    assert sum(counts.values()) == runs
    return counts, from_draft


def first_tokens(prompt, runs, seed, **kwargs):
    """The first generated token of `runs` seeded generations (prefill shared via clones)."""
    target = model("qwen3_5")
    rt = Runtime(target)
    rt.forward(prompt[:-1])
    drt = None
    if "draft_model" in kwargs:
        drt = Runtime(kwargs.pop("draft_model"))
        drt.forward(prompt[:-1])
    mx.random.seed(seed)
    counts, from_draft = {}, 0
    for _ in range(runs):
        gen = stream_generate(
            target, tok(), prompt[-1:], runtime=rt.clone(), draft_runtime=drt.clone() if drt else None,
            num_draft_tokens=2, max_tokens=4, sampler=Sampler(TEMP), **kwargs,
        )
        r = next(gen)
        gen.close()
        counts[r.token] = counts.get(r.token, 0) + 1
        from_draft += r.from_draft
    return counts, from_draft


def dist(m, prompt):
    return mx.softmax(m(mx.array(prompt)[None])[0, -1].astype(mx.float32) / TEMP).tolist()


def test_draft_model_sampling_matches_target_distribution():
    prompt = prompt_ids()
    draft = Biased(model("qwen3_5"))
    p, q = dist(model("qwen3_5"), prompt), dist(draft, prompt)
    counts, from_draft = batched_first_tokens(model("qwen3_5"), prompt, RUNS, seed=1, draft_model=draft)
    stat, df = chi2(counts, p, RUNS)
    assert df >= 8
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} at df {df}: not the target's distribution"
    # Power: the same samples are far from the draft's own distribution ...
    stat_q, df_q = chi2(counts, q, RUNS)
    assert stat_q > 3 * chi2_critical(df_q)
    # ... and both paths ran: the first draft is accepted with probability sum(min(p, q)).
    accept = sum(min(a, b) for a, b in zip(p, q))
    assert 0.2 < accept < 0.9
    sigma = math.sqrt(RUNS * accept * (1 - accept))
    assert abs(from_draft - RUNS * accept) < 4.5 * sigma


def test_prompt_lookup_sampling_matches_target_distribution():
    # "... ( d ... ( " : the lookup drafts d after the final "(", a point-mass q.
    # Pick d among likely tokens so that it is accepted sometimes, not always.
    base = prompt_ids()
    target = model("qwen3_5")
    p_base = dist(target, base)
    for d in sorted(range(2, 64), key=lambda t: -p_base[t]):
        prompt = base + [d] + base[-3:]
        p = dist(target, prompt)
        if 0.15 < p[d] < 0.7:
            break
    else:
        pytest.fail("no draft token with a moderate target probability")
    lookup = PromptLookup()
    lookup.extend(prompt)
    assert lookup.draft(2)[0] == d
    counts, from_draft = batched_first_tokens(target, prompt, RUNS, seed=2)
    stat, df = chi2(counts, p, RUNS)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} at df {df}: not the target's distribution"
    sigma = math.sqrt(RUNS * p[d] * (1 - p[d]))
    assert abs(from_draft - RUNS * p[d]) < 4.5 * sigma  # accepted with probability p(d)


# -- the math on its own ---------------------------------------------------------------


def test_speculative_accept_edge_cases():
    mx.random.seed(0)
    p = mx.softmax(mx.random.normal((4, 16)), axis=-1)
    drafts = [3, 5, 7]
    for _ in range(20):
        n, tok_ = speculative_accept(p, p[:3], drafts)  # q == p: always accepted
        assert n == 3
    zero = p.at[0, 3].multiply(0.0)  # p(d_1) = 0: never accepted, never emitted
    for _ in range(50):
        n, tok_ = speculative_accept(zero, None, drafts)
        assert n == 0 and tok_ != 3
    n, _ = speculative_accept(p[:1], None, [])
    assert n == 0
    with pytest.raises(ValueError):
        speculative_accept(p, None, [1])


def test_speculative_accept_residual_distribution():
    # One position, V = 4: p and q differ; the emitted token must follow p exactly.
    p = mx.array([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = mx.array([[0.1, 0.1, 0.2, 0.6]])
    mx.random.seed(4)
    counts = {}
    n_runs = 4000
    for _ in range(n_runs):
        d = mx.random.categorical(mx.log(q[0])).item()
        n, t = speculative_accept(p, q, [d])
        first = d if n == 1 else t
        counts[first] = counts.get(first, 0) + 1
    stat, df = chi2(counts, [0.5, 0.3, 0.2, 0.0], n_runs)
    assert stat < chi2_critical(df) and counts.get(3, 0) == 0


def test_match_accept():
    assert match_accept([1, 2, 3], [1, 2, 3, 4]) == 3
    assert match_accept([1, 2, 3], [1, 9, 3, 4]) == 1
    assert match_accept([], [4]) == 0


def test_prompt_lookup_drafts():
    lk = PromptLookup()
    lk.extend([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3])
    # Suffix (1, 2, 3) occurred at 0: continuation 4, 5, 9, ...
    assert lk.draft(3) == [4, 5, 9]
    lk.extend([4])
    # (2, 3, 4) occurred at 1 and 6: the most recent wins.
    assert lk.draft(2) == [6, 7]
    lk.extend([8])  # (3, 4, 8), (4, 8) never seen; (8,) never seen
    assert lk.draft(4) == []
    lk.extend([6])  # (6,) seen at 9
    assert lk.draft(2) == [7, 1]
    run = PromptLookup()
    run.extend([5, 5, 5])
    assert run.draft(4) == [5, 5, 5, 5]  # past the end, the copy reads its own output
    cycle = PromptLookup()
    cycle.extend([1, 2, 3, 9, 1, 2, 3, 1, 2])  # (1, 2) last seen at 4: then 3, 1, 2, 3, 1, ...
    assert cycle.draft(5) == [3, 1, 2, 3, 1]
    assert PromptLookup().draft(3) == [] and run.draft(0) == []
