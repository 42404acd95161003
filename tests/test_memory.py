"""A fork followed by one forward step allocates memory for that step only."""

import segcache  # noqa: F401

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from segcache import Runtime
from segcache.testing import models

CONTEXT = 1800  # not a multiple of mlx-lm's 256-token growth step: no regrowth at the step


def _model(family):
    # wide KV so the context (MBs) dwarfs one step's activations (tens of KB)
    return models.build(family, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64)


def _prefill(model, cache):
    for start in range(0, CONTEXT, 600):
        ids = [(start + i) % 60 for i in range(600)]
        mx.eval(model(mx.array(ids)[None], cache=cache))
    mx.eval([c.state for c in cache])


def _step_peak(model, cache, before_step=lambda: None):
    """Peak bytes allocated above the resting state by one decode step."""
    mx.eval(model(mx.array([[1]]), cache=cache))  # warm up this shape
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    held = before_step()
    mx.eval(model(mx.array([[3]]), cache=cache), [c.state for c in cache])
    del held
    return mx.get_peak_memory() - base


def _kv_bytes(cache):
    return sum(c.keys.nbytes + c.values.nbytes for c in cache if getattr(c, "keys", None) is not None)


@pytest.mark.parametrize("fam", ["llama", "qwen3_5"])
def test_fork_then_one_step_allocates_only_the_step(fam):
    model = _model(fam)
    rt = Runtime(model)
    _prefill(model, rt.cache)
    context = _kv_bytes(rt.cache)
    plain = _step_peak(model, rt.cache)
    forked = _step_peak(model, rt.cache, rt.fork)
    assert forked <= plain * 1.25 + 64 * 1024, f"fork+step {forked} B vs step {plain} B"
    assert forked < context / 20, f"fork+step allocated {forked} B for a {context} B context"
    rt.check()

    # The measurement sees a copy of the context when there is one: mlx-lm's
    # deepcopy-as-fork pays for the whole buffer at the first write.
    native = make_prompt_cache(model)
    _prefill(model, native)
    copied = _step_peak(model, native, lambda: copy.deepcopy(native))
    assert copied > context / 2, f"control: deepcopy+step allocated only {copied} B"
