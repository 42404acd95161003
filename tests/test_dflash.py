"""DFlash block drafters (segcache.dflash): a synthetic checkpoint in the published layout
loads and drafts what the reference implementation (z-lab's `dflash` package, installed
from the wheel under tests/wheels only for this test) drafts for the same target hidden
states; a target that does not fit is refused naming the mismatch; the context segment
forks, commits and rolls back to what feeding the kept tokens makes; greedy DFlash
decoding, one row and batched with late joins, equals mlx-lm's greedy decoding on dense
and hybrid targets and the shipped target; exact speculative sampling has the target's
distribution (with power against the drafter's)."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import importlib
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from segcache.acceptors import GreedyMatch
from segcache.dflash import ContextSegment, load_dflash
from segcache.dflash.drafter import DFlash
from segcache.dflash.tap import install
from segcache.drafters import make_decoder
from segcache.errors import UnsupportedModelError
from segcache.generation import stream_generate
from segcache.processors import make_processors
from segcache.runtime import Runtime
from segcache.sampling import Sampler
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from segcache.testing.dflash import random_drafter, write_checkpoint
from test_generate_sampling import chi2, chi2_critical
from test_mtp_decode import reference

WHEEL = Path(__file__).parent / "wheels" / "dflash-0.1.0-py3-none-any.whl"
TARGET = Path(segcache.__file__).parent / "models" / "target"
PROMPT = [(t * 7 + 3) % 60 + 1 for t in range(21)]


@pytest.fixture(scope="module")
def ref_module(tmp_path_factory):
    """The reference's model_mlx, from the cached wheel (or PyPI), on a path of this test's only."""
    where = tmp_path_factory.mktemp("dflash_ref")
    try:
        if WHEEL.is_file():
            zipfile.ZipFile(WHEEL).extractall(where)
        else:
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(where), "dflash"],
                           check=True, capture_output=True, timeout=120)
        sys.path.insert(0, str(where))
        try:
            return importlib.import_module("dflash.model_mlx")
        finally:
            sys.path.remove(str(where))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the reference dflash package cannot be installed here: {exc}")


@pytest.mark.parametrize("family", ("llama", "qwen3_5"))
def test_a_published_checkpoint_drafts_what_the_reference_drafts(family, ref_module, tmp_path, monkeypatch):
    mine, theirs = models.build(family), models.build(family)  # the reference wraps its target's layers
    path = write_checkpoint(mine, tmp_path / "d", seed=1, layers=2, block_size=5)
    monkeypatch.setattr(ref_module, "snapshot_download", lambda *a, **k: str(path))
    ref = ref_module.load_draft("local").bind(theirs)
    ref_module._patch_model(theirs, ref.config.target_layer_ids)
    drafter = load_dflash(path, mine)
    assert drafter.cfg.target_layer_ids == tuple(ref.config.target_layer_ids)

    # the reference: the target's cache and hidden states, its drafter's cache fed at each draft
    tcache, dcache = make_prompt_cache(theirs), ref.make_cache()
    mask = drafter.cfg.mask_token_id
    theirs(mx.array(PROMPT[:-1])[None], tcache)
    hidden = mx.concatenate(theirs._hidden_states, axis=-1)
    want = [ref(mx.array([[PROMPT[-1]] + [mask] * 4]), hidden, dcache, logits_start=1)]
    more = [PROMPT[-1], 9, 4]  # a verify that kept three tokens
    theirs(mx.array(more)[None], tcache)
    hidden = mx.concatenate(theirs._hidden_states, axis=-1)
    want.append(ref(mx.array([[11] + [mask] * 4]), hidden, dcache, logits_start=1))

    # ours: the runtime's segment fed by its forwards, the row taken from it
    rt = Runtime(mine, dflash=drafter)
    rt.forward(PROMPT[:-1])
    dfl = DFlash(drafter)
    dfl.add(0, PROMPT, rt, None)
    assert rt.drafters.get("dflash").stale  # lent to the row
    row = lambda h: SimpleNamespace(row_id=0, history=h, acceptor=GreedyMatch(), processors=None)  # noqa: E731
    got = dfl.draft([row(PROMPT)], [4])
    keys, values = dfl.rows[0].context()
    logits = drafter.block(mx.array([[PROMPT[-1]] + [mask] * 4]), keys, values, len(PROMPT) - 1)
    assert mx.allclose(logits, want[0], atol=1e-5).item()
    assert got.tokens.tolist() == mx.argmax(want[0], axis=-1).tolist()
    rt.forward(more)  # stands for the verify the decoder runs (the tap keeps its layers' outputs)
    dfl.fill(None)
    dfl.close([row(PROMPT + [9, 4, 11])], [3])
    got = dfl.draft([row(PROMPT + [9, 4, 11])], [4])
    assert got.tokens.tolist() == mx.argmax(want[1], axis=-1).tolist()


def test_a_drafter_for_another_target_is_refused_naming_the_mismatch(tmp_path):
    path = write_checkpoint(models.build("qwen3_5"), tmp_path / "d")
    with pytest.raises(UnsupportedModelError, match="hidden size 64 for a target of hidden size 32"):
        load_dflash(path, models.build("qwen3_5", hidden_size=32))
    with pytest.raises(UnsupportedModelError, match="vocabulary 64 for a target of vocabulary 80"):
        load_dflash(path, models.build("qwen3_5", vocab_size=80))


def _cold_context(drafter, ids):
    """The context K/V of `ids` computed from scratch: one forward on mlx-lm's cache, projected."""
    model = drafter.model
    tap = install(model, drafter.cfg.target_layer_ids)
    model(mx.array(ids)[None], make_prompt_cache(model))
    return drafter.context_kv(drafter.context(tap.take()), 0)


def test_the_segment_commits_and_rolls_back_to_what_the_kept_tokens_make(tmp_path):
    model = models.build("qwen3_5")
    drafter = random_drafter(model, tmp_path / "d", seed=2, layers=2)
    rt = Runtime(model, dflash=drafter)
    rt.forward(PROMPT[:9])
    rt.forward(PROMPT[9:13])
    with rt.fork():
        rt.forward([7, 7, 7])  # rolled back
    br = rt.fork()
    rt.forward(PROMPT[13:18])
    inner = rt.fork()
    rt.forward(PROMPT[18:20])
    inner.commit(1)
    clone = rt.clone()  # the committed part only: 13 tokens
    br.commit(3)
    rt.check()
    seg = rt.drafters.get(ContextSegment.name)
    kept = PROMPT[:16]
    keys, values = _cold_context(drafter, kept)
    assert seg.held == len(kept) - 1
    assert mx.allclose(seg.kv.keys[..., : seg.held, :], keys[..., :-1, :], atol=1e-5).item()
    assert mx.allclose(seg.kv.values[..., : seg.held, :], values[..., :-1, :], atol=1e-5).item()
    cold = ContextSegment(drafter)
    cold.extend(None, kept)  # a forward the tap did not see: stale, holding nothing
    assert cold.stale and cold.offset is None
    assert clone.drafters.get(ContextSegment.name).offset == 13
    clone.check()


def _blind(model, tmp_path, want_tokens):
    """A blind drafter (every block position drafts f(mask)) whose mask makes it draft the commonest
    token of `want_tokens`, so greedy rounds accept some drafts and reject others."""
    path = write_checkpoint(model, tmp_path / "blind", seed=3, blind=True, block_size=4)
    drafter = load_dflash(path, model)
    inner_embed = drafter.embed
    drafts = mx.argmax(drafter.logits(drafter.module.norm(inner_embed(mx.arange(drafter.cfg.vocab_size)))), -1)
    common = [t for t, _ in Counter(want_tokens).most_common()]
    for t in common:
        hits = [m for m, d in enumerate(drafts.tolist()) if d == t]
        if hits:
            drafter.cfg.mask_token_id = hits[0]
            return drafter
    pytest.fail("no mask token drafts any token of the continuation")


def _shipped():
    model, tok = mlx_lm.load(str(TARGET))
    text = (TARGET.parent / "heldout_stdlib.txt").read_text()
    return model, [tok.encode(text[i * 2000 : i * 2000 + 60 + 20 * i]) for i in range(3)]


def _run_batched(dec, model, prompts, late, n):
    got = {i: [] for i in range(len(prompts))}

    def start(i):
        rt = Runtime(model)
        rt.forward(prompts[i][:-1])
        dec.add(i, rt, prompts[i][-1], max_tokens=n)

    for i in range(len(prompts)):
        if i not in late:
            start(i)
    steps = 0
    while dec.rows or steps <= 2:
        if steps == 2:
            for i in late:
                start(i)
        for rid, emitted in dec.step().items():
            got[rid].extend(t for t, _, _ in emitted)
            if dec.rows[rid].finished or len(got[rid]) >= n:
                dec.remove(rid)
        dec.check()
        steps += 1
    return {i: g[:n] for i, g in got.items()}


@pytest.mark.parametrize("target", ("llama", "qwen3_5", "qwen3_next", "shipped"))
def test_greedy_dflash_one_row_and_batched_with_late_joins_equals_plain_greedy(target, tmp_path):
    if target == "shipped":
        model, prompts = _shipped()
    else:
        model = models.build(target)
        prompts = [PROMPT, PROMPT[:5], [3, 4, 3, 4, 3, 4, 3]]
    n = 12
    want = {i: reference(model, p, n) for i, p in enumerate(prompts)}
    drafter = _blind(model, tmp_path, [t for w in want.values() for t in w])
    tk = test_tokenizer.tokenizer(eos=False)
    one = [r for r in stream_generate(model, tk, prompts[0], max_tokens=n, dflash=drafter, adaptive=False)]
    assert [r.token for r in one] == want[0]
    for gate in (False, True):
        dec = make_decoder(model, dflash=drafter, gate=gate, adaptive=False)
        assert _run_batched(dec, model, prompts, late=(1,), n=n) == want, gate
    accepted = sum(r.from_draft for r in one)
    assert 0 < accepted  # some rounds kept drafts


RUNS = 300


def sampled_first_tokens(model, drafter, prompt, seed: int, **options) -> tuple[dict, int]:
    """RUNS first tokens after `prompt` at temperature 1 with `drafter` (each from a clone of one
    runtime holding the prompt but its last token): their counts, and how many came from a draft."""
    rt = Runtime(model)
    rt.forward(prompt[:-1])
    tk = test_tokenizer.tokenizer(eos=False)
    mx.random.seed(seed)
    counts, from_draft = {}, 0
    for _ in range(RUNS):
        gen = stream_generate(model, tk, prompt[-1:], runtime=rt.clone(), dflash=drafter, max_tokens=2,
                              sampler=Sampler(1.0), **options)
        r = next(gen)
        gen.close()
        counts[r.token] = counts.get(r.token, 0) + 1
        from_draft += r.from_draft
    return counts, from_draft


def assert_exact(counts: dict, from_draft: int, p, accept: float, q=None, slack: float = 0.0) -> None:
    """The sampled tokens are the target's distribution `p` (chi-square), far from the drafter's own
    `q` when given (the test's power), and drafts were accepted at the rate `accept` they should be."""
    stat, df = chi2(counts, p, RUNS)
    assert df >= 3 and stat < chi2_critical(df), f"chi2 {stat:.1f} at df {df}: not the target's distribution"
    if q is not None:
        stat_q, df_q = chi2(counts, q, RUNS)
        assert stat_q > 3 * chi2_critical(df_q), f"chi2 {stat_q:.1f} against q: no power"
    assert abs(from_draft - RUNS * accept) < 4.5 * (RUNS * accept * (1 - accept)) ** 0.5 + slack


def test_dflash_sampling_matches_the_target_distribution(tmp_path):
    model = models.build("qwen3_5")
    prompt = [5, 17, 33, 2, 40, 11, 9]
    p = mx.softmax(model(mx.array(prompt)[None])[0, -1]).tolist()
    path = write_checkpoint(model, tmp_path / "q", seed=4, blind=True, block_size=3)
    drafter = load_dflash(path, model)
    qs = mx.softmax(drafter.logits(drafter.module.norm(drafter.embed(mx.arange(drafter.cfg.vocab_size)))), -1)
    overlap = mx.minimum(qs, mx.array(p)[None]).sum(-1).tolist()
    mask = min(range(len(overlap)), key=lambda m: abs(overlap[m] - 0.5))  # accepted about half the time
    drafter.cfg.mask_token_id = mask
    q, accept = qs[mask].tolist(), overlap[mask]
    assert 0.2 < accept < 0.8
    counts, from_draft = sampled_first_tokens(model, drafter, prompt, seed=5)
    assert_exact(counts, from_draft, p, accept, q)


def test_processors_shape_every_drafted_position_as_plain_decoding(tmp_path):
    """Penalties and a logit bias at every drafted position: DFlash's greedy tokens are plain
    decoding's with the same processors (a draft the processors would not have produced is rejected)."""
    model = models.build("qwen3_5")
    tk = test_tokenizer.tokenizer(eos=False)
    procs = lambda: make_processors(vocab_size=models.VOCAB, repetition_penalty=1.5,  # noqa: E731
                                    logit_bias={7: 3.0, 11: -2.0})
    want = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=12, processors=procs())]
    drafter = _blind(model, tmp_path, want)
    got = list(stream_generate(model, tk, PROMPT, max_tokens=12, processors=procs(), dflash=drafter, adaptive=False))
    assert [r.token for r in got] == want
