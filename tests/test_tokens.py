"""Token ids of a Runtime (TokenLedger): every path keeps them true, None where unknown.

Issue 9, defect 1: ids a rolled-back branch fed as a lazy array came back at
the positions a direct model call filled next, and publish stored that state
under them.
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import mlx.core as mx
import pytest

from conftest import tiny
from helpers import assert_snapshot_equal, snapshot
from segcache import BranchError, Runtime, StoreError, open_store
from segcache.testing import models

PREFIX = [1, 2, 3, 4, 5]


def _direct(rt, ids):
    """Feed `ids` around the runtime, as mlx-lm's generate_step does."""
    mx.eval(rt.model(mx.array([ids]), cache=rt.cache))


def test_rolled_back_unread_ids_never_come_back():
    rt = Runtime(tiny("qwen3_next"))
    rt.forward(PREFIX)
    with rt.fork() as br:
        rt.forward(mx.array([7, 8, 9]))
        br.rollback()
    rt.check()
    assert rt.tokens == PREFIX
    _direct(rt, [10, 11, 12])
    rt.check()
    assert rt.tokens == PREFIX + [None, None, None]
    assert rt.committed_tokens == PREFIX + [None, None, None]


def test_partial_commit_keeps_only_the_committed_unread_ids():
    rt = Runtime(tiny("qwen3_next"))
    rt.forward(mx.array(PREFIX))
    with rt.fork() as br:
        rt.forward(mx.array([7, 8, 9]))
        br.commit(1)
    rt.check()
    _direct(rt, [10, 11])
    rt.check()
    assert rt.tokens == PREFIX + [7, None, None]


def _rolled_back_then_direct(rt):
    """Defect 1's setup: unread ids of a rolled-back branch, then a direct call."""
    rt.forward(PREFIX)
    with rt.fork() as br:
        rt.forward(mx.array([7, 8, 9]))
        br.rollback()
    _direct(rt, [10])


@pytest.mark.parametrize("n", [0, 1, 2])
def test_partial_commit_after_a_rollback_and_a_direct_call(n):
    rt = Runtime(tiny("qwen3_next"))
    _rolled_back_then_direct(rt)
    with rt.fork() as br:
        rt.forward(mx.array([20, 21]))
        br.commit(n)
    rt.check()
    assert rt.tokens == PREFIX + [None] + [20, 21][:n]


def test_clone_after_a_rollback_and_a_direct_call():
    rt = Runtime(tiny("qwen3_next"))
    _rolled_back_then_direct(rt)
    with rt.fork():
        rt.forward(mx.array([20, 21]))
        clone = rt.clone()
    clone.check()
    assert clone.tokens == PREFIX + [None]


def test_nested_branches_with_lazy_and_direct_feeds():
    rt = Runtime(tiny("qwen3_next"))
    rt.forward(PREFIX)
    outer = rt.fork()
    rt.forward(mx.array([20, 21]))
    inner = rt.fork()
    rt.forward(mx.array([30, 31, 32]))
    _direct(rt, [40])
    inner.rollback()
    rt.check()
    _direct(rt, [41, 42])
    rt.forward(mx.array([50]))
    rt.check()
    assert rt.tokens == PREFIX + [20, 21, None, None, 50]
    inner = rt.fork()
    rt.forward(mx.array([60, 61]))
    inner.commit(1)
    outer.commit(6)
    rt.check()
    _direct(rt, [70])
    assert rt.tokens == PREFIX + [20, 21, None, None, 50, 60, None]


def test_clone_after_a_lazy_forward_inside_a_branch():
    rt = Runtime(tiny("qwen3_next"))
    rt.forward(PREFIX)
    with rt.fork():
        rt.forward(mx.array([7, 8, 9]))
        clone = rt.clone()
    clone.check()
    _direct(clone, [10, 11, 12])
    clone.check()
    assert clone.tokens == PREFIX + [None, None, None]
    clone.forward(mx.array([13]))
    assert clone.tokens == PREFIX + [None, None, None, 13]
    assert rt.tokens == PREFIX


def test_publish_refuses_positions_fed_directly_after_a_rollback(tmp_path):
    model = tiny("qwen3_next")
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=4) as store:
        rt = Runtime(model, store=store)
        rt.forward(PREFIX)
        with rt.fork() as br:
            rt.forward(mx.array([7, 8, 9]))
            br.rollback()
        _direct(rt, [10, 11, 12])
        with pytest.raises(StoreError, match="unknown"):
            rt.publish()
        # nothing was stored under 7, 8, 9: a prompt through them misses past the prefix
        assert store.stats()["entries"] == 0


def test_a_failed_forward_records_nothing():
    model = tiny("qwen3_5")
    rt = Runtime(model)
    rt.forward(mx.array(PREFIX))
    layer = model.layers[2]
    base = type(layer)

    def explode(self, *args, **kwargs):
        raise KeyError("boom")

    layer.__class__ = type("Exploding", (base,), {"__call__": explode})
    try:
        with pytest.raises(KeyError):
            rt.forward(mx.array([7, 8]))
    finally:
        layer.__class__ = base
    rt.check()
    assert rt.tokens == PREFIX
    _direct(rt, [6])  # the failed forward's ids are not waiting to come back here
    assert rt.tokens == PREFIX + [None]


# -- restore ----------------------------------------------------------------------


def _states(rt):
    """Each layer's committed state as `load` arguments."""
    out = []
    for layer in rt.cache:  # through the persistence protocol, as the prefix cache does
        if layer.resumes_from == "pages":
            rows = {name: [a] for name, a in layer.export_rows(0, layer.offset).items()}
            out.append(layer.state_from(rows, {}, layer.offset))
        else:
            arrays, meta = layer.export_state()
            out.append(layer.state_from(arrays, meta, layer.offset))
    return out


@pytest.mark.parametrize("fam", ["qwen3_5", "gemma3_text", "llama"])
def test_restore_replaces_the_state_and_the_ids(fam):
    model = tiny(fam)
    source = Runtime(model)
    source.forward(list(range(3, 15)))
    rt = Runtime(model)
    rt.forward(mx.array([9, 9]))
    rt.restore(source.tokens, _states(source))
    rt.check()
    assert rt.tokens == list(range(3, 15)) and rt.offset == 12
    assert mx.array_equal(rt.forward([1]), source.forward([1])).item()


def test_restore_is_all_or_nothing():
    model = tiny("qwen3_5")
    source = Runtime(model)
    source.forward(list(range(3, 15)))
    rt = Runtime(model)
    rt.forward(mx.array([9, 9, 8]))
    before, tokens = snapshot(rt), rt.tokens
    good = _states(source)
    bad_last = good[:-1] + [(mx.zeros((1, 2, 3)),)]  # the last layer's load raises
    short = good[:1] + [(s[0], s[1]) if len(s) > 2 else s for s in good[1:]]
    for ids, states, error in [
        (source.tokens, bad_last, TypeError),
        (source.tokens[:-1], good, ValueError),  # the layers would hold another count
        (source.tokens, good[:-1], ValueError),
        ([-1] + source.tokens[1:], good, ValueError),
        (source.tokens, short, (TypeError, ValueError)),
    ]:
        with pytest.raises(error):
            rt.restore(ids, states)
        rt.check()
        assert rt.tokens == tokens
        assert_snapshot_equal(before, rt)
    with rt.fork():
        with pytest.raises(BranchError):
            rt.restore(source.tokens, good)
    assert rt.tokens == tokens


def test_prefill_rejects_a_bad_step_size_before_loading_anything(tmp_path):
    model = tiny("qwen3_5")
    prompt = [(7 * i + 3) % models.VOCAB for i in range(20)]
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=4) as store:
        Runtime(model, store=store).prefill(prompt)
        for bad in (0, -3, 1.5, True, "8"):
            rt = Runtime(model, store=store)
            with pytest.raises(ValueError, match="step_size"):
                rt.prefill(prompt + [1, 2], step_size=bad)
            assert rt.offset == 0 and rt.tokens == []
            rt.check()
