"""MTP self-speculation in the one decoder: greedy output token-identical to mlx-lm's own
greedy decoding on qwen3_next and qwen3_5 (one row, batched rows joining and leaving,
gated and ungated, through stream_generate), exact speculative sampling (chi-square
against the target's distribution), the head's cache equal to one built from scratch
on the committed tokens, a failed step changing nothing, and the hidden-state tap
changing no logits.

The heads are fitted for a few seconds to the tiny target's own greedy choices (a
random head is almost never accepted), so rounds accept none, some and all drafts.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from segcache.acceptors import make_acceptor
from segcache.batch.decoder import BatchDecoder
from segcache.drafters import make_decoder
from segcache.errors import RowError
from segcache.generation import stream_generate
from segcache.mtp import MTPHead, forward_with_hidden
from segcache.mtp.drafter import MTP, HiddenStates
from segcache.mtp.tap import install, uninstall
from segcache.runtime import Runtime
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from test_batch_decode import MAX, PROMPTS
from test_generate_sampling import TEMP, batched_first_tokens, chi2, chi2_critical

FAMILIES = ("qwen3_next", "qwen3_5")
K = 3
_CACHE = {}


def fitted(family):
    """(target, head): the head fitted to the target's greedy choice after (hidden t, token t+1)."""
    if family not in _CACHE:
        model = models.build(family)
        head = MTPHead.build(model)
        x = mx.random.randint(2, models.VOCAB, (24, 24), key=mx.random.key(7))
        logits, hidden = forward_with_hidden(model, x)
        want = mx.argmax(logits[:, 1:], axis=-1)

        def loss(module):
            out, _ = head(hidden[:, :-1], x[:, 1:])
            return nn.losses.cross_entropy(out, want).mean()

        opt = optim.Adam(learning_rate=2e-2)
        step = nn.value_and_grad(head.module, loss)
        for _ in range(40):
            _, grads = step(head.module)
            opt.update(head.module, grads)
            mx.eval(head.module.parameters(), opt.state)
        _CACHE[family] = (model, head)
    return _CACHE[family]


def reference(model, prompt, n=MAX):
    """mlx-lm's own greedy tokens (no segcache code on the path)."""
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(token))
    return out


def start(dec, model, rid, prompt, **kwargs):
    rt = Runtime(model)
    if len(prompt) > 1:
        rt.forward(prompt[:-1])
    dec.add(rid, rt, prompt[-1], max_tokens=MAX, **kwargs)


def run(dec, model, prompts, *, late=(), join_at=2):
    got = {i: [] for i in range(len(prompts))}
    stats = {}
    for i, p in enumerate(prompts):
        if i not in late:
            start(dec, model, i, p)
            stats[i] = dec.rows[i].stats
    steps = 0
    while dec.rows or steps <= join_at:
        if steps == join_at:
            for i in late:
                start(dec, model, i, prompts[i])
                stats[i] = dec.rows[i].stats
        for rid, emitted in dec.step().items():
            got[rid].extend(t for t, _, _ in emitted)
            if len(got[rid]) >= MAX:
                dec.remove(rid)
        dec.check()
        steps += 1
    return got, stats


def per_round(stats):
    """(drafted, accepted) of each round that drafted."""
    return [(d, a) for d, a in zip(stats.drafted_per_round, stats.accepted_per_round) if d]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_one_row_and_batched_equal_plain_greedy(family):
    model, head = fitted(family)
    want = [reference(model, p) for p in PROMPTS]
    accepted = []
    for one_row in (True, False):
        for gate in (False, True):
            # batched rows ungated draft K every round (not adaptive), so some round accepts all K
            dec = make_decoder(model, num_draft_tokens=K, mtp=head, one_row=one_row, gate=gate,
                               adaptive=one_row or gate)
            if one_row:
                for i, p in enumerate(PROMPTS):
                    got, stats = run(dec, model, [p])
                    assert got[0] == want[i], (one_row, gate, i)
                    accepted += per_round(stats[0])
            else:
                got, stats = run(dec, model, PROMPTS, late=(3, 4))
                for i in range(len(PROMPTS)):
                    assert got[i] == want[i], (one_row, gate, i)
                    accepted += per_round(stats[i])
    # rounds accepted none, some and all of their drafts
    assert any(a == 0 for _, a in accepted) and any(0 < a < d for d, a in accepted)
    assert any(a == d > 1 for d, a in accepted)


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_generate_with_mtp_equals_plain_and_continues(family):
    model, head = fitted(family)
    tk = test_tokenizer.tokenizer(eos=False)
    for p in PROMPTS[:3]:
        plain = [r.token for r in stream_generate(model, tk, p, max_tokens=MAX)]
        rt = Runtime(model)
        rs = list(stream_generate(model, tk, p, max_tokens=MAX, mtp=head, num_draft_tokens=K, runtime=rt))
        assert [r.token for r in rs] == plain
        assert rs[-1].stats.mode == "mtp" and rs[-1].stats.accepted > 0
        assert rt.tokens == p + plain and rt.depth == 0
        # a second turn on the same runtime: the head's context is rebuilt from the tokens held
        more = [r.token for r in stream_generate(model, tk, [5, 6], max_tokens=8, mtp=head, runtime=rt)]
        assert more == reference(model, p + plain + [5, 6], 8)


def test_mtp_argument_errors():
    model, head = fitted("qwen3_next")
    other = models.build("qwen3_5")
    tk = test_tokenizer.tokenizer(eos=False)
    with pytest.raises(ValueError, match="another model"):
        next(stream_generate(other, tk, [1, 2, 3], mtp=head))
    with pytest.raises(ValueError, match="no MTP head loaded"):
        next(stream_generate(other, tk, [1, 2, 3], mtp=True))
    with pytest.raises(ValueError, match="choose one drafter"):
        next(stream_generate(model, tk, [1, 2, 3], mtp=head, prompt_lookup=True))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        make_decoder(model, num_draft_tokens=0, mtp=head)


def pairs_from_scratch(model, head, tokens):
    """The head's cache holding the pairs of `tokens` but the last (the pending token's), built in one call."""
    _, hidden = forward_with_hidden(model, mx.array(tokens[:-2])[None])
    cache = head.make_cache()
    head(hidden, mx.array(tokens[1:-1])[None], cache)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_head_cache_is_the_committed_tokens_pairs(family):
    """After rounds (kept catch-ups, dropped deeper pairs), the head holds what a head run once on
    the committed tokens with the target's hidden states holds."""
    model, head = fitted(family)
    dec = make_decoder(model, num_draft_tokens=K, mtp=head, gate=False, adaptive=False)
    for i, p in enumerate(PROMPTS[:3]):
        start(dec, model, i, p)
    for _ in range(5):
        dec.step()
    dec._close()
    dec.check()
    rows = dec.drafter.rows
    rows.feed_tails([dec.rows[r].history for r in rows.ids], 0)  # every pair but the pending one's
    rows.check([len(dec.rows[r].history) - 1 for r in rows.ids])
    for i, rid in enumerate(rows.ids):
        s = dec.rows[rid]
        ref = pairs_from_scratch(model, head, s.history)
        n = rows.held[i]
        k, v = rows.layers[0].keys[i : i + 1, :, :n], rows.layers[0].values[i : i + 1, :, :n]
        rk, rv = ref[0].keys_and_values()
        assert k.shape == rk.shape
        assert mx.allclose(k, rk, atol=1e-4).item() and mx.allclose(v, rv, atol=1e-4).item()


def test_prefill_hidden_states_equal_recomputed():
    """A row joining with its prefill's hidden states builds the head cache a recompute builds."""
    model, head = fitted("qwen3_next")
    p = PROMPTS[0] * 3
    dec = make_decoder(model, num_draft_tokens=K, mtp=head)
    tap = dec.drafter.tap
    rt = Runtime(model)
    with tap.collecting() as chunks:
        rt.forward(p[:-1])
    dec.add("given", rt, p[-1], draft_runtime=HiddenStates(chunks[0][0]))
    start(dec, model, "recomputed", p)
    rows = dec.drafter.rows
    a, b = rows.index("given"), rows.index("recomputed")
    assert rows.held[a] == rows.held[b] == len(p) - 2 and rows.lags[a] == rows.lags[b] == 1
    n = rows.held[a]
    keys = rows.layers[0].keys
    assert mx.allclose(keys[a, :, :n], keys[b, :, :n], atol=1e-5).item()
    assert mx.allclose(rows.tail[a, :1], rows.tail[b, :1], atol=1e-5).item()
    dec.check()


class Failing:
    """An acceptor that fails on its n-th acceptance (a row whose own rule breaks)."""

    def __init__(self, inner, n):
        self.inner, self.n = inner, n

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def accept(self, *args):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("boom")
        return self.inner.accept(*args)


def test_a_failed_round_changes_nothing():
    from segcache.acceptors import GreedyMatch

    model, head = fitted("qwen3_5")
    want = [reference(model, p) for p in PROMPTS[:3]]
    dec = make_decoder(model, num_draft_tokens=K, mtp=head, gate=False)
    for i, p in enumerate(PROMPTS[:3]):
        start(dec, model, i, p, acceptor=Failing(GreedyMatch(), 3) if i == 1 else None)
    got = {i: [] for i in range(3)}
    failures = 0
    while dec.rows:
        try:
            out = dec.step()
        except RowError as exc:
            assert exc.row_id == 1
            failures += 1
            dec.check()
            continue
        for rid, emitted in out.items():
            got[rid].extend(t for t, _, _ in emitted)
            if dec.rows[rid].finished:
                dec.remove(rid)
        dec.check()
    assert failures == 1
    assert all(got[i][:MAX] == want[i] for i in range(3))


def test_tap_changes_no_logits_and_no_parameters():
    model = models.build("qwen3_next")
    x = mx.array([[3, 9, 4, 1, 7]])
    before = model(x)
    names = [k for k, _ in tree_flatten(model.parameters())]
    tap = install(model)
    assert mx.array_equal(model(x), before).item()
    assert mx.array_equal(tap.take(), forward_with_hidden(model, x)[1]).item()
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    uninstall(model)
    assert isinstance(model.model.norm, nn.RMSNorm)


RUNS = 1000


def test_mtp_sampling_matches_target_distribution():
    model, head = fitted("qwen3_5")
    prompt = [5, 17, 33, 2, 40, 11, 9]
    temp = TEMP  # the temperature first_tokens samples at
    p = mx.softmax(model(mx.array(prompt)[None])[0, -1] / temp).tolist()
    _, hidden = forward_with_hidden(model, mx.array(prompt[:-1])[None])
    q_logits, _ = head(hidden, mx.array(prompt[1:])[None], head.make_cache())
    q = mx.softmax(q_logits[0, -1] / temp).tolist()
    rt = Runtime(model, mtp=head)  # its clones carry the head's state: a row joins with no forward
    rt.forward(prompt[:-1])
    # the first position drafted (`plain_first=False`): its token is the speculative sampler's
    dec = BatchDecoder(model, drafter=MTP(head, plain_first=False), num_draft_tokens=2, gate=False)
    counts, from_draft = batched_first_tokens(model, prompt, RUNS, seed=3, mtp=head, decoder=dec, runtime=rt)
    stat, df = chi2(counts, p, RUNS)
    assert df >= 5
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} at df {df}: not the target's distribution"
    accept = sum(min(a, b) for a, b in zip(p, q))
    assert 0.05 < accept < 0.95
    stat_q, df_q = chi2(counts, q, RUNS)
    if abs(accept - 1) > 0.3:  # power: far from the head's own distribution
        assert stat_q > 3 * chi2_critical(df_q)
    sigma = math.sqrt(RUNS * accept * (1 - accept))
    assert abs(from_draft - RUNS * accept) < 4.5 * sigma


@pytest.mark.parametrize("seed", (0, 1))
def test_random_steps_settles_joins_and_leaves(seed):
    """Rows join, step, take fewer tokens than a round emitted (settle), leave and are
    released, in random order: the invariants hold after every call, every row's tokens
    are mlx-lm's greedy ones, and a released row holds exactly what it took."""
    import random

    rnd = random.Random(seed)
    model, head = fitted("qwen3_next" if seed % 2 == 0 else "qwen3_5")
    want = {i: reference(model, p, 24) for i, p in enumerate(PROMPTS)}
    dec = make_decoder(model, num_draft_tokens=K, mtp=head, gate=rnd.random() < 0.5)
    got, waiting, nxt = {}, list(range(len(PROMPTS))), 0
    for _ in range(60):
        if waiting and (not dec.rows or rnd.random() < 0.3):
            i = waiting.pop(0)
            start(dec, model, i, PROMPTS[i])
            got[i] = []
            dec.check()
            continue
        if not dec.rows:
            break
        out = dec.step()
        dec.check()
        taken = {}
        for rid, emitted in out.items():
            k = len(emitted)
            if k > 1 and rnd.random() < 0.3:
                k = rnd.randrange(1, k)
                taken[rid] = k
            got[rid].extend(t for t, _, _ in emitted[:k])
        if taken:
            dec.settle(taken)
            dec.check()
        for rid in list(dec.rows):
            if dec.rows[rid].finished or len(got[rid]) >= 24 or rnd.random() < 0.05:
                rt = dec.release(rid)
                assert rt.tokens == PROMPTS[rid] + got[rid]
                dec.check()
    for i, tokens in got.items():
        assert tokens == want[i][: len(tokens)], i
