"""The recurrent adapters: bit-identical to the unpatched mlx-lm modules, and invisible outside branches."""

import segcache  # noqa: F401

import importlib

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from conftest import tiny
from segcache import Runtime
from segcache.adapters import FAMILIES, find_recurrent_module
from segcache.layers import RecurrentLayer
from segcache.testing import models


def _gdn(family):
    """A fresh model's first Gated DeltaNet module and its unpatched class."""
    model = models.build(family, seed=1)
    module, base = find_recurrent_module(model.layers[0])
    return model, module, base


@pytest.mark.parametrize("strategy,budget", [("replay", None), ("states", None), ("states", 0)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_branch_forward_is_bit_identical_to_mlx_lm_module(hybrid, strategy, budget, with_mask):
    model, module, base = _gdn(hybrid)
    Runtime(model)  # adapts the module
    assert type(module) is not base and isinstance(module, base)
    mx.random.seed(3)
    native = ArraysCache(size=2)
    kw = {} if budget is None else {"states_budget_bytes": budget}  # 0: "states" past its budget
    ours = RecurrentLayer(module.conv_kernel_size - 1, strategy, **kw)
    for S in (5, 1, 3):  # from empty, then from a carried state
        x = mx.random.normal((1, S, module.hidden_size))
        mask = (mx.arange(S) % 2 == 0)[None] if with_mask else None
        want = base.__call__(module, x, mask, native)
        ours.fork()
        got = module(x, mask, ours)
        assert ours.capturing and len(ours.marks[-1].records) == 1
        kept = ours.marks[-1].records[0].states
        assert (kept is not None) == (strategy == "states" and budget is None)
        ours.commit(S)
        assert mx.array_equal(got, want).item(), "outputs differ"
        assert mx.array_equal(ours[0], native[0]).item(), "conv tails differ"
        assert mx.array_equal(ours[1], native[1]).item(), "states differ"


def _record_calls(monkeypatch, family):
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    calls = []
    original = arch.gated_delta_update

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(arch, "gated_delta_update", recorder)
    return calls


def _same_call(a, b):
    (args_a, kw_a), (args_b, kw_b) = a, b
    if kw_a != kw_b or len(args_a) != len(args_b):
        return False
    for x, y in zip(args_a, args_b):
        if (x is None) != (y is None):
            return False
        if x is not None and not (x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()):
            return False
    return True


def test_outside_a_branch_gated_delta_update_gets_the_unpatched_arguments(hybrid, monkeypatch):
    model = tiny(hybrid)
    steps = [[5, 17, 3, 42, 8, 8, 1], [30], [22], [9, 14]]
    calls = _record_calls(monkeypatch, hybrid)
    native = make_prompt_cache(model)
    for ids in steps:
        mx.eval(model(mx.array(ids)[None], cache=native))
    unpatched = list(calls)
    calls.clear()
    rt = Runtime(model)
    for ids in steps:
        mx.eval(rt.forward(ids))
    assert len(calls) == len(unpatched) > 0
    assert all(_same_call(a, b) for a, b in zip(calls, unpatched))
    # kwargs include use_kernel=True: on Metal the same fused kernel runs
    assert all(kw.get("use_kernel") is True for _, kw in calls)


def test_native_caches_keep_working_after_adaptation(hybrid):
    model = models.build(hybrid, seed=2)
    prompt = mx.array([[5, 17, 3, 42, 8]])
    before = model(prompt, cache=make_prompt_cache(model))
    Runtime(model)
    Runtime(model)  # adapting twice is a no-op
    after = model(prompt, cache=make_prompt_cache(model))
    assert mx.array_equal(before, after).item()
    # a native cache inside mlx-lm's generation still works (no branch involved)
    from mlx_lm.generate import generate_step

    tokens = [t for t, _ in generate_step(prompt[0], model, max_tokens=4)]
    assert len(tokens) == 4


def test_every_family_module_is_covered():
    assert {c.__module__.rsplit(".", 1)[-1] for c in FAMILIES} == {"qwen3_next", "qwen3_5"}
