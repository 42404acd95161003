"""A fork followed by one forward step allocates memory for that step only."""

import segcache  # noqa: F401

import copy
import gc

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


def _branch_growth(model, steps, strategy="states", **kw):
    """(bytes held after a `steps`-token branch above the resting state, peak kept-state bytes)."""
    from segcache.layers import RecurrentLayer

    rt = Runtime(model, recurrent_strategy=strategy, **kw)
    mx.eval(rt.forward(list(range(1, 17))), [c.state for c in rt.cache])
    gc.collect()  # earlier tests' garbage must not be freed inside the measurement
    mx.clear_cache()
    base = mx.get_active_memory()
    kept = 0
    with rt.fork():
        for t in range(steps):
            mx.eval(rt.forward([t % 60]), [c.state for c in rt.cache])
            kept = max(kept, sum(c.kept_bytes for c in rt.cache if isinstance(c, RecurrentLayer)))
        rt.check()
        return mx.get_active_memory() - base, kept


def test_a_long_states_branch_holds_its_budget_not_its_length():
    # Qwen3-Next's state width (32 value heads of 128 x 128): 2 MiB per state per layer
    model = models.build(
        "qwen3_5", linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    steps, budget = 24, 8 << 20  # 2 recurrent layers: 4 MiB (2 states) each
    _branch_growth(model, 2, "replay")  # warm up: first-use allocations are not the branch's
    replay, _ = _branch_growth(model, steps, "replay")  # inputs only: the floor
    unbounded, kept_all = _branch_growth(model, steps, branch_state_bytes=1 << 40)
    bounded, kept = _branch_growth(model, steps, branch_state_bytes=budget)
    assert kept_all == steps * 2 * (2 << 20)  # the control keeps every state: 96 MiB
    assert kept <= budget
    assert unbounded >= replay + kept_all * 3 / 4, (replay, unbounded)  # the control holds its states
    assert bounded <= replay + budget + (2 << 20), (replay, bounded)  # the bounded run holds its budget
