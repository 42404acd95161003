"""mlx-lm's cache protocol beyond the model's calls, on a Runtime's layers (issue 15).

References are mlx-lm's own caches fed the same calls, or a fresh runtime fed
the tokens the state should hold.
"""

import mlx.core as mx
import pytest
from conftest import tiny
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import (
    QuantizedKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from segcache import BranchError, InvariantError, Runtime, UnsupportedOperationError
from segcache.layers import KVLayer, RecurrentLayer, WindowLayer
from segcache.testing import models

PROMPT = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]


def logits_of(model, cache, ids):
    return model(mx.array(ids, dtype=mx.uint32)[None], cache=cache)


def assert_same(a, b):
    assert a.shape == b.shape and mx.array_equal(a, b).item(), float(mx.abs(a - b).max())


# -- 1. save_prompt_cache / load_prompt_cache ---------------------------------------


@pytest.mark.parametrize("strategy", ["states", "replay"])
def test_save_load_round_trip_and_fork(family, strategy, tmp_path):
    model = tiny(family)
    rt = Runtime(model, recurrent_strategy=strategy, branch_state_bytes=1 << 20)
    rt.forward(PROMPT)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, rt.cache)

    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in rt.cache]
    for src, got in zip(rt.cache, loaded):
        got.check()
        assert got.offset == len(PROMPT) and got.marks == [] and got.layout() == src.layout()
        if isinstance(got, RecurrentLayer):
            assert (got.strategy, got.states_budget_bytes) == (strategy, src.states_budget_bytes)

    # the loaded list is a prompt cache mlx-lm can run on, with the same bits
    ref = rt.clone()
    assert_same(logits_of(model, loaded, [4, 2]), ref.forward([4, 2]))

    # and a Runtime adopts it: forks, commits, ids unknown
    back = Runtime.from_prompt_cache(model, load_prompt_cache(path), recurrent_strategy=strategy)
    assert back.tokens == [None] * len(PROMPT)
    with back.fork() as br:
        back.forward([1, 2, 3])
        br.commit(2)
    back.check()
    ref = rt.clone()
    ref.forward([1, 2])
    assert_same(back.forward([6]), ref.forward([6]))


def test_save_with_an_open_branch_saves_the_committed_state(family, tmp_path):
    model = tiny(family)
    rt = Runtime(model)
    rt.forward(PROMPT)
    ref = rt.clone()
    br = rt.fork()
    rt.forward([1, 2, 3])
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, rt.cache)
    loaded = load_prompt_cache(path)
    assert {c.offset for c in loaded} == {len(PROMPT)}
    back = Runtime.from_prompt_cache(model, loaded)
    assert_same(back.forward([7, 7]), ref.forward([7, 7]))
    br.rollback()  # the branch was not touched by saving
    rt.check()


def test_an_empty_runtime_round_trips(hybrid, tmp_path):
    model = tiny(hybrid)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, Runtime(model).cache)
    back = Runtime.from_prompt_cache(model, load_prompt_cache(path))
    assert back.offset == 0
    assert_same(back.forward(PROMPT), Runtime(model).forward(PROMPT))


def test_an_inconsistent_file_is_refused(tmp_path):
    rt = Runtime(tiny("llama"))
    rt.forward(PROMPT)
    path = str(tmp_path / "cache.safetensors")
    bad = KVLayer()
    bad.keys, bad.values, bad.offset = rt.cache[0].keys[..., :3, :], rt.cache[0].values, 3
    save_prompt_cache(path, [bad])
    with pytest.raises(ValueError, match="load_prompt_cache: .*buffer shapes"):
        load_prompt_cache(path)


def test_from_prompt_cache_refuses_another_layout():
    caches = Runtime(tiny("llama")).cache
    with pytest.raises(ValueError, match="layer 0"):
        Runtime.from_prompt_cache(tiny("gemma3_text"), caches + [KVLayer()])
    with pytest.raises(ValueError, match="1 caches for 2 layers"):
        Runtime.from_prompt_cache(tiny("llama"), caches[:1])


def test_layer_names_are_added_to_mlx_lm_not_replaced():
    assert mlx_cache.KVLayer is KVLayer and mlx_cache.WindowLayer is WindowLayer
    assert mlx_cache.RecurrentLayer is RecurrentLayer
    assert mlx_cache.KVCache is not KVLayer and KVLayer.__mro__[-2].__module__ == "mlx_lm.models.cache"


# -- 2. kv_bits -----------------------------------------------------------------------


def test_kv_bits_on_a_sliding_window_model_is_refused_before_anything_is_swapped():
    # gemma3_text's first layers are windows, which have no quantized kind (nor in mlx-lm);
    # full-attention layers quantize (tests/test_compat_kinds.py)
    model = tiny("gemma3_text")
    rt = Runtime(model)
    rt.forward(PROMPT)
    layers = list(rt.cache)
    with pytest.raises(UnsupportedOperationError, match="kv_bits.*sliding-window"):
        for _ in generate_step(mx.array([4, 5, 6]), model, prompt_cache=rt.cache, kv_bits=4, quantized_kv_start=0, max_tokens=2):
            pass
    assert all(a is b for a, b in zip(rt.cache, layers))
    rt.check()
    with rt.fork():
        rt.forward([1])


def test_a_replaced_entry_is_named_at_the_next_operation():
    rt = Runtime(tiny("llama"))
    rt.forward(PROMPT)
    rt.cache[1] = QuantizedKVCache()
    for op in (rt.fork, lambda: rt.forward([1]), rt.clone):
        with pytest.raises(UnsupportedOperationError, match=r"rt.cache\[1\] is a QuantizedKVCache"):
            op()
    with pytest.raises(InvariantError, match="QuantizedKVCache"):
        rt.check()
    assert rt.depth == 0 and rt.cache[0].offset == len(PROMPT)


# -- 3. trim inside a branch of a sliding window ------------------------------------


@pytest.mark.parametrize("keep", [None, 0, 1, 2])
def test_window_trim_inside_a_branch_matches_mlx_lm(keep):
    """forward 2, trim 1, forward 1, commit (keep tokens of the branch, or all)."""
    model = tiny("gemma3_text")
    prompt = PROMPT[:4]  # inside the window (8): mlx-lm can trim too
    rt, ref = Runtime(model), make_prompt_cache(model)
    assert_same(rt.forward(prompt), logits_of(model, ref, prompt))
    rt.fork()
    assert_same(rt.forward([1, 2]), logits_of(model, ref, [1, 2]))
    assert trim_prompt_cache(rt.cache, 1) == trim_prompt_cache(ref, 1) == 1
    rt.check()
    assert_same(rt.forward([3]), logits_of(model, ref, [3]))
    rt.commit(keep)
    rt.check()
    if keep is None:
        assert rt.tokens == prompt + [1, 3]
    else:  # the reference: a fresh mlx-lm cache fed what was kept, in the same chunks
        ref = make_prompt_cache(model)
        logits_of(model, ref, prompt)
        for chunk in ([1], [3])[:keep]:
            logits_of(model, ref, chunk)
        assert rt.tokens == prompt + [1, 3][:keep]
    for ids in ([4, 5], [6], [7, 8, 9, 10, 11, 12]):  # past the window
        assert_same(rt.forward(ids), logits_of(model, ref, ids))


def test_window_trim_past_the_window_is_refused():
    model = tiny("gemma3_text")
    rt = Runtime(model)
    rt.forward(PROMPT)  # 12 tokens > window 8
    with rt.fork():
        rt.forward([1, 2])
        assert trim_prompt_cache(rt.cache, 1) == 0  # is_trimmable() is False, as in mlx-lm
        with pytest.raises(UnsupportedOperationError, match="wrapped"):
            rt.cache[0].trim(1)
        rt.check()
        assert rt.offset == len(PROMPT) + 2


# -- 4. trim_prompt_cache and the runtime's invariants ------------------------------


@pytest.mark.parametrize("fam", ["llama", "gemma3_text"])
def test_trim_forgets_the_trimmed_ids(fam):
    model = tiny(fam)
    rt = Runtime(model)
    rt.forward(PROMPT[:6])
    assert trim_prompt_cache(rt.cache, 2) == 2
    rt.check()
    assert rt.tokens == PROMPT[:4]
    # a trim, then a direct model call refilling the positions: the ids are unknown
    trim_prompt_cache(rt.cache, 2)
    logits_of(model, rt.cache, [9, 9, 9])
    rt.check()
    assert rt.tokens == PROMPT[:2] + [None] * 3
    ref = make_prompt_cache(model)  # mlx-lm fed the same calls
    logits_of(model, ref, PROMPT[:6])
    trim_prompt_cache(ref, 4)
    logits_of(model, ref, [9, 9, 9])
    assert_same(rt.forward([1]), logits_of(model, ref, [1]))


def test_trim_inside_a_branch_then_commit_keeps_the_ids():
    model = tiny("llama")
    rt = Runtime(model)
    rt.forward(PROMPT[:4])
    with rt.fork() as br:
        rt.forward([1, 2, 3])
        trim_prompt_cache(rt.cache, 2)
        logits_of(model, rt.cache, [5])
        rt.check()
        br.commit()
    assert rt.tokens == PROMPT[:4] + [1, None]


@pytest.mark.parametrize("fam", ["llama", "gemma3_text"])
def test_trim_below_an_open_branch_is_refused(fam):
    rt = Runtime(tiny(fam))
    rt.forward(PROMPT[:4])
    rt.fork()
    rt.forward([1, 2])
    with pytest.raises(BranchError, match="below the innermost open branch"):
        trim_prompt_cache(rt.cache, 3)
    rt.check()
    assert rt.offset == 6 and rt.tokens == PROMPT[:4] + [1, 2]
    rt.rollback()
    rt.check()
    assert rt.tokens == PROMPT[:4]


# -- 5. merge / extract (mlx-lm's BatchGenerator) -------------------------------------


def test_batching_calls_on_a_single_layer_are_refused(hybrid):
    # merging is supported (tests/test_compat_kinds.py); a single layer holds one sequence
    model = tiny(hybrid)
    a = Runtime(model)
    a.forward(PROMPT)
    recurrent = next(c for c in a.cache if isinstance(c, RecurrentLayer))
    for call in (lambda: recurrent.extract(0), lambda: recurrent.filter([0]), lambda: recurrent.extend(recurrent),
                 lambda: recurrent.prepare(lengths=[1])):
        with pytest.raises(UnsupportedOperationError, match="merge layers first"):
            call()
    a.check()


# -- trims among every other operation, against mlx-lm fed the same calls ---------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("forward"), st.lists(st.integers(0, 63), min_size=1, max_size=3)),
        st.tuples(st.just("direct"), st.lists(st.integers(0, 63), min_size=1, max_size=3)),
        st.tuples(st.just("trim"), st.integers(0, 4)),
        st.tuples(st.just("fork"), st.none()),
        st.tuples(st.just("commit"), st.none()),
        st.tuples(st.just("rollback"), st.none()),
    ),
    max_size=14,
)


@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_trims_keep_every_invariant(ops):
    """Dense model: rollback of a branch is mlx-lm's trim of its length, so mlx-lm follows every step."""
    model = tiny("llama")
    rt, ref = Runtime(model), make_prompt_cache(model)
    ids, bases = [], []  # expected ids (None: fed directly), open branches' base offsets
    rt.forward([1, 2])
    logits_of(model, ref, [1, 2])
    ids += [1, 2]
    for op, arg in ops:
        if op in ("forward", "direct"):
            got = rt.forward(arg) if op == "forward" else logits_of(model, rt.cache, arg)
            assert_same(got, logits_of(model, ref, arg))
            ids += arg if op == "forward" else [None] * len(arg)
        elif op == "trim":
            arg = min(arg, len(ids))  # mlx-lm trims at most what is there
            if bases and len(ids) - arg < bases[-1]:
                with pytest.raises(BranchError):
                    trim_prompt_cache(rt.cache, arg)
            else:
                assert trim_prompt_cache(rt.cache, arg) == trim_prompt_cache(ref, arg)
                del ids[len(ids) - arg :]
        elif op == "fork":
            rt.fork()
            bases.append(len(ids))
        elif bases and op == "commit":
            rt.commit()
            bases.pop()
        elif bases:
            rt.rollback()
            trim_prompt_cache(ref, len(ids) - bases[-1])
            del ids[bases.pop() :]
        rt.check()
        assert rt.offset == len(ids) == ref[0].offset
    assert rt.tokens == ids


@pytest.mark.parametrize("fam", models.RECURRENT)
def test_every_recurrent_family_round_trips_through_mlx_lm_files(tmp_path, fam):
    """StateLayer and CompositeLayer save their committed state and load back into a Runtime."""
    model = models.build(fam, seed=1)
    rt = Runtime(model)
    rt.forward([1, 2, 3, 4])
    path = str(tmp_path / "cache.safetensors")
    with rt.fork():
        rt.forward([5, 6])  # an open branch is not saved
        save_prompt_cache(path, rt.cache)
    back = Runtime.from_prompt_cache(model, load_prompt_cache(path))
    back.check()
    assert back.offset == 4
    assert mx.array_equal(back.forward([9]), rt.forward([9])).item()
