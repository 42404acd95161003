"""Sliding-window layers batched (BatchWindowLayer): every row as the same prompt alone on
mlx-lm's own RotatingKVCache, prompts and generations past the window.

Tolerance as tests/test_batch.py (docs/batching.md): a batched row attends its window in
temporal order over [B, S] activations, mlx-lm's ring in ring order, so float32 sums may
round differently; logits within TOL and the same greedy tokens.
"""

import functools

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import make_prompt_cache

from conftest import tiny
from segcache.batch import BatchRuntime
from segcache.drafters import make_decoder
from segcache.layers.kv import BatchKVLayer
from segcache.layers.window import BatchWindowLayer, temporal_window
from segcache.errors import BranchError, UnsupportedModelError
from segcache.layers import WindowLayer
from segcache.runtime import Runtime
from segcache.testing import models

TOL = 1e-4
WINDOW = 8  # both test models' sliding window
# longer than the window, shorter, empty, exactly the window
PROMPTS = [list(range(1, 21)), [9, 8, 7], [], [5] * WINDOW, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


@functools.lru_cache(maxsize=None)
def window_model(family: str):
    """gemma3_text (2 sliding layers, 1 global) or a llama with one sliding and one full layer."""
    if family == "llama_swa":
        return models.build("llama", layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    return tiny(family)


FAMILIES = ("gemma3_text", "llama_swa")


def close(a, b, what=""):
    diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
    assert diff <= TOL, f"{what}: logits differ by {diff}"


class Alone:
    """One sequence on mlx-lm's own caches (RotatingKVCache for the window layers)."""

    def __init__(self, model, tokens):
        self.model, self.cache = model, make_prompt_cache(model)
        if tokens:
            model(mx.array(tokens, dtype=mx.uint32)[None], cache=self.cache)

    def __call__(self, tokens):
        return self.model(mx.array(tokens, dtype=mx.uint32)[None], cache=self.cache)[0]


def solo(model, tokens):
    rt = Runtime(model)
    if tokens:
        rt.forward(tokens)
    return rt


def batch_of(model, prompts):
    br = BatchRuntime(model)
    for i, p in enumerate(prompts):
        br.join(i, solo(model, p) if p else None)
    br.check()
    return br


def windows(br):
    return [layer for layer in br.cache if isinstance(layer, BatchWindowLayer)]


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_length_rows_generate_as_alone_past_the_window_in_bounded_memory(family):
    model = window_model(family)
    prompts = [p for p in PROMPTS if p]
    br = batch_of(model, [p[:-1] for p in prompts])
    assert windows(br), "the model has sliding-window layers"
    alone = [Alone(model, p[:-1]) for p in prompts]
    last = [[p[-1]] for p in prompts]
    outs = [[] for _ in prompts]
    for step in range(40):  # 40 + 20 tokens: several compactions of an 8-token window
        logits = br.forward(last)
        for i, ref in enumerate(alone):
            want = ref(last[i])[0]
            close(logits[i, 0], want, f"row {i} step {step}")
            outs[i].append(mx.argmax(logits[i, 0]).item())
            assert outs[i][-1] == mx.argmax(want).item(), f"row {i} step {step}: greedy token"
        last = [[o[-1]] for o in outs]
        br.check()
    for i, p in enumerate(prompts):
        assert br.tokens(i) == p + outs[i][:-1]
    for layer in windows(br):
        # the last M keys per row, one forward and `slack` free columns: not the 60 tokens seen
        assert layer.keys.shape[2] <= 2 * WINDOW + 1, layer.keys.shape


@pytest.mark.parametrize("family", FAMILIES)
def test_a_round_straddling_the_window_commits_each_row_its_own_count(family):
    model = window_model(family)
    br = batch_of(model, PROMPTS)
    held = [list(p) for p in PROMPTS]
    # a long ragged branch forward: rows pass the window inside the branch
    drafts = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [1], [2, 3, 4, 5, 6, 7, 8, 9, 10], [4, 4], [6] * 7]
    br.fork()
    logits = br.forward(drafts)
    for i, d in enumerate(drafts):
        close(logits[i, : len(d)], Alone(model, held[i])(d), f"row {i} branch")
    br.check()
    keep = [0, 1, 9, 1, 4]  # none, all, all, some, some
    br.commit(keep)
    br.check()
    for i, n in enumerate(keep):
        held[i] += drafts[i][:n]
        assert br.tokens(i) == held[i]
    # then a rolled-back round (its padding and its keys gone), then decode on
    br.fork()
    br.forward([[20 + i] * (1 + i) for i in range(len(held))])
    br.rollback()
    br.check()
    # a branch whose second forward compacts the layer: the keys before the branch stay
    br.fork()
    br.forward([[21, 22, 23]] * len(held))
    cap = windows(br)[0].keys.shape[2]
    br.forward([list(range(30, 30 + cap))] * len(held))
    br.rollback()
    br.check()
    for step in range(12):
        new = [[(step * 5 + i) % 64] for i in range(len(held))]
        logits = br.forward(new)
        for i in range(len(held)):
            close(logits[i, 0], Alone(model, held[i])(new[i])[0], f"row {i} after commit, step {step}")
            held[i] += new[i]
        br.check()


@pytest.mark.parametrize("family", FAMILIES)
def test_filter_extract_and_to_runtime_right_after_a_branch(family):
    model = window_model(family)
    br = batch_of(model, PROMPTS)
    held = [list(p) for p in PROMPTS]
    br.fork()
    br.forward([[30, 31, 32, 33]] * len(held))
    br.leave(1)
    one = br.extract(3)  # during the branch: its marks go with it
    br.check()
    one.check()
    br.commit({0: 4, 2: 1, 4: 2})
    one.commit([3])
    for rid, n in ((0, 4), (2, 1), (4, 2), (3, 3)):
        held[rid] += [30, 31, 32, 33][:n]
    br.filter([2, 0])  # right after: reorder and drop
    assert br.ids == [4, 0]
    for b, rid in ((br, 4), (br, 0), (one, 3)):
        assert b.tokens(rid) == held[rid]
    got = br.forward([[40], [41]])
    close(got[0, 0], Alone(model, held[4])([40])[0], "row 4")
    close(got[1, 0], Alone(model, held[0])([41])[0], "row 0")
    held[4] += [40]
    held[0] += [41]
    br.check()
    # a row leaves as a WindowLayer runtime, continues alone, and joins another batch
    rt = br.to_runtime(0)
    rt.check()
    assert rt.tokens == held[0]
    close(rt.forward([42, 43])[0], Alone(model, held[0])([42, 43]), "to_runtime, a block")
    close(rt.forward([44])[0], Alone(model, held[0] + [42, 43])([44]), "to_runtime, a step")
    held[0] += [42, 43, 44]
    one.join("back", rt)
    one.check()
    got = one.forward([[50], [51]])
    close(got[0, 0], Alone(model, held[3])([50])[0], "extracted row")
    close(got[1, 0], Alone(model, held[0])([51])[0], "rejoined row")
    one.check()


def test_decoder_generates_on_a_window_model_as_alone():
    model = window_model("gemma3_text")
    dec = make_decoder(model, num_draft_tokens=3, gate=False)  # prompt lookup: ragged rounds
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [4, 5]]
    for i, p in enumerate(prompts):
        dec.add(i, solo(model, p[:-1]), p[-1], max_tokens=30)
    got = {i: [] for i in range(len(prompts))}
    while any(len(v) < 30 for v in got.values()):
        for rid, emitted in dec.step().items():
            got[rid] += [t for t, _, _ in emitted]
        for rid in [r for r in dec.batch.ids if len(got[r]) >= 30]:
            dec.remove(rid)
        dec.batch.check()
    for i, p in enumerate(prompts):
        ref, tok, want = Alone(model, p[:-1]), p[-1], []
        for _ in range(30):
            tok = mx.argmax(ref([tok])[0]).item()
            want.append(tok)
        assert got[i][:30] == want, f"row {i}"


def test_window_layer_merge_gives_a_batched_layer_whose_rows_extract_back():
    model = window_model("gemma3_text")
    lengths = [0, 3, WINDOW, WINDOW + 5, 30]
    runtimes = []
    for n in lengths:
        rt = solo(model, [(7 * j) % 64 for j in range(n)])
        if n == 30:
            rt.forward([1])  # a ring written in place (rotated), not a concatenated block
            rt.forward([2])
        runtimes.append(rt)
    layer = next(i for i, c in enumerate(runtimes[0].cache) if isinstance(c, WindowLayer))
    caches = [rt.cache[layer] for rt in runtimes]
    merged = WindowLayer.merge(caches)  # mlx-lm's classmethod protocol: RotatingKVCache.merge(caches)
    assert isinstance(merged, BatchWindowLayer)
    merged.check()
    assert merged.lengths == [c.offset for c in caches]
    for i, c in enumerate(caches):
        back = merged.extract(i)
        assert isinstance(back, WindowLayer)
        back.check()
        assert back.offset == c.offset
        want, got = temporal_window(c.state), temporal_window(back.state)
        if c.offset == 0:
            assert got[0] is None
            continue
        assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1]), f"row {i}"
        # and it goes on as mlx-lm's ring does: one in-place step on both
        kv = mx.full((1, *want[0].shape[1:2], 1, want[0].shape[3]), float(i))
        k1, _ = back.update_and_fetch(kv, kv)
        k2, _ = c.update_and_fetch(kv, kv)
        assert mx.array_equal(mx.sort(k1.flatten()), mx.sort(k2.flatten())), f"row {i} after a step"
    with pytest.raises(ValueError):
        WindowLayer.merge([WindowLayer(8), WindowLayer(4)])
    with pytest.raises(UnsupportedModelError):
        sinks = WindowLayer(8, keep=2)
        sinks.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
        WindowLayer.merge([sinks])
    merged.fork()
    with pytest.raises(BranchError):
        merged.extract(0)


def test_models_with_other_recurrent_kinds_are_refused():
    with pytest.raises(UnsupportedModelError, match="ArraysCache"):
        BatchRuntime(models.build("recurrent_gemma"))


def test_a_full_attention_layer_given_a_window_masks_as_mlx_lms_kv_cache():
    """A model may build its sliding mask from a KVCache (mlx-lm: the last window_size keys)."""
    layer = BatchKVLayer()
    for L in (5, 12, 0):
        layer.add_row(*((mx.ones((1, 2, L, 4)),) * 2 if L else (None, None)))
    mask = layer.make_mask(3, window_size=4)
    for i, L in enumerate(layer.lengths):
        want = create_causal_mask(3, L, window_size=4)
        assert mx.array_equal(mask[i, 0, :, : L + 3], want), f"row {i}"
        assert not mask[i, 0, :, L + 3 :].any().item()
