"""fork / commit(n) / rollback / clone: exact, nested, isolated, fail-closed."""

import segcache  # noqa: F401

import mlx.core as mx
import pytest

from conftest import tiny
from helpers import assert_snapshot_equal, assert_states_equal, snapshot
from segcache import BranchError, Runtime
from segcache.layers import RecurrentLayer
from segcache.testing.statemachine import assert_logits_close

PREFIX = [5, 17, 3, 42, 8, 8, 1, 30, 22, 9, 14]
TAIL_A = [7, 11, 63, 0, 19, 4]
TAIL_B = [50, 50, 50, 50, 50, 50]
STRATEGIES = ["replay", "states"]


def _feed(rt, ids, chunking):
    """Forward `ids` in one call ("block", as a verify) or one token at a time ("steps", as a draft)."""
    if chunking == "block":
        return rt.forward(ids)
    return [rt.forward([t]) for t in ids][-1]


def _runtime(family, strategy, tokens=PREFIX):
    rt = Runtime(tiny(family), recurrent_strategy=strategy)
    rt.forward(tokens)
    return rt


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("chunking", ["block", "steps"])
def test_commit_n_is_exact_for_every_n(family, strategy, chunking):
    for n in range(len(TAIL_A) + 1):
        a, b = _runtime(family, strategy), _runtime(family, strategy)
        with a.fork() as br:
            _feed(a, TAIL_A, chunking)
            br.commit(n)
        with b.fork() as br:
            _feed(b, TAIL_A[:n] + TAIL_B[n:], chunking)  # same accepted prefix, another tail
            br.commit(n)
        assert_states_equal(a, b)
        la, lb = a.forward([2]), b.forward([2])
        assert mx.array_equal(la, lb).item(), f"n={n}: next logits depend on the rejected tail"
        # and it matches a runtime that only ever saw the committed tokens
        fresh = _runtime(family, strategy, PREFIX + TAIL_A[:n])
        assert_logits_close(la, fresh.forward([2]), f"{family} commit({n}) vs recompute")
        assert a.tokens == PREFIX + TAIL_A[:n] + [2]
        a.check()
        b.check()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rollback_restores_bit_identical_state(family, strategy):
    rt = _runtime(family, strategy)
    before = snapshot(rt)
    for chunking in ("block", "steps"):
        br = rt.fork()
        _feed(rt, TAIL_A, chunking)
        br.rollback()
        assert rt.offset == len(PREFIX) and rt.tokens == PREFIX and rt.depth == 0
        assert_snapshot_equal(before, rt)
        rt.check()
    reference = _runtime(family, strategy)
    assert mx.array_equal(rt.forward([2]), reference.forward([2])).item()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nested_branches(family, strategy):
    rt = _runtime(family, strategy)
    before = snapshot(rt)
    outer = rt.fork()
    rt.forward([1, 2, 3])
    inner = rt.fork()
    rt.forward([4, 5, 6])
    assert rt.depth == 2 and outer.length == 6 and inner.length == 3
    inner.commit(2)
    rt.check()
    innermost = rt.fork()
    rt.forward([7, 8])
    innermost.rollback()
    assert rt.tokens == PREFIX + [1, 2, 3, 4, 5]
    outer.commit(4)
    assert rt.tokens == PREFIX + [1, 2, 3, 4] and rt.depth == 0
    fresh = _runtime(family, strategy, PREFIX + [1, 2, 3, 4])
    assert_logits_close(rt.forward([9]), fresh.forward([9]), "nested commit")

    # commit inside, roll back outside: back to the start exactly
    rt2 = _runtime(family, strategy)
    with rt2.fork():
        rt2.forward([1, 2])
        with rt2.fork() as br:
            rt2.forward([3, 4])
            br.commit()
    assert_snapshot_equal(before, rt2)
    rt2.check()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clones_never_see_each_others_writes(family, strategy):
    rt = _runtime(family, strategy)
    with rt.fork():  # an open branch is not part of what a clone shares
        rt.forward([60, 61])
        c1 = rt.clone()
    c2 = rt.clone()
    assert c1.tokens == PREFIX and c1.depth == 0
    before = snapshot(rt)
    c1.forward([1, 2, 3])
    c2.forward([4])
    assert_snapshot_equal(before, rt)
    out = {name: r.forward([9]) for name, r in (("rt", rt), ("c1", c1), ("c2", c2))}
    for name, r, extra in (("rt", rt, []), ("c1", c1, [1, 2, 3]), ("c2", c2, [4])):
        ref = _runtime(family, strategy)
        if extra:
            ref.forward(extra)  # same chunking as the clone, so the same bits
        assert mx.array_equal(out[name], ref.forward([9])).item(), f"{name} saw another runtime's writes"
        r.check()


def _misuses(rt):
    """Each call must raise BranchError."""
    yield lambda: rt.commit()
    yield lambda: rt.rollback()
    outer = rt.fork()
    rt.forward([1, 2])
    inner = rt.fork()
    rt.forward([3])
    yield lambda: rt.commit(-1)
    yield lambda: rt.commit(2)  # the inner branch holds 1 token
    yield lambda: rt.commit(0.5)
    yield lambda: rt.commit(True)
    yield lambda: rt.commit("1")
    yield lambda: outer.commit()  # not the innermost
    yield lambda: outer.rollback()
    inner.commit()
    yield lambda: inner.commit()  # closed
    yield lambda: inner.rollback()
    outer.rollback()


@pytest.mark.parametrize("fam", ["qwen3_5", "gemma3_text", "llama"])
def test_every_misuse_raises_and_changes_nothing(fam):
    rt = _runtime(fam, "replay")
    for attempt in _misuses(rt):
        state = (rt.offset, rt.tokens, rt.depth)
        before = snapshot(rt)
        with pytest.raises(BranchError):
            attempt()
        assert (rt.offset, rt.tokens, rt.depth) == state
        assert_snapshot_equal(before, rt)
        rt.check()
    assert rt.depth == 0 and rt.tokens == PREFIX


def test_with_block_rolls_back_on_exit_and_on_exception():
    rt = _runtime("qwen3_5", "replay")
    before = snapshot(rt)
    with rt.fork():
        rt.forward([1, 2, 3])
        rt.fork()  # left open inside the block
        rt.forward([4])
    assert rt.depth == 0 and rt.tokens == PREFIX
    assert_snapshot_equal(before, rt)
    with pytest.raises(KeyError):
        with rt.fork():
            rt.forward([1])
            raise KeyError("boom")
    assert rt.depth == 0 and rt.tokens == PREFIX
    assert_snapshot_equal(before, rt)
    with rt.fork() as br:
        rt.forward([1, 2])
        br.commit(1)
    assert rt.tokens == PREFIX + [1]
    rt.check()


# -- bounded branch memory ("states" keeps at most its budget, then replays) -------

LONG = [(5 * i + 2) % 64 for i in range(23)]
CHUNKS = [1, 1, 3, 1, 2, 5, 1, 1, 4, 1, 3]  # sum 23: draft steps and verify blocks


def _state_bytes(rt):
    """Bytes of one recurrent state of the first recurrent layer (B*Hv*Dv*Dk floats)."""
    layer = next(c for c in rt.cache if isinstance(c, RecurrentLayer))
    return layer.cache[1].nbytes


def _feed_long(rt, peaks):
    pos = 0
    for size in CHUNKS:
        rt.forward(LONG[pos : pos + size])
        pos += size
        rt.check()  # accepts the mixed records (states, then none)
        peaks.append(max(c.kept_bytes for c in rt.cache if isinstance(c, RecurrentLayer)))


def test_a_long_branch_keeps_at_most_its_budget_and_commits_exactly(hybrid):
    model = tiny(hybrid)
    probe = _runtime(hybrid, "states")
    per_state = _state_bytes(probe)
    recurrent = sum(isinstance(c, RecurrentLayer) for c in probe.cache)
    budget = 5 * per_state  # per layer: 5 kept states, the branch holds 23 tokens
    for n in range(len(LONG) + 1):
        runs, peaks = {}, {}
        for name, strategy, total in [
            ("bounded", "states", budget * recurrent),
            ("unbounded", "states", 1 << 40),
            ("replay", "replay", 1 << 40),
        ]:
            rt = Runtime(model, recurrent_strategy=strategy, branch_state_bytes=total)
            rt.forward(PREFIX)
            peaks[name] = []
            with rt.fork() as br:
                _feed_long(rt, peaks[name])
                br.commit(n)
            rt.check()
            runs[name] = rt
        assert max(peaks["bounded"]) <= budget
        assert max(peaks["unbounded"]) == len(LONG) * per_state  # the control keeps every state
        assert max(peaks["replay"]) == 0
        assert_states_equal(runs["bounded"], runs["unbounded"])
        assert_states_equal(runs["bounded"], runs["replay"])
        nxt = {name: rt.forward([2]) for name, rt in runs.items()}
        assert mx.array_equal(nxt["bounded"], nxt["unbounded"]).item(), f"n={n}"
        assert mx.array_equal(nxt["bounded"], nxt["replay"]).item(), f"n={n}"
        assert runs["bounded"].tokens == PREFIX + LONG[:n] + [2]


def test_budget_spans_nested_branches_and_frees_on_rollback():
    model = tiny("qwen3_5")
    per_state = _state_bytes(_runtime("qwen3_5", "states"))
    rt = Runtime(model, recurrent_strategy="states", branch_state_bytes=2 * 4 * per_state)  # 4 per layer
    ref = Runtime(model, recurrent_strategy="replay")
    for r in (rt, ref):
        r.forward(PREFIX)
    layers = [c for c in rt.cache if isinstance(c, RecurrentLayer)]
    with rt.fork() as outer, ref.fork() as ref_outer:
        for r in (rt, ref):
            r.forward([1, 2, 3])
        assert all(c.kept_states == 3 for c in layers)
        with rt.fork() as inner:
            rt.forward([4, 5])  # does not fit (3 + 2 > 4): this branch replays from here
            rt.forward([6])  # and keeps nothing more, though one would fit
            assert all(c.kept_states == 3 and c.marks[-1].replaying for c in layers)
            rt.check()
            inner.rollback()
        assert all(c.kept_states == 3 and not c.marks[-1].replaying for c in layers)
        with rt.fork() as inner:
            rt.forward([4])  # a new branch keeps states again while they fit
            assert all(c.kept_states == 4 for c in layers)
            rt.forward([5, 6])
            inner.commit(2)  # the outer branch now holds records without states
        ref.forward([4, 5])
        assert all(c.marks[-1].replaying for c in layers)
        rt.check()
        outer.commit(4)
        ref_outer.commit(4)
    assert_states_equal(rt, ref)
    assert mx.array_equal(rt.forward([9]), ref.forward([9])).item()


def test_branch_state_bytes_is_checked():
    for bad in (-1, 1.5, None, True):
        with pytest.raises(ValueError, match="branch_state_bytes"):
            Runtime(tiny("qwen3_5"), branch_state_bytes=bad)
