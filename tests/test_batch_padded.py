"""Rows of different lengths in one forward outside a branch (`BatchRuntime.forward_padded`), and
joining prompts prefilled together in padded forwards (`PrefillBatch`), on dense, hybrid (Gated
DeltaNet) and sliding-window models.

Two references: the same forward with other pad ids (padding reaches no row's state: bit for
bit), and each row fed alone on a `Runtime` in the same chunks (within float tolerance, as
tests/test_batch.py: batched products may round differently; the same lengths exactly, and the
same greedy tokens after).
"""

import functools
import math
import random

import mlx.core as mx
import pytest

from conftest import tiny
from segcache.batch import BatchRuntime
from segcache.batch.prefill import PrefillBatch, width as prefill_width
from segcache.errors import UnsupportedOperationError
from segcache.layers import KVLayer, WindowLayer
from segcache.layers.kv import BatchKVLayer
from segcache.layers.recurrent import RecurrentLayer
from segcache.layers.window import temporal_window
from segcache.runtime import Runtime
from segcache.testing import models

TOL = 1e-4
FAMILIES = ("llama", "qwen3", "qwen3_next", "qwen3_5", "gemma3_text", "llama_swa")


@functools.lru_cache(maxsize=None)
def model_of(family: str):
    if family == "llama_swa":  # one sliding-window layer (window 8) and one full-attention layer
        return models.build("llama", layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    return tiny(family)


def seqs(seed, lengths):
    rnd = random.Random(seed)
    return [[rnd.randrange(1, models.VOCAB) for _ in range(n)] for n in lengths]


def held(rt: Runtime) -> list:
    """Every layer's committed state in one layout: KV keys/values of its tokens, a window's in
    temporal order, a recurrent layer's conv tail and state."""
    out = []
    for layer in rt.cache:
        if isinstance(layer, KVLayer):
            n = layer.offset
            out += [layer.keys[..., :n, :], layer.values[..., :n, :]] if n else []
        elif isinstance(layer, WindowLayer):
            keys, values, length = temporal_window(layer.state)
            out += [mx.array(length)] + ([keys, values] if keys is not None else [])
        elif isinstance(layer, RecurrentLayer):
            out += [a for a in layer.cache if a is not None]
        else:
            raise AssertionError(f"unexpected layer {type(layer).__name__}")
    return out


def alone(model, chunks) -> tuple[Runtime, list]:
    """A Runtime fed `chunks` one forward each, and each forward's logits [S, V]."""
    rt = Runtime(model, gdn_prefill="chunked")
    return rt, [rt.forward(c)[0] for c in chunks if c]


def batch_of(model, prefixes):
    br = BatchRuntime(model, gdn_prefill="chunked")
    for i, p in enumerate(prefixes):
        br.join(i, alone(model, [p])[0] if p else None)
    return br


# held before, then two padded forwards: long and short (the chunked and mlx-lm's own GDN path)
HELD = [5, 0, 13, 2]
FEEDS = [[7, 20, 3, 11], [2, 5, 1, 3]]


@pytest.mark.parametrize("family", FAMILIES)
def test_pads_reach_no_row_state_bit_for_bit(family):
    model = model_of(family)
    rows = seqs(1, [h + sum(f[i] for f in FEEDS) for i, h in enumerate(HELD)])
    got = []
    for pad in (0, 17, models.VOCAB - 1):
        br = batch_of(model, [r[:h] for r, h in zip(rows, HELD)])
        pos = list(HELD)
        logits = []
        for feed in FEEDS:
            out = br.forward_padded([r[p : p + n] for r, p, n in zip(rows, pos, feed)], pad=pad)
            logits.append([out[i, :n] for i, n in enumerate(feed)])
            pos = [p + n for p, n in zip(pos, feed)]
            br.check()
        assert br.lengths == pos
        got.append((logits, [held(br.to_runtime(i)) for i in range(len(rows))]))
    (logits0, states0), *others = got
    for logits, states in others:
        for a, b in zip(sum(logits0, []), sum(logits, [])):
            assert mx.array_equal(a, b).item()
        for s0, s in zip(states0, states):
            assert len(s0) == len(s) and all(mx.array_equal(a, b).item() for a, b in zip(s0, s))


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_rows_hold_what_their_own_forwards_give_and_decode_as_alone(family):
    model = model_of(family)
    rows = seqs(2, [h + sum(f[i] for f in FEEDS) for i, h in enumerate(HELD)])
    br = batch_of(model, [r[:h] for r, h in zip(rows, HELD)])
    pos = list(HELD)
    outs = []
    for feed in FEEDS:
        out = br.forward_padded([r[p : p + n] for r, p, n in zip(rows, pos, feed)])
        outs.append([out[i, :n] for i, n in enumerate(feed)])
        pos = [p + n for p, n in zip(pos, feed)]
    states = [held(br.to_runtime(i)) for i in range(len(rows))]
    nxt = [[3], [1], [4], [1]]
    step = br.forward(nxt)  # a decode step of every row after the padded ones
    for i, r in enumerate(rows):
        bounds = [0, HELD[i]] + [HELD[i] + sum(f[i] for f in FEEDS[: k + 1]) for k in range(len(FEEDS))]
        rt, ref = alone(model, [r[a:b] for a, b in zip(bounds, bounds[1:])])
        want = held(rt)
        assert [a.shape for a in states[i]] == [a.shape for a in want], f"row {i}: lengths differ"
        for a, b in zip(states[i], want):
            assert mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() <= TOL, f"row {i}"
        for a, b in zip([o[i] for o in outs], ref[1 if HELD[i] else 0 :]):
            assert mx.abs(a - b).max().item() <= TOL, f"row {i}: prompt logits"
        last = rt.forward(nxt[i])[0, -1]
        assert mx.abs(step[i, -1] - last).max().item() <= TOL
        assert mx.argmax(step[i, -1]).item() == mx.argmax(last).item()


def test_a_batch_with_a_kind_that_cannot_mask_pads_refuses_them_and_changes_nothing():
    model = tiny("mamba")
    br = batch_of(model, [[1, 2, 3], []])
    assert not br.pads_rows
    before = br.lengths
    with pytest.raises(UnsupportedOperationError, match="cannot mask padded rows"):
        br.forward_padded([[4, 5], [6]])
    assert br.lengths == before
    br.check()
    br.forward_padded([[4, 5], [6, 7]])  # rows of one length are a plain forward
    assert br.lengths == [5, 2]


def _prefill_all(pb, width):
    """Step `pb` at a constant width per row (budget = width x rows) until every row is done;
    returns (forwards, {row: [(position, runtime)]})."""
    reached, forwards = {}, 0
    while len(pb):
        for r in pb.step(width * len(pb)):
            reached.setdefault(r.row_id, []).append((r.position, r.runtime, r.logits))
        forwards += 1
        pb.check()
    return forwards, reached


@pytest.mark.parametrize("family", FAMILIES)
def test_joining_prompts_of_different_lengths_take_batch_generators_forwards(family):
    """No stop before their ends: ceil(max left / width) forwards, as mlx-lm's BatchGenerator
    feeding right-padded rows `width` tokens at a time (equal counts took one more per distinct
    remaining length), and each row ends holding what its own prefill gives."""
    model = model_of(family)
    lengths, starts, width = [41, 23, 60, 9, 33], [0, 4, 17, 0, 1], 16
    ids = seqs(3, lengths)
    pb = PrefillBatch(model, gdn_prefill="chunked")
    for i, (p, s) in enumerate(zip(ids, starts)):
        pb.add(i, alone(model, [p[:s]])[0], p, [])
    forwards, reached = _prefill_all(pb, width)
    assert forwards == math.ceil(max(n - s for n, s in zip(lengths, starts)) / width)
    for i, p in enumerate(ids):
        [(position, rt, logits)] = reached[i]
        assert position == len(p) and rt.tokens == p
        want_rt, want = alone(model, [p])
        got, ref = held(rt), held(want_rt)
        assert [a.shape for a in got] == [a.shape for a in ref]
        assert all(mx.abs(a - b).max().item() <= TOL for a, b in zip(got, ref))
        assert mx.abs(logits[0] - want[0][-1]).max().item() <= TOL


@pytest.mark.parametrize("family", ("qwen3", "qwen3_5", "gemma3_text"))
def test_rows_stop_at_each_of_their_stops_in_shared_padded_forwards(family):
    """Stops (checkpoints) cut a row's feed where they lie; the row is padded in that forward and
    the others go on. Every stop hands back the row's state there, as its own prefill to there; the
    logits at the row's end only (elsewhere none were computed: no state needs them)."""
    model = model_of(family)
    lengths, stops = [50, 31, 44], [[7, 20, 40], [], [33]]
    ids = seqs(4, lengths)
    pb = PrefillBatch(model, gdn_prefill="chunked")
    for i, p in enumerate(ids):
        pb.add(i, Runtime(model), p, stops[i])
    forwards, reached = _prefill_all(pb, 16)
    for i, p in enumerate(ids):
        assert [pos for pos, _, _ in reached[i]] == stops[i] + [len(p)]
        for pos, rt, logits in reached[i]:
            want_rt, want = alone(model, [p[:pos]])
            assert rt.tokens == p[:pos]
            got, ref = held(rt), held(want_rt)
            assert [a.shape for a in got] == [a.shape for a in ref]
            assert all(mx.abs(a - b).max().item() <= TOL for a, b in zip(got, ref))
            if pos == len(p):
                assert mx.abs(logits[0] - want[0][-1]).max().item() <= TOL
            else:
                assert logits is None
    # row 0 needs the most at width 16: 7 (to its stop), 13 (to 20), 16, 4 (to 40), 10; no more in all
    assert forwards == 5


def _fewest(left: tuple, fixed: int) -> int:
    """Row-tokens (pads included, `fixed` per forward) of the best plan of any widths, by brute force."""
    if not left:
        return 0
    return min(fixed + len(left) * w + _fewest(tuple(sorted(r - w for r in left if r > w)), fixed)
               for w in range(1, max(left) + 1))


def test_a_forward_is_narrower_only_where_that_feeds_fewer_tokens():
    """`width` starts a plan that feeds the rows in the fewest row-tokens, pads and each forward's
    fixed cost counted, as the best of every sequence of widths found by brute force; with a
    margin, one forward of the widest row unless that plan saves the margin of it."""
    rnd = random.Random(7)
    cases = [[5, 5, 5], [1, 9], [2, 3, 11, 12], [12, 1, 1, 1]] + [
        [rnd.randrange(1, 13) for _ in range(rnd.randrange(1, 5))] for _ in range(12)]
    for left in cases:
        for fixed in (0, 3, 8):
            w = prefill_width(left, fixed, margin=0)
            rest = tuple(sorted(r - w for r in left if r > w))
            best = _fewest(tuple(sorted(left)), fixed)
            assert fixed + len(left) * w + _fewest(rest, fixed) == best, (left, fixed)
            one = fixed + len(left) * max(left)
            assert prefill_width(left, fixed, margin=0.1) == (w if best <= 0.9 * one else max(left)), (left, fixed)
    assert prefill_width([5, 5, 5], 8) == 5 and prefill_width([12, 1, 1, 1], 0, margin=0) == 1


def test_a_lone_prompt_is_fed_on_its_own_runtime_until_another_joins():
    """Alone in the batch, a prompt is fed on the Runtime it joined with (no copy in or out): its
    stops hand that Runtime back, bit for bit what `Runtime.forward` in the same chunks leaves. A
    second prompt joining moves it into the batch; both end as their own prefills (TOL)."""
    model = model_of("qwen3_5")
    a, b = seqs(9, [40, 25])
    rt = Runtime(model)
    pb = PrefillBatch(model, gdn_prefill="chunked")
    pb.add("a", rt, a, [10])
    (r,) = pb.step(16)
    pb.check()
    assert (r.row_id, r.position, r.done) == ("a", 10, False) and r.runtime is rt and not len(pb.batch)
    want = Runtime(model)
    mx.eval(want.forward(a[:10], last_only=True))
    assert rt.tokens == a[:10] and all(mx.array_equal(x, y).item() for x, y in zip(held(rt), held(want)))
    assert pb.step(6) == [] and pb.fed == {"a": 6}
    pb.add("b", Runtime(model), b, [])
    assert pb.solo is None and pb.ids == ["a", "b"]
    pb.check()
    reached = {}
    while len(pb):
        for r in pb.step(32):
            reached[r.row_id] = r
        pb.check()
    for rid, p in (("a", a), ("b", b)):
        got = reached[rid]
        assert got.done and got.runtime.tokens == p
        ref = Runtime(model)
        want = ref.forward(p)
        assert all(mx.abs(x - y).max().item() <= TOL for x, y in zip(held(got.runtime), held(ref)))
        assert mx.abs(got.logits[0] - want[0, -1]).max().item() <= TOL


def test_one_token_rows_at_one_length_attend_unmasked_and_as_alone():
    """A one-token step of rows at one length needs no mask (each query sees every key the layer
    returns, as mlx-lm's KVCache gives None): the KV layers give none, rows at different lengths
    still get theirs, and the step's logits are each row's own forward's (TOL)."""
    model = model_of("qwen3_5")
    ids = seqs(11, [9, 9, 6])
    br = BatchRuntime(model)
    for i, p in enumerate(ids[:2]):
        br.join(i, alone(model, [p])[0])
    kv = [layer for layer in br.cache if isinstance(layer, BatchKVLayer)]
    assert kv and all(layer.make_mask(1) is None for layer in kv)
    got = br.forward([[3], [4]])
    for i, (p, t) in enumerate(zip(ids[:2], (3, 4))):
        want = alone(model, [p, [t]])[1]
        assert mx.abs(got[i, -1] - want[-1][-1]).max().item() <= TOL
    br.join(2, alone(model, [ids[2]])[0])
    assert all(layer.make_mask(1) is not None for layer in kv)
