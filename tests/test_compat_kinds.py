"""segcache's own kinds through mlx-lm's kv_bits and batching calls (issue 15, items 2 and 5).

References: mlx-lm's own caches (`make_prompt_cache`, `QuantizedKVCache`)
fed exactly the tokens the segcache state should hold, and mlx-lm's own
`batch_generate` on mlx-lm's caches.
"""

import functools

import mlx.core as mx
import pytest
from conftest import tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import (
    _merge_caches,
    batch_generate,
    generate_step,
    maybe_quantize_kv_cache,
)
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from segcache import BranchError, Runtime, UnsupportedOperationError, open_store
from segcache.layers import (
    BatchCompositeLayer,
    BatchKVLayer,
    BatchRecurrentLayer,
    BatchStateLayer,
    CompositeLayer,
    KVLayer,
    QuantizedKVLayer,
    RecurrentLayer,
    StateLayer,
    WindowLayer,
)
from segcache.testing import models

PROMPT = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]
DRAFT = [4, 2, 6, 1]
G, BITS = 32, 4  # the tiny models get head_dim=32 here: mx.quantize needs a multiple of the group


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def qmodel(request):
    return models.build(request.param, head_dim=32)


def ids(tokens):
    return mx.array(tokens, dtype=mx.uint32)[None]


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def quantized_parts(cache):
    """Every quantized layer's committed (keys, values) components, in layer order."""
    return [a for c in cache if hasattr(c, "bits") for part in c.keys_and_values() for a in part]


# -- quantized KV (kv_bits) -----------------------------------------------------------


def test_a_quantized_branch_commits_to_mlx_lm_fed_exactly_the_kept_tokens(qmodel):
    """Mutation caught: QuantizedKVLayer.commit keeping mark + n + 1 (or rollback not restoring)."""
    base = Runtime(qmodel)
    base.forward(PROMPT)
    maybe_quantize_kv_cache(base.cache, 0, G, BITS)  # mlx-lm's own kv_bits swap
    assert any(isinstance(c, QuantizedKVLayer) for c in base.cache)
    for n in range(len(DRAFT) + 1):
        rt = base.clone()
        with rt.fork() as br:
            for t in DRAFT:  # the drafts one at a time, as a draft loop feeds them
                rt.forward([t])
            br.commit(n)
        rt.check()
        ref = make_prompt_cache(qmodel)
        qmodel(ids(PROMPT), cache=ref)
        maybe_quantize_kv_cache(ref, 0, G, BITS)
        for t in DRAFT[:n]:
            qmodel(ids([t]), cache=ref)
        got, want = quantized_parts(rt.cache), quantized_parts(ref)
        assert got and len(got) == len(want) and all(same(a, b) for a, b in zip(got, want)), n
        assert same(rt.forward([7]), qmodel(ids([7]), cache=ref))
    # a rollback leaves the committed rows as they were; the base never saw the branches
    rt = base.clone()
    before = [a[...] for a in quantized_parts(rt.cache)]
    rt.fork()
    rt.forward(DRAFT)
    rt.rollback()
    assert all(same(a, b) for a, b in zip(quantized_parts(rt.cache), before))
    assert base.offset == len(PROMPT)


def test_kv_bits_generate_step_on_rt_cache_then_fork_and_commit(qmodel):
    """Mutation caught: Runtime._own_layers not adopting the replacement (fork raises)."""
    prompt = mx.array(PROMPT)
    rt = Runtime(qmodel)
    got = [t for t, _ in generate_step(prompt, qmodel, prompt_cache=rt.cache, kv_bits=BITS, kv_group_size=G,
                                       quantized_kv_start=0, max_tokens=4)]
    ref = make_prompt_cache(qmodel)
    want = [t for t, _ in generate_step(prompt, qmodel, prompt_cache=ref, kv_bits=BITS, kv_group_size=G,
                                        quantized_kv_start=0, max_tokens=4)]
    assert got == want
    assert {type(c) for c in rt.cache} >= {QuantizedKVLayer}
    rt.check()
    fed = rt.offset  # generate_step computes one token ahead
    assert fed == ref[-1].offset > len(PROMPT)
    with rt.fork() as br:
        for t in DRAFT:
            rt.forward([t])
        br.commit(2)
    rt.check()
    for t in DRAFT[:2]:
        qmodel(ids([t]), cache=ref)
    assert rt.offset == fed + 2 == ref[-1].offset
    assert all(same(a, b) for a, b in zip(quantized_parts(rt.cache), quantized_parts(ref)))
    assert same(rt.forward([5]), qmodel(ids([5]), cache=ref))


def test_to_quantized_inside_a_branch_is_refused_and_swaps_nothing(qmodel):
    """Mutation caught: dropping the branch check in KVLayer.to_quantized."""
    rt = Runtime(qmodel)
    rt.forward(PROMPT)
    layers = list(rt.cache)
    with rt.fork():
        rt.forward(DRAFT)
        with pytest.raises(BranchError, match="kv_bits"):
            maybe_quantize_kv_cache(rt.cache, 0, G, BITS)
        assert all(a is b for a, b in zip(rt.cache, layers))
        assert all(c.replaced_by is None for c in rt.cache)
        rt.check()


def test_a_batch_runtime_refuses_a_quantized_row_and_changes_nothing():
    """Mutation caught: no check in BatchRuntime.join (the hybrid's first recurrent layer gets a
    row before the quantized KV layer fails)."""
    from segcache import BatchRuntime

    model = models.build("qwen3_next", head_dim=32)
    rt = Runtime(model)
    rt.forward(PROMPT)
    maybe_quantize_kv_cache(rt.cache, 0, G, BITS)
    batch = BatchRuntime(model)
    batch.join("a", Runtime(model))
    with pytest.raises(UnsupportedOperationError, match="quantized"):
        batch.join("b", rt)
    assert batch.ids == ["a"]
    batch.check()
    assert all(c.cache[0] is None for c in batch.cache if isinstance(c, BatchRecurrentLayer))


def test_quantized_layers_round_trip_through_mlx_lm_files(qmodel, tmp_path):
    """Mutation caught: QuantizedKVLayer not registered with mlx-lm's loader (KeyError), or its
    state saving the open branch's rows."""
    rt = Runtime(qmodel)
    rt.forward(PROMPT)
    maybe_quantize_kv_cache(rt.cache, 0, G, BITS)
    rt.fork()
    rt.forward(DRAFT)  # not saved: the committed state is
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, rt.cache)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in rt.cache]
    for c in loaded:
        c.check()
        assert c.offset == len(PROMPT)
    rt.rollback()
    assert all(same(a, b) for a, b in zip(quantized_parts(loaded), quantized_parts(rt.cache)))
    assert same(qmodel(ids([7]), cache=loaded), rt.forward([7]))


def test_the_prefix_store_keeps_quantized_pages_apart(tmp_path):
    """Quantized rows are pages of their own layout: an unquantized runtime never resumes them, and
    a runtime quantized alike resumes them bit-identical. Mutation caught: the quantized layout left
    out of the identity (the fresh runtime would load quantized rows as K/V, or fail on them)."""
    model = models.build("llama", head_dim=32)
    store = open_store(tmp_path / "s", page_tokens=4)
    rt = Runtime(model, store=store)
    rt.prefill(PROMPT)  # unquantized pages of PROMPT
    maybe_quantize_kv_cache(rt.cache, 0, G, BITS)
    rt.forward(DRAFT)
    rt.publish()  # quantized pages of PROMPT + DRAFT
    longer = PROMPT + DRAFT + [7]
    plain = Runtime(model, store=store)
    assert next(plain.prefill_steps(longer)).restored == len(PROMPT)  # the unquantized records only
    quantized = Runtime(model, store=store)
    quantized.quantize_like(rt)  # empty quantized layers: the layout rt publishes under
    assert next(quantized.prefill_steps(longer)).restored == len(PROMPT + DRAFT)
    assert all(same(a, b) for a, b in zip(quantized_parts(quantized.cache), quantized_parts(rt.cache)))
    assert same(quantized.forward([7]), rt.forward([7]))
    quantized.check()


# -- merge / extract (mlx-lm's BatchGenerator) ---------------------------------------


def _rows(model):
    a, b, c = Runtime(model), Runtime(model), Runtime(model)
    a.forward(PROMPT)
    c.forward(PROMPT[:3])
    return [a, b, c]  # b is empty


def _assert_layer_equal(got, want):
    assert type(got) is type(want) and got.offset == want.committed_offset
    got.check()
    if isinstance(want, KVLayer):
        if want.offset:
            for x, y in zip(got.keys_and_values(), want.keys_and_values()):
                assert same(x, y)
    elif isinstance(want, (RecurrentLayer, StateLayer)):
        assert got.layout() == want.layout()
        for x, y in zip(got.cache, want.cache):
            assert (x is None) == (y is None) and (x is None or same(x, y))
    else:
        for x, y in zip(got.caches, want.caches):
            _assert_layer_equal(x, y)


@pytest.mark.parametrize("fam", ["llama", "qwen3_next", "qwen3_5", "lfm2"])
def test_merge_keeps_every_row_and_extract_gives_it_back(fam):
    """Mutations caught: merge dropping empty rows or the conv tail length (RecurrentLayer(2)),
    extract slicing a row to the longest length."""
    model = tiny(fam)
    rts = _rows(model)
    merged = _merge_caches([rt.cache for rt in rts])
    kinds = {KVLayer: BatchKVLayer, RecurrentLayer: BatchRecurrentLayer, StateLayer: BatchStateLayer}
    assert [type(m) for m in merged] == [kinds[type(c)] for c in rts[0].cache]
    for m, c in zip(merged, rts[0].cache):
        if isinstance(m, BatchKVLayer):
            assert m.keys.shape[2] == len(PROMPT) and m.lengths == [len(PROMPT), 0, 3]
        else:
            assert m.layout() == c.layout() and m.row_offsets == [len(PROMPT), 0, 3]
    for i, rt in enumerate(rts):
        extracted = [m.extract(i) for m in merged]
        for got, want in zip(extracted, rt.cache):
            _assert_layer_equal(got, want)
        back = Runtime.from_prompt_cache(model, extracted)
        assert back.offset == rt.offset
        assert same(back.forward([7, 1]), rt.forward([7, 1]))


def test_filter_and_extend_keep_the_rows_they_name():
    """Mutation caught: filter ignoring the order of the indices, extend losing the lengths."""
    model = tiny("qwen3_next")
    rts = _rows(model)
    merged = _merge_caches([rt.cache for rt in rts])
    for m in merged:
        m.filter(mx.array([2, 0]))
    more = _merge_caches([rts[1].cache, rts[0].cache])
    for m, o in zip(merged, more):
        m.extend(o)
    order = [rts[2], rts[0], rts[1], rts[0]]
    for i, rt in enumerate(order):
        for m, want in zip(merged, rt.cache):
            _assert_layer_equal(m.extract(i), want)


# dense, Gated DeltaNet, and StateLayer families: one that advances (lfm2), one whose hook
# counts (mamba), one whose layers are composites (falcon_h1)
@pytest.mark.parametrize("fam", ["llama", "qwen3_next", "lfm2", "mamba", "falcon_h1"])
def test_mlx_lm_batch_generate_on_runtime_caches(fam):
    """mlx-lm's batch_generate, given Runtimes' caches: the tokens mlx-lm's own caches give, and
    segcache's kinds back (a Runtime adopts them and forks).

    Mutations caught: BatchKVLayer.finalize not applying the real lengths (pads become tokens);
    BatchRecurrentLayer / BatchStateLayer counting pads as tokens; the hook not counting tokens
    on the batched state kind (mamba).
    """
    model = tiny(fam)
    prefixes, rests = [PROMPT[:6], [7], [2, 7, 1, 8]], [[4, 2], [9, 9, 9, 1], [6]]

    class Tok:
        eos_token_ids = (models.VOCAB,)  # never sampled

        def decode(self, tokens):
            return ""

    def run(caches):
        return batch_generate(model, Tok(), rests, prompt_caches=caches, max_tokens=5,
                              return_token_ids=True, return_prompt_caches=True)

    ref = []
    for p in prefixes:
        c = make_prompt_cache(model)
        model(ids(p), cache=c)
        ref.append(c)
    rts = [Runtime(model) for _ in prefixes]
    for rt, p in zip(rts, prefixes):
        rt.forward(p)
    want, got = run(ref), run([rt.cache for rt in rts])
    assert got.token_ids == want.token_ids
    for cache, p, rest, toks in zip(got.caches, prefixes, rests, got.token_ids):
        assert {type(c) for c in cache} <= {KVLayer, RecurrentLayer, StateLayer, CompositeLayer}
        back = Runtime.from_prompt_cache(model, cache)
        assert len(toks) == 5 and back.offset == len(p) + len(rest) + 5  # each token fed, the last too
        with back.fork():
            back.forward([1, 2])
        back.check()


def test_merge_refusals_change_nothing(hybrid):
    """Mutation caught: merge of a layer with an open branch (its rows would be half a branch)."""
    model = tiny(hybrid)
    a, b = _rows(model)[:2]
    a.fork()
    a.forward(DRAFT)
    for layer in (c for c in a.cache if isinstance(c, (KVLayer, RecurrentLayer))):
        with pytest.raises(BranchError, match="open branch"):
            type(layer).merge([layer, b.cache[a.cache.index(layer)]])
    a.rollback()
    a.check()
    kv = next(c for c in a.cache if isinstance(c, KVLayer))
    with pytest.raises(UnsupportedOperationError, match="one kind"):
        KVLayer.merge([kv, WindowLayer(4)])
    with pytest.raises(UnsupportedOperationError, match="RecurrentLayers only"):
        RecurrentLayer.merge([next(c for c in a.cache if isinstance(c, RecurrentLayer)), kv])


def test_kinds_without_a_batched_form_refuse_merge():
    window = WindowLayer(4)
    window.update_and_fetch(mx.zeros((1, 2, 6, 16)), mx.zeros((1, 2, 6, 16)))  # dropped 2 tokens
    with pytest.raises(UnsupportedOperationError, match="dropped tokens"):
        KVLayer.merge([window, WindowLayer(4)])
    # longcat_flash_ngram's token context grows with the first tokens: rows of 1 and 3
    # ids cannot be stacked (mlx-lm's ArraysCache.merge broadcasts the shorter one)
    model = tiny("longcat_flash_ngram")
    a, b = Runtime(model), Runtime(model)
    a.forward(PROMPT)
    b.forward(PROMPT[:2])
    with pytest.raises(UnsupportedOperationError, match="slot 0 has shapes"):
        _merge_caches([a.cache, b.cache])
    with pytest.raises(UnsupportedOperationError, match="not batched"):
        QuantizedKVLayer.merge([QuantizedKVLayer()])
    a.check()
    b.check()


def test_composite_merge_extracts_composites():
    """CompositeLayer.merge gives a BatchCompositeLayer whose extract is a CompositeLayer."""
    a, b = CompositeLayer(KVLayer(), KVLayer()), CompositeLayer(KVLayer(), KVLayer())
    k = mx.random.normal((1, 2, 5, 16))
    for c in a.caches:
        c.update_and_fetch(k, k + 1)
    merged = CompositeLayer.merge([a, b])
    assert type(merged) is BatchCompositeLayer
    for i, want in enumerate((a, b)):
        got = merged.extract(i)
        assert type(got) is CompositeLayer
        _assert_layer_equal(got, want)


# -- random programs on a quantized runtime ------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("forward"), st.integers(0, models.VOCAB - 1)),
        st.tuples(st.just("fork"), st.just(0)),
        st.tuples(st.just("commit"), st.integers(0, 6)),
        st.tuples(st.just("rollback"), st.just(0)),
    ),
    max_size=14,
)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_random_programs_on_a_quantized_runtime_match_mlx_lm(ops):
    """fork / 1-token forwards / commit(n) / rollback on a kv_bits runtime: every forward's logits
    bit for bit those of mlx-lm's QuantizedKVCache fed exactly the tokens the runtime holds.

    Mutation caught: QuantizedKVLayer.commit keeping one token too many."""
    model = _llama32()
    rt = Runtime(model)
    rt.forward(PROMPT)
    maybe_quantize_kv_cache(rt.cache, 0, G, BITS)
    held, bases = [], []  # tokens past the prompt; where each open branch began (in held)
    for op, arg in ops:
        if op == "forward":
            got = rt.forward([arg])
            ref = make_prompt_cache(model)
            model(ids(PROMPT), cache=ref)
            maybe_quantize_kv_cache(ref, 0, G, BITS)
            for t in held:
                model(ids([t]), cache=ref)
            assert same(got, model(ids([arg]), cache=ref))
            held.append(arg)
        elif op == "fork":
            rt.fork()
            bases.append(len(held))
        elif op == "commit" and bases and arg <= len(held) - bases[-1]:
            rt.commit(arg)
            del held[bases.pop() + arg :]
        elif op == "rollback" and bases:
            rt.rollback()
            del held[bases.pop() :]
        rt.check()
        assert rt.offset == len(PROMPT) + len(held)



@functools.cache
def _llama32():
    return models.build("llama", head_dim=32)
