"""The chunked Gated DeltaNet prefill agrees with mlx-lm's per-token recurrence.

References are independent: mlx-lm's `gated_delta_ops` for the recurrence,
mlx-lm's own modules and caches (`make_prompt_cache`) for models. Tolerances
(fp32): recurrence outputs and states within 1e-4 of the reference's largest
magnitude (observed ~2e-6); last-position logits within max relative error
1e-3 (observed ~3e-7) with the same greedy tokens. bf16 / fp16 inputs: the
chunked form computes in fp32 and rounds once, mlx-lm rounds each output;
outputs within 5e-3 (bf16; observed 6e-4) and 1e-3 (fp16; 7e-5) of the largest
magnitude, states within 1e-4 (both keep fp32 state); a half-precision model's
last logits within 3e-2 (bf16; observed 6e-3) and 5e-3 (fp16; 7e-4).
"""

import segcache  # noqa: I001  (binds the system BLAS before mlx is imported)

import importlib
import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as gd
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from conftest import tiny
from helpers import assert_snapshot_equal, assert_states_equal, runtime_state, snapshot
from segcache import Runtime, open_store
from segcache import prefill as store_prefill
from segcache.adapters import chunked, find_recurrent_module
from segcache.generation import stream_generate
from segcache.layers import RecurrentLayer
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from segcache.testing.statemachine import machine_for, run_machine

LOGIT_RTOL = 1e-3
TARGET = Path(segcache.__file__).parent / "models" / "target"


@pytest.fixture
def every_block(monkeypatch):
    """Make blocks of any length (1 included) run chunked under gdn_prefill="chunked"."""
    monkeypatch.setattr(chunked, "CHUNKED_FROM", 1)


def ids(n, seed=0, vocab=models.VOCAB):
    rnd = random.Random(seed)
    return [rnd.randrange(vocab) for _ in range(n)]


def rel(a, b, where=None):
    """max |a - b| / max |b| (over positions where `where` is True)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    d = mx.abs(a - b)
    if where is not None:
        d = d * where
    return (d.max() / mx.abs(b).max()).item()


def recurrence_inputs(B, T, Hk, Hv, D, seed=0, dtype=mx.float32):
    """Inputs as mlx-lm's module makes them: normalized q, k; g from compute_g; a carried state."""
    mx.random.seed(seed)
    q, k = gd.normalize_qk(mx.random.normal((B, T, Hk, D)), mx.random.normal((B, T, Hk, D)), inv_scale=D**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, D))
    a_log = mx.log(mx.random.uniform(0.5, 16, (Hv,)))
    g = gd.compute_g(a_log, mx.random.normal((B, T, Hv)) - 2, mx.ones(Hv))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = 0.3 * mx.random.normal((B, Hv, D, D))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, state


def masks(B, T, seed):
    mx.random.seed(seed + 100)
    trailing = mx.arange(T)[None] < mx.array([max(T - 7, 0), T])[:, None]  # right padding
    leading = mx.arange(T)[None] >= mx.array([0, min(5, T - 1)])[:, None]  # left padding
    scattered = mx.random.uniform(shape=(B, T)) > 0.3
    return {"none": None, "trailing": trailing[:B], "leading": leading[:B], "scattered": scattered}


# -- 1. the recurrence against gated_delta_ops ---------------------------------------


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("mask_kind", ["none", "trailing", "leading", "scattered"])
def test_recurrence_matches_gated_delta_ops(T, mask_kind):
    q, k, v, g, beta, state = recurrence_inputs(2, T, 2, 4, 16, seed=T)
    mask = masks(2, T, T)[mask_kind]
    want_y, want_s = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    got_y, got_s = chunked.chunked_gated_delta(q, k, v, g, beta, state, mask)
    live = 1.0 if mask is None else mask[..., None, None]
    assert got_y.shape == want_y.shape and got_y.dtype == want_y.dtype
    assert got_s.shape == want_s.shape and got_s.dtype == want_s.dtype
    assert rel(got_y, want_y, live) <= 1e-4
    assert rel(got_s, want_s) <= 1e-4


@pytest.mark.parametrize("with_mask", [False, True])
def test_recurrence_at_4096_tokens_and_small_chunks(with_mask):
    q, k, v, g, beta, state = recurrence_inputs(1, 4096, 1, 2, 32, seed=7)
    mask = masks(1, 4096, 7)["scattered"] if with_mask else None
    live = 1.0 if mask is None else mask[..., None, None]
    want_y, want_s = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    for chunk, group in [(64, 16), (16, 3)]:  # several groups; a ragged last group
        got_y, got_s = chunked.chunked_gated_delta(q, k, v, g, beta, state, mask, chunk=chunk, group=group)
        assert rel(got_y, want_y, live) <= 1e-4 and rel(got_s, want_s) <= 1e-4, (chunk, group)


def test_recurrence_from_no_state_and_with_a_vanishing_gate():
    q, k, v, g, beta, _ = recurrence_inputs(1, 130, 2, 2, 16, seed=5)
    g = mx.where(mx.arange(130)[None, :, None] == 70, 0.0, g)  # g == 0: a full reset
    want_y, want_s = gd.gated_delta_ops(q, k, v, g, beta, None)
    got_y, got_s = chunked.chunked_gated_delta(q, k, v, g, beta, None)
    assert not mx.any(mx.isnan(got_y)).item()
    assert rel(got_y, want_y) <= 1e-4 and rel(got_s, want_s) <= 1e-4


@pytest.mark.parametrize("products", [False, True])  # LAPACK (CPU) / matrix products (other devices)
def test_unit_lower_inverse(products):
    mx.random.seed(1)
    # a strong first subdiagonal keeps high powers of L (up to L^63) above the tolerance
    L = mx.tril(0.05 * mx.random.normal((3, 64, 64)), k=-2) + 0.9 * mx.eye(64, k=-1)
    inv = chunked._unit_lower_inverse(L, products=products)
    assert mx.abs(inv @ (mx.eye(64) + L) - mx.eye(64)).max().item() <= 1e-4


@pytest.mark.parametrize("dtype, tol", [(mx.bfloat16, 5e-3), (mx.float16, 1e-3)])
def test_recurrence_half_precision_inputs(dtype, tol):
    q, k, v, g, beta, state = recurrence_inputs(1, 300, 2, 4, 32, seed=11, dtype=dtype)
    want_y, want_s = gd.gated_delta_ops(q, k, v, g, beta, state)
    got_y, got_s = chunked.chunked_gated_delta(q, k, v, g, beta, state)
    assert got_y.dtype == want_y.dtype == dtype and got_s.dtype == want_s.dtype
    assert rel(got_y, want_y) <= tol
    assert rel(got_s, want_s) <= 1e-4


# -- 2. the adapted module and whole models ------------------------------------------


def _recurrent_pairs(ours, native):
    return [(a, b) for a, b in zip(ours, native) if isinstance(a, RecurrentLayer)]


@pytest.mark.parametrize("length", [1, 63, 64, 65, 1000])
def test_chunked_prefill_matches_mlx_lm(hybrid, length, every_block):
    model, prompt = tiny(hybrid), ids(length, seed=length)
    rt = Runtime(model, gdn_prefill="chunked")
    native = make_prompt_cache(model)
    got = rt.forward(prompt)[:, -1]
    want = model(mx.array(prompt)[None], cache=native)[:, -1]
    assert rel(got, want) <= LOGIT_RTOL
    for ours, theirs in _recurrent_pairs(rt.cache, native):
        assert rel(ours[0], theirs[0]) <= 1e-5, "conv tail"
        assert rel(ours[1], theirs[1]) <= 1e-4, "state"
    # the same greedy continuation, one token at a time (mlx-lm's path for both)
    a, b = got, want
    for _ in range(8):
        ta, tb = mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)
        assert ta.item() == tb.item()
        a = rt.forward([ta.item()])[:, -1]
        b = model(tb[None], cache=native)[:, -1]


@pytest.mark.parametrize("lengths", [None, (13, 70)])
def test_module_with_masks_and_padding(hybrid, lengths, every_block):
    """Masks where mlx-lm passes them: left padding, and batch lengths (right padding)."""
    model = models.build(hybrid, seed=1)
    module, base = find_recurrent_module(model.layers[0])
    Runtime(model)  # adapts the module
    mx.random.seed(4)
    B, S = 2, 70
    native, ours = ArraysCache(size=2), RecurrentLayer(module.conv_kernel_size - 1)
    ours.chunked_from = 1
    # a carried state first (unmasked), so an ignored mask would change it
    base.__call__(module, mx.random.normal((B, 5, module.hidden_size)), None, native)
    ours.cache = list(native.cache)
    if lengths:
        native.prepare(lengths=list(lengths))
    else:
        native.left_padding = mx.array([9, 0])
    # a RecurrentLayer refuses mlx-lm's batching calls (a Runtime holds one row): the same padding, set as prepare does
    copy = lambda a: None if a is None else mx.array(a)  # noqa: E731  (advance() rebinds in place: own objects)
    ours.lengths, ours.left_padding = copy(native.lengths), copy(native.left_padding)
    x = mx.random.normal((B, S, module.hidden_size))
    mask = native.make_mask(S)
    assert mask is not None
    want = base.__call__(module, x, mask, native)
    got = module(x, mask, ours)
    assert rel(got, want, mask[..., None]) <= 1e-4
    assert rel(ours[0], native[0]) <= 1e-5
    assert rel(ours[1], native[1]) <= 1e-4


@pytest.mark.parametrize("dtype, tol", [(mx.bfloat16, 3e-2), (mx.float16, 5e-3)])
def test_half_precision_models(dtype, tol, every_block):
    # qwen3_5 only: qwen3_next's MoE gather_mm runs fp32 only on the CPU
    model = models.build("qwen3_5", seed=3)
    model.set_dtype(dtype)
    prompt = ids(200, seed=2)
    got = Runtime(model, gdn_prefill="chunked").forward(prompt)[:, -1]
    want = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[:, -1]
    assert got.dtype == want.dtype == dtype
    assert rel(got, want) <= tol
    assert mx.argmax(got).item() == mx.argmax(want).item()


def test_shipped_target_continues_identically():
    from mlx_lm import load

    model, tokenizer = load(str(TARGET))
    text = (Path(segcache.__file__).parent / "models" / "heldout_stdlib.txt").read_text()[:4000]
    prompt = tokenizer.encode(text)[:1000]
    outs = {}
    for mode in ("native", "chunked"):
        rt = Runtime(model, gdn_prefill=mode)
        logits = rt.forward(prompt)[:, -1]
        outs[mode] = [logits]
        tokens = []
        for _ in range(64):
            tokens.append(mx.argmax(logits, axis=-1).item())
            logits = rt.forward(tokens[-1:])[:, -1]
        outs[mode].append(tokens)
    assert rel(outs["chunked"][0], outs["native"][0]) <= LOGIT_RTOL
    assert outs["chunked"][1] == outs["native"][1]


# -- 3. what stays mlx-lm's path -----------------------------------------------------


def _record_calls(monkeypatch, family):
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    calls, original = [], arch.gated_delta_update

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(arch, "gated_delta_update", recorder)
    return calls


def _same_calls(a, b):
    def same(x, y):
        if (x is None) != (y is None):
            return False
        return x is None or (x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item())

    return len(a) == len(b) > 0 and all(
        ka == kb and len(xa) == len(xb) and all(same(x, y) for x, y in zip(xa, xb))
        for (xa, ka), (xb, kb) in zip(a, b)
    )


def test_native_and_short_blocks_pass_mlx_lm_the_unpatched_arguments(hybrid, monkeypatch):
    """Property 5: "native" (any block) and "chunked" below the threshold are mlx-lm's call."""
    model = tiny(hybrid)
    short = [[5, 17, 3], [30], [22, 9]]
    assert all(len(s) < chunked.CHUNKED_FROM for s in short)
    calls = _record_calls(monkeypatch, hybrid)
    for mode, steps in [("native", [ids(100), [3]]), ("chunked", short)]:
        calls.clear()
        cache = make_prompt_cache(model)
        for step in steps:
            mx.eval(model(mx.array(step)[None], cache=cache))
        unpatched = list(calls)
        calls.clear()
        rt = Runtime(model, gdn_prefill=mode)
        for step in steps:
            mx.eval(rt.forward(step))
        assert _same_calls(calls, unpatched), mode
    # a long block under "chunked" does not reach gated_delta_update; a native cache still does
    calls.clear()
    mx.eval(Runtime(model, gdn_prefill="chunked").forward(ids(100)))
    assert calls == []
    mx.eval(model(mx.array(ids(100))[None], cache=make_prompt_cache(model)))
    assert calls


def test_auto_and_names():
    model = tiny("qwen3_5")
    assert Runtime(model).gdn_prefill == "native"  # the library default: mlx-lm's own path, bit for bit
    assert Runtime(model, gdn_prefill="auto").gdn_prefill == chunked.default_gdn_prefill()
    on_metal = mx.default_device() == mx.gpu and mx.metal.is_available()
    assert chunked.default_gdn_prefill() == ("native" if on_metal else "chunked")
    assert Runtime(model, gdn_prefill="auto").clone().gdn_prefill == chunked.default_gdn_prefill()
    with pytest.raises(ValueError, match="gdn_prefill"):
        Runtime(model, gdn_prefill="fast")


# -- 4. composition: branches, speculation, the prefix store --------------------------


@pytest.mark.parametrize("family", models.HYBRID)
def test_state_machine_with_chunked_prefill(family, every_block):
    run_machine(machine_for(tiny(family), gdn_prefill="chunked"), examples=8, steps=20)


@pytest.mark.parametrize("family", models.HYBRID)
def test_speculation_after_a_chunked_prefill_equals_plain_decoding(family):
    model, tok = tiny(family), test_tokenizer.tokenizer(eos=False)
    base = ids(150, seed=9)
    outs = []
    for lookup in (False, True):
        rt = Runtime(model, gdn_prefill="chunked")
        mx.eval(rt.forward(base[:-1]))  # 149 tokens: the chunked forward
        out = stream_generate(model, tok, base[-1:], prompt_lookup=lookup, num_draft_tokens=3, max_tokens=40, runtime=rt)
        outs.append([r.token for r in out])
        assert rt.tokens == base + outs[-1]
    assert outs[0] == outs[1]


def test_checkpoints_of_a_chunked_prefill_resume_exactly(tmp_path):
    model, prompt = tiny("qwen3_next"), ids(150, seed=4)
    with open_store(tmp_path, page_tokens=16, ram_bytes=1 << 26, disk_bytes=1 << 28) as store:
        rt = Runtime(model, store=store, gdn_prefill="chunked")
        logits = rt.prefill(prompt, checkpoints=[100])
        mx.eval(logits)
        published = snapshot(rt)
        store.evict_ram(0)  # from disk
        warm = Runtime(model, store=store, gdn_prefill="chunked")
        assert mx.array_equal(warm.prefill(prompt), logits).item()
        assert_snapshot_equal(published, warm)
        # the checkpoint at 100 holds what a chunked forward of those 100 tokens produced
        before = store.stats()["hit_tokens"]
        mid = Runtime(model, store=store, gdn_prefill="chunked")
        got = mid.prefill(prompt[:100] + [1, 2])
        assert store.stats()["hit_tokens"] - before == 100
        solo = Runtime(model, gdn_prefill="chunked")
        solo.forward(prompt[:100])
        alone = solo.forward([1, 2])[:, -1]
        # The checkpoint at 100 is kept inside the 150-token forward, whose projections ran over
        # more rows than a 100-token forward's: bit for bit where the BLAS rounds a product's
        # rows alike whatever their number (the reference BLAS, OpenBLAS on Intel), within
        # rounding where it does not (OpenBLAS on AMD EPYC), as the test below allows.
        for la, lb in zip(runtime_state(mid), runtime_state(solo)):
            for x, y in zip(la, lb):
                assert x.shape == y.shape and rel(x, y) <= 1e-4
        assert rel(got, alone) <= LOGIT_RTOL and mx.argmax(got).item() == mx.argmax(alone).item()


@pytest.mark.parametrize("family, forwards", [("qwen3_next", 1), ("qwen3_5", 1), ("llama", 1), ("gemma3_text", 4)])
def test_boundaries_inside_one_forward_checkpoint_what_stopping_there_gives(tmp_path, family, forwards):
    """A prefill whose stops lie inside one chunk runs one forward where its layers keep their
    states there (Gated DeltaNet chunked, full attention; a sliding window cannot: it stops at
    each). Each checkpoint resumes a prompt through it as a runtime fed exactly those tokens
    continues: states within rounding (the projections ran over more rows), the same logits."""
    model, prompt = tiny(family), ids(60, seed=5)
    cuts = [13, 29, 45]
    with open_store(tmp_path, page_tokens=16, ram_bytes=1 << 26) as store:
        rt = Runtime(model, store=store, gdn_prefill="chunked")
        plan = store_prefill.begin(rt, prompt, 0, cuts)
        fed = [plan.pos for _ in plan.feed(rt, 2048)] + [plan.pos]
        assert len(fed) == forwards and [s.length for s in plan.snaps] == cuts + [60]
        plan.check()
        assert plan.finish(rt) > 0
        for b in cuts:
            before = store.stats()["hit_tokens"]
            mid = Runtime(model, store=store, gdn_prefill="chunked")
            logits = mid.prefill(prompt[:b] + [1, 2])
            assert store.stats()["hit_tokens"] - before == b
            solo = Runtime(model, gdn_prefill="chunked")
            solo.forward(prompt[:b])
            alone = solo.forward([1, 2])[:, -1]
            for la, lb in zip(runtime_state(mid), runtime_state(solo)):
                for x, y in zip(la, lb):
                    assert x.shape == y.shape and rel(x, y) <= 1e-4
            assert rel(logits, alone) <= LOGIT_RTOL and mx.argmax(logits).item() == mx.argmax(alone).item()
