"""The output head at chosen positions only (adapters/head.py): every layer's state is bit for bit
what the model's own full call leaves, and each row's logits are the full call's at that position
(the same head on the same hidden states; a product over fewer rows may round differently: TOL)."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from conftest import tiny
from segcache.adapters.head import Head, split
from segcache.batch import BatchRuntime
from segcache.batch.prefill import PrefillBatch
from segcache.demo import MODELS_DIR
from segcache.testing import models
from test_batch_padded import held, seqs

TOL = 1e-4
SPLIT = ("llama", "qwen3", "qwen3_next", "qwen3_5", "gemma3_text")


def _states(cache) -> list:
    return [a for _, a in tree_flatten([c.state for c in cache]) if a is not None]


def _same(a, b) -> bool:
    if not isinstance(a, mx.array):  # a rotating cache's offsets in its state
        return a == b
    return a.shape == b.shape and mx.array_equal(a, b).item()


def _close(a, b) -> bool:
    """Within TOL, and the same greedy token in every row."""
    return (a.shape == b.shape and mx.abs(a - b).max().item() <= TOL
            and mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item())


def _check_against_full_call(model, expect_split: bool):
    assert (split(model) is not None) == expect_split
    head = Head(model)
    ids = mx.array(seqs(1, [13, 13, 13]), dtype=mx.uint32)
    positions = [12, 0, 7]
    mine, theirs = make_prompt_cache(model), make_prompt_cache(model)
    for chunk in (ids[:, :5], ids[:, 5:]):  # a second forward on a cache that holds the first
        got = head.rows_logits(chunk, mine, [min(p, chunk.shape[1] - 1) for p in positions])
        full = model(chunk, cache=theirs)
        want = full[mx.arange(3), mx.array([min(p, chunk.shape[1] - 1) for p in positions])]
        assert _close(got, want)
        if not expect_split:
            assert _same(got, want)  # the model's own call, gathered
    got, want = _states(mine), _states(theirs)
    assert len(got) == len(want) > 0 and all(_same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("family", SPLIT)
def test_split_families_give_the_full_calls_logits_and_states(family):
    _check_against_full_call(tiny(family), True)


def test_tied_heads_and_the_shipped_target_are_split_too():
    _check_against_full_call(models.build("llama", tie_word_embeddings=True), True)
    target, _ = mlx_lm.load(str(MODELS_DIR / "target"))
    _check_against_full_call(target, True)


@pytest.mark.parametrize("family", ("nemotron_h", "mamba"))
def test_a_family_not_known_to_split_runs_its_own_full_call(family):
    _check_against_full_call(tiny(family), False)


@pytest.mark.parametrize("family", ("qwen3_5", "gemma3_text", "llama"))
def test_a_padded_forward_with_the_last_logits_only_moves_every_row_as_the_full_one(family):
    """`forward_padded(last_only=True)` gives each row's logits at its last real token and leaves
    every row's state exactly as the full call does (padded and equal-length rows)."""
    model = tiny(family)
    for feed in ([9, 3, 14], [6, 6, 6]):
        a, b = (BatchRuntime(model, gdn_prefill="chunked") for _ in range(2))
        for br in (a, b):
            for i in range(3):
                br.join(i)
        rows = seqs(2, feed)
        got = a.forward_padded(rows, last_only=True)
        want = b.forward_padded(rows)[mx.arange(3), mx.array(feed) - 1]
        assert _close(got, want)
        for i in range(3):
            assert all(_same(x, y) for x, y in zip(held(a.to_runtime(i)), held(b.to_runtime(i))))


def test_prefill_batch_hands_back_what_the_full_head_gives():
    """The logits a `PrefillBatch` hands back at a stop are the full forward's at that position."""
    model = tiny("qwen3_5")
    ids = seqs(5, [30, 17])
    pb = PrefillBatch(model, gdn_prefill="chunked")
    ref = BatchRuntime(model, gdn_prefill="chunked")
    for i, p in enumerate(ids):
        pb.add(i, segcache.Runtime(model), p, [10])
        ref.join(i)
    reached = pb.step(2 * 16)  # row 0 to its stop at 10, row 1 to 10 as well
    full = ref.forward_padded([p[:10] for p in ids])
    assert [r.position for r in reached] == [10, 10]
    for r in reached:
        assert _close(r.logits, full[r.row_id : r.row_id + 1, 9])
