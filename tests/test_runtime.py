"""Runtime vs mlx-lm's own caches: same logits, drop-in wherever mlx-lm takes a cache."""

import segcache  # noqa: F401

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, ChunkedKVCache, QuantizedKVCache, make_prompt_cache

from conftest import tiny
from segcache import Runtime, UnsupportedModelError
from segcache.layers import KVLayer, RecurrentLayer, WindowLayer

PROMPT = [5, 17, 3, 42, 8, 8, 1, 30, 22, 9, 14, 60, 2]  # longer than gemma's window of 8
DECODE = [7, 11, 63, 0, 19, 4, 25, 33, 12, 50, 6]


@pytest.mark.parametrize("via", ["model", "forward"])
def test_logits_equal_mlx_lm_over_prefill_and_decode(family, via):
    model = tiny(family)
    rt = Runtime(model, gdn_prefill="native")  # bit for bit; "chunked": tests/test_chunked_gdn.py
    native = make_prompt_cache(model)

    def ours(ids):
        if via == "forward":
            return rt.forward(ids)
        return model(mx.array(ids)[None], cache=rt.cache)

    steps = [PROMPT] + [[t] for t in DECODE] + [[1, 2, 3]]
    for ids in steps:
        got, want = ours(ids), model(mx.array(ids)[None], cache=native)
        assert mx.array_equal(got, want).item(), f"{family}: logits differ after {ids}"
    total = sum(map(len, steps))
    assert rt.offset == total
    assert rt.tokens == ([t for s in steps for t in s] if via == "forward" else [None] * total)
    rt.check()


def test_layout_follows_make_cache(family):
    rt = Runtime(tiny(family))
    kinds = {type(c) for c in rt.cache}
    expected = {
        "llama": {KVLayer},
        "qwen3": {KVLayer},
        "qwen3_next": {KVLayer, RecurrentLayer},
        "qwen3_5": {KVLayer, RecurrentLayer},
        "gemma3_text": {KVLayer, WindowLayer},
    }[family]
    assert kinds == expected
    assert len(rt.cache) == len(tiny(family).layers)


def test_mlx_lm_generate_step_runs_on_rt_cache(family):
    model = tiny(family)
    prompt = mx.array(PROMPT)
    native = make_prompt_cache(model)
    want = [t for t, _ in generate_step(prompt, model, max_tokens=8, prompt_cache=native)]
    rt = Runtime(model)
    got = [t for t, _ in generate_step(prompt, model, max_tokens=8, prompt_cache=rt.cache)]
    assert got == want
    assert rt.offset == next(c.offset for c in native if hasattr(c, "offset"))
    rt.check()


def test_forward_rejects_bad_tokens_and_changes_nothing():
    rt = Runtime(tiny("qwen3_5"))
    rt.forward(PROMPT)
    before = (rt.offset, rt.tokens)
    for bad in ([], [1, -2], [1.5], "abc", mx.array([[1, 2], [3, 4]]), mx.array([0.5])):
        with pytest.raises(ValueError):
            rt.forward(bad)
        assert (rt.offset, rt.tokens) == before
    rt.check()


class _Boom(Exception):
    pass


@pytest.mark.parametrize("fam", ["qwen3_5", "gemma3_text", "llama"])
def test_forward_that_fails_half_way_leaves_state_as_it_was(fam):
    from helpers import assert_snapshot_equal, snapshot

    model = tiny(fam)
    rt = Runtime(model)
    rt.forward(PROMPT)
    last = len(model.layers) - 1
    layer = model.layers[last]
    base = type(layer)

    def explode(self, *args, **kwargs):
        raise _Boom

    layer.__class__ = type("Exploding", (base,), {"__call__": explode})
    before = snapshot(rt)
    try:
        for ids in ([3], [4, 5, 6]):
            with pytest.raises(_Boom):
                rt.forward(ids)
            assert rt.offset == len(PROMPT)
            rt.check()
    finally:
        layer.__class__ = base
    assert_snapshot_equal(before, rt)
    fresh = Runtime(model)
    fresh.forward(PROMPT)
    assert mx.array_equal(rt.forward([9]), fresh.forward([9])).item()


class _FakeModel:
    def __init__(self, caches):
        self._caches = caches
        self.layers = [object() for _ in caches]

    def make_cache(self):
        return self._caches


@pytest.mark.parametrize(
    "cache,name",
    [(QuantizedKVCache(), "QuantizedKVCache"), (ChunkedKVCache(8), "ChunkedKVCache")],
)
def test_unsupported_cache_types_are_named(cache, name):
    with pytest.raises(UnsupportedModelError, match=f"layer 1 .*{name}"):
        Runtime(_FakeModel([KVCache(), cache]))


class _LastLayerChunked:
    """A hybrid model whose last layer uses a cache segcache refuses (as llama4's chunked attention)."""

    def __init__(self, model):
        self.model, self.layers = model, model.layers

    def make_cache(self):
        caches = self.model.make_cache()
        caches[-1] = ChunkedKVCache(8)
        return caches

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def test_a_refused_model_is_not_modified():
    from segcache.testing import models

    model = models.build("qwen3_next")  # fresh: never adapted by another test
    classes = [(name, type(m)) for name, m in model.named_modules()]
    with pytest.raises(UnsupportedModelError, match=f"layer {len(model.layers) - 1} .*ChunkedKVCache"):
        Runtime(_LastLayerChunked(model))
    assert [(name, type(m)) for name, m in model.named_modules()] == classes
    Runtime(model).check()  # and the same model is accepted whole
    assert [type(m) for _, m in model.named_modules()] != [c for _, c in classes]


def test_unknown_recurrent_module_is_refused(monkeypatch):
    from mlx_lm.models import mamba

    from segcache.adapters import state

    # mamba is supported (adapters/state.py); without its hook it is an unknown module
    monkeypatch.setattr(state, "_by_class", {h.module_class: h for h in state.HOOKS if h.family != "mamba"})
    args = mamba.ModelArgs(
        model_type="mamba", vocab_size=64, hidden_size=32, intermediate_size=64, state_size=4,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
    )
    with pytest.raises(UnsupportedModelError, match="layer 0 .*ArraysCache"):
        Runtime(mamba.Model(args))


def test_mlx_lm_stream_generate_runs_on_rt_cache(hybrid):
    from mlx_lm import stream_generate

    from segcache.testing.tokenizer import tokenizer

    model, tok = tiny(hybrid), tokenizer(eos=False)
    prompt = mx.array(PROMPT)
    want = [r.token for r in stream_generate(model, tok, prompt, max_tokens=10)]
    rt = Runtime(model)
    got = [r.token for r in stream_generate(model, tok, prompt, max_tokens=10, prompt_cache=rt.cache)]
    assert got == want
    rt.check()
    # mlx-lm computes one step ahead: the cache holds the prompt and every token
    assert rt.offset == len(PROMPT) + len(got)
    with rt.fork() as br:  # and the runtime goes on from there
        rt.forward([3, 4])
        br.commit(1)
    rt.check()


def test_token_arrays_are_recorded_without_a_sync_and_in_order():
    model = tiny("qwen3_5")
    rt = Runtime(model)
    rt.forward(mx.array(PROMPT[:5]))
    rt.forward([PROMPT[5]])
    rt.forward(mx.array([PROMPT[6:9]], dtype=mx.int32))  # shape [1, S]
    assert rt._ledger.unread == 9  # not read yet
    model(mx.array([[PROMPT[9]]]), cache=rt.cache)  # fed around the runtime
    rt.forward(mx.argmax(rt.forward([PROMPT[10]])[0, -1:], axis=-1))  # a lazy next token
    rt.check()
    tokens = rt.tokens
    assert tokens[:9] == PROMPT[:9] and tokens[9] is None and tokens[10] == PROMPT[10]
    assert len(tokens) == rt.offset == 12 and isinstance(tokens[11], int)
