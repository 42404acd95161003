"""The MTP head's attention cache as a drafter segment of a Runtime (segcache.mtp.state):
fed by the runtime's own forwards, forked, committed, rolled back, cloned and undone with
its layers, against the head on mlx-lm's own KVCache fed the same pairs in the same calls
from hidden states of a forward on mlx-lm's own cache."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import mlx.core as mx
import pytest

from segcache import Runtime
from segcache.errors import InvariantError
from segcache.mtp import MTPHead, forward_with_hidden
from segcache.mtp.state import HeadSegment
from segcache.testing import models

FAMILIES = ("qwen3_next", "qwen3_5")
IDS = [(t * 5 + 3) % 60 + 2 for t in range(40)]


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    model = models.build(request.param)
    return model, MTPHead.build(model)


def reference(model, head, blocks):
    """The head's K/V and the last hidden state after feeding `blocks` (lists of ids; a block
    (ids, keep) is fed whole and then cut to its first `keep` tokens, as a branch commit cuts it).
    The head runs on mlx-lm's KVCache; the target's cache is mlx-lm's, or for a block cut a plain
    Runtime's (a hybrid's recurrent layers cannot be trimmed), fed by the model directly."""
    target, hcache = Runtime(model), head.make_cache()
    tail, n = None, 0
    for block in blocks:
        ids, keep = block if isinstance(block, tuple) else (block, len(block))
        if keep < len(ids):
            target.fork()
        _, h = forward_with_hidden(model, mx.array(ids, dtype=mx.uint32)[None], target.cache)
        toks = mx.array(ids, dtype=mx.uint32)
        hidden, fed = (h[:, :-1], toks[1:]) if tail is None else (mx.concatenate([tail, h[:, :-1]], axis=1), toks)
        if fed.shape[0]:
            head(hidden, fed[None], hcache)
        if keep < len(ids):
            target.commit(keep)
            pairs = max(n + keep - 1, 0)
            hcache[0].trim(hcache[0].offset - pairs)
            tail = (h[:, keep - 1 : keep] if keep else tail)
        else:
            tail = h[:, -1:]
        n += keep
    k = hcache[0].keys[..., : hcache[0].offset, :] if hcache[0].offset else None
    v = hcache[0].values[..., : hcache[0].offset, :] if hcache[0].offset else None
    return k, v, tail


def held(rt):
    seg = rt.drafters.get("mtp")
    kv = seg.kv
    n = kv.offset  # open branches included
    return (kv.keys[..., :n, :] if n else None), (kv.values[..., :n, :] if n else None), seg.tail


def same(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype
        assert mx.array_equal(a, b).item()


def assert_like(rt, ref):
    for x, y in zip(held(rt), ref):
        same(x, y)
    rt.check()


def test_forwards_feed_the_head_one_behind(target):
    model, head = target
    rt = Runtime(model, mtp=head)
    assert rt.drafters.get("mtp").offset == 0
    blocks = [IDS[:7], IDS[7:8], IDS[8:20], IDS[20:21]]
    for i, b in enumerate(blocks):
        rt.forward(b)
        assert_like(rt, reference(model, head, blocks[: i + 1]))
    seg = rt.drafters.get("mtp")
    assert seg.held == 20 and seg.offset == 21 == rt.offset


def test_commit_keeps_the_pairs_of_the_kept_tokens(target):
    model, head = target
    for n in (0, 1, 3, 6):
        rt = Runtime(model, mtp=head)
        rt.forward(IDS[:9])
        with rt.fork() as br:
            rt.forward(IDS[9:15])
            rt.check()
            br.commit(n)
        assert_like(rt, reference(model, head, [IDS[:9], (IDS[9:15], n)]))
        rt.forward(IDS[9 + n : 11 + n])  # goes on from there
        assert_like(rt, reference(model, head, [IDS[:9], (IDS[9:15], n), IDS[9 + n : 11 + n]]))


def test_rollback_nested_and_from_empty(target):
    model, head = target
    rt = Runtime(model, mtp=head)
    with rt.fork() as outer:  # from no token at all: the first forward has no tail
        rt.forward(IDS[:5])
        with rt.fork():
            rt.forward(IDS[5:9])
            rt.check()
        # the inner branch rolled back at the block's end
        assert_like(rt, reference(model, head, [IDS[:5]]))
        with rt.fork() as inner:
            rt.forward(IDS[5:9])
            inner.commit(2)
        rt.check()
        outer.commit(6)
    # the committed 6 tokens: block 1 whole (5), then one of the inner block's four
    ref = reference(model, head, [IDS[:5], (IDS[5:9], 1)])
    assert_like(rt, ref)
    with rt.fork():
        rt.forward(IDS[6:10])
    assert_like(rt, ref)


def test_clone_and_undo(target):
    model, head = target
    rt = Runtime(model, mtp=head)
    rt.forward(IDS[:8])
    br = rt.fork()
    rt.forward(IDS[8:12])
    other = rt.clone()  # the committed 8 tokens only
    br.rollback()
    ref = reference(model, head, [IDS[:8]])
    assert_like(other, ref)
    other.forward(IDS[8:10])
    assert_like(rt, ref)  # the clone's writes never reach the original
    point = rt.savepoint()
    rt.forward(IDS[8:11])
    rt.undo(point)
    del point
    assert_like(rt, ref)


def test_a_failed_forward_changes_nothing(target):
    model, head = target
    rt = Runtime(model, mtp=head)
    rt.forward(IDS[:6])
    with pytest.raises(ValueError):
        rt.forward([])
    seg = rt.drafters.get("mtp")
    orig = seg.head.__class__.__call__

    def boom(self, *args, **kwargs):
        raise RuntimeError("head failed")

    seg.head.__class__.__call__ = boom
    try:
        with pytest.raises(RuntimeError):
            rt.forward(IDS[6:8])
    finally:
        seg.head.__class__.__call__ = orig
    assert_like(rt, reference(model, head, [IDS[:6]]))


def test_restore_makes_it_stale_and_check_sees_a_wrong_count(target):
    model, head = target
    rt = Runtime(model, mtp=head)
    rt.forward(IDS[:6])
    plain = Runtime(model)
    plain.forward(IDS[:4])
    rt.restore(IDS[:4], [_load_args(layer) for layer in plain.cache])
    seg = rt.drafters.get("mtp")
    assert seg.stale and seg.offset is None
    rt.forward(IDS[4:6])  # ignored while stale
    rt.check()
    fresh = Runtime(model, mtp=head)
    fresh.forward(IDS[:3])
    fresh.drafters.get("mtp").held = 1  # break the invariant
    with pytest.raises(InvariantError):
        fresh.check()


def _load_args(layer):
    arrays, meta = (layer.export_rows(0, layer.offset), {}) if layer.resumes_from == "pages" else layer.export_state()
    if layer.resumes_from == "pages":
        arrays = {k: [v] for k, v in arrays.items()}
    return layer.state_from(arrays, meta, layer.offset)


def test_calls_around_the_runtime_make_it_stale(target):
    """mlx-lm called on rt.cache directly: the segment never saw those tokens."""
    model, head = target
    rt = Runtime(model, mtp=head)
    rt.forward(IDS[:5])
    model(mx.array([IDS[5:7]]), cache=rt.cache)
    rt.check()
    assert rt.tokens[5:] == [None, None] and rt.drafters.get("mtp").stale


def test_without_a_head_nothing_is_attached():
    model = models.build("qwen3_next")
    rt = Runtime(model)
    assert not rt.drafters
    rt.forward(IDS[:4])
    rt.check()
    assert isinstance(Runtime(model, mtp=HeadSegment(MTPHead.build(model))).drafters.get("mtp"), HeadSegment)
