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
from segcache.mtp import MTPHead
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
    _check_against_full_call(_target(), True)


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
    """The logits a `PrefillBatch` hands back at a row's end are the full forward's at that position
    (at a stop inside the prompt it hands back none: none are computed for a lone row)."""
    model = tiny("qwen3_5")
    ids = seqs(5, [30, 17])
    pb = PrefillBatch(model, gdn_prefill="chunked")
    ref = BatchRuntime(model, gdn_prefill="chunked")
    for i, p in enumerate(ids):
        pb.add(i, segcache.Runtime(model), p[:10], [])
        ref.join(i)
    reached = pb.step(2 * 16)  # both rows to their ends at 10
    full = ref.forward_padded([p[:10] for p in ids])
    assert [r.position for r in reached] == [10, 10]
    for r in reached:
        assert _close(r.logits, full[r.row_id : r.row_id + 1, 9])
    alone = PrefillBatch(model, gdn_prefill="chunked")
    alone.add(0, segcache.Runtime(model), ids[0], [10])
    [stop] = alone.step(16)
    assert stop.position == 10 and stop.logits is None and not stop.done


ONE_ROW = ("llama", "qwen3", "qwen3_next", "qwen3_5", "nemotron_h")  # dense, hybrid, one not split


def _target():
    return mlx_lm.load(str(MODELS_DIR / "target"))[0]


def _one_row_check(model, ids: list, chunks: list):
    """`Runtime.forward(last_only=True)` over `chunks` of `ids`: the last position's logits of the
    full forward (TOL, same greedy token) and every layer's state bit for bit, chunk by chunk."""
    mine, theirs = segcache.Runtime(model), segcache.Runtime(model)
    at = 0
    for n in chunks:
        got = mine.forward(ids[at : at + n], last_only=True)
        full = theirs.forward(ids[at : at + n])
        assert got.shape == (1, 1, full.shape[-1]) and full.shape[1] == n
        assert _close(got[:, 0], full[:, -1])
        got_states, want_states = _states(mine.cache), _states(theirs.cache)
        assert len(got_states) == len(want_states) > 0
        assert all(_same(x, y) for x, y in zip(got_states, want_states))
        at += n
    assert mine.tokens == theirs.tokens == ids[:at]


@pytest.mark.parametrize("family", ONE_ROW)
def test_a_one_row_forward_with_the_last_logits_only_moves_the_runtime_as_the_full_one(family):
    _one_row_check(tiny(family), seqs(3, [40])[0], [17, 1, 22])


def test_the_shipped_targets_one_row_forward_with_the_last_logits_only():
    _one_row_check(_target(), seqs(4, [96])[0], [64, 1, 31])


@pytest.mark.parametrize("family", ("qwen3", "qwen3_5"))
def test_a_prefill_gives_the_full_forwards_last_logits_and_states(family):
    """`Runtime.prefill` (its chunks run `last_only`) ends as chunked full forwards do, and its
    logits are theirs at the prompt's last position."""
    model = tiny(family)
    ids = seqs(5, [45])[0]
    rt, ref = segcache.Runtime(model), segcache.Runtime(model)
    got = rt.prefill(ids, step_size=16)
    for at in range(0, len(ids), 16):
        full = ref.forward(ids[at : at + 16])
    assert got.shape == (1, full.shape[-1]) and _close(got, full[:, -1])
    assert all(_same(x, y) for x, y in zip(held(rt), held(ref)))


@pytest.mark.parametrize("family", ("qwen3_next", "qwen3_5"))
def test_the_mtp_heads_segment_sees_every_hidden_state_with_the_last_logits_only(family):
    """The MTP head's segment reads the body's final norm through its tap: a prefill whose chunks
    run the head at the last position only feeds it exactly what full forwards do."""
    model = models.build(family)
    head = MTPHead.build(model)
    ids = seqs(6, [37])[0]
    rt, ref = segcache.Runtime(model, mtp=head), segcache.Runtime(model, mtp=head)
    rt.prefill(ids, step_size=8)
    for at in range(0, len(ids), 8):
        ref.forward(ids[at : at + 8])
    a, b = rt.drafters.get("mtp"), ref.drafters.get("mtp")
    assert not a.stale and a.offset == b.offset == len(ids)
    n = a.kv.offset
    assert n == b.kv.offset == len(ids) - 1
    for x, y in ((a.kv.keys[..., :n, :], b.kv.keys[..., :n, :]), (a.kv.values[..., :n, :], b.kv.values[..., :n, :]),
                 (a.tail, b.tail)):
        assert _same(x, y)
    rt.check()
