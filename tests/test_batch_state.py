"""BatchRuntime on the StateLayer families (Mamba-2 hybrids, Mamba, short conv, RWKV-7):
every row as the same tokens run alone on a single Runtime, and a ragged commit keeps
each row's first n_i tokens only (no padding, no rejected tail in a committed state).

Tolerance as in tests/test_batch.py: a batched forward multiplies [B, S] activations,
so float32 sums may round otherwise than one row alone: logits within TOL, same greedy
tokens (docs/batching.md).
"""

import mlx.core as mx
import pytest

from conftest import tiny
from test_batch import batch_of, solo
from segcache.batch import BatchRuntime
from segcache.drafters import make_decoder
from segcache.errors import UnsupportedModelError
from segcache.generation import stream_generate
from segcache.layers import BatchStateLayer
from segcache.runtime import Runtime
from segcache.testing import tokenizer as test_tokenizer

TOL = 1e-4
# nemotron_h: Mamba-2 mixers beside attention; mamba2: Mamba-2 only; lfm2: short convolutions
# beside attention; mamba: a hook that counts (its module never calls advance); rwkv7: 3 slots
FAMILIES = ("nemotron_h", "mamba2", "lfm2", "mamba", "rwkv7")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [3] * 12, [], [11, 12]]


def close(got, want, what):
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert diff <= TOL, f"{what}: logits differ by {diff}"
    assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(want, axis=-1)).item(), f"{what}: greedy tokens"


def slots(br):
    return [a for layer in br.cache if isinstance(layer, BatchStateLayer) for a in layer.cache if a is not None]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ("replay", "states"))
def test_a_ragged_round_commits_each_row_as_alone(family, strategy):
    """A plain step, then fork, one ragged forward (an empty row among them), and each row
    keeping none, some or all of what it fed: every forward's logits and the next step's
    are those of a single Runtime fed the row's kept tokens."""
    model = tiny(family)
    br = batch_of(model, PROMPTS, recurrent_strategy=strategy)
    held = [list(p) for p in PROMPTS]
    logits = br.forward([[5]] * len(held))
    for i, h in enumerate(held):
        close(logits[i, 0], solo(model, h).forward([5])[0, 0], f"row {i}, plain step")
        h.append(5)
    feeds = [[1, 2, 3], [4], [5, 6], [7, 8, 9], [10]]
    br.fork()
    logits = br.forward(feeds)
    for i, (h, f) in enumerate(zip(held, feeds)):
        close(logits[i, : len(f)], solo(model, h).forward(f)[0], f"row {i}, in the branch")
    ns = [2, 1, 0, 3, 0]  # some, all of one (row 1), none, all of three, none of one
    br.commit(ns)
    br.check()
    for h, f, n in zip(held, feeds, ns):
        h.extend(f[:n])
    logits = br.forward([[6]] * len(held))
    for i, h in enumerate(held):
        assert br.tokens(i) == h + [6]
        close(logits[i, 0], solo(model, h).forward([6])[0, 0], f"row {i} after keeping {ns[i]}")


@pytest.mark.parametrize("family", ("nemotron_h", "lfm2", "rwkv7"))
@pytest.mark.parametrize("strategy", ("replay", "states"))
def test_the_rejected_tail_and_the_padding_never_reach_a_committed_state(family, strategy):
    """Two batches feed the same kept tokens and different rejected ones (in rows padded on
    the right): the committed slots and the next step are bit for bit the same.

    Mutation caught: commit_rows keeping the live slots of a padded row, or replaying a
    row's records uncut (its n_i tokens plus the rest)."""
    model = tiny(family)
    kept = [[1, 2], [4], [], [7, 8, 9]]
    tails = ([[3, 3], [5, 5, 5], [6], []], [[9, 1], [2, 7, 4], [8], []])
    nexts = []
    for tail in tails:
        br = batch_of(model, PROMPTS[:4], recurrent_strategy=strategy)
        br.fork()
        br.forward([k + t for k, t in zip(kept, tail)])  # ragged: 4, 4, 1, 3 tokens
        br.commit([len(k) for k in kept])
        br.check()
        nexts.append((slots(br), br.forward([[6]] * 4)))
    (a, la), (b, lb) = nexts
    assert a and len(a) == len(b) and all(mx.array_equal(x, y).item() for x, y in zip(a, b))
    assert mx.array_equal(la, lb).item()
    for i, (p, k) in enumerate(zip(PROMPTS, kept)):
        close(la[i, 0], solo(model, p + k).forward([6])[0, 0], f"row {i}")


@pytest.mark.parametrize("family", ("nemotron_h", "lfm2"))
def test_rows_leave_and_move_out_during_a_branch(family):
    """leave, extract and copy_row with a ragged branch open take each row's records along:
    every batch commits its rows as a single Runtime would, and a copy leaves its source
    untouched (take builds new branch marks).

    Mutation caught: BatchStateLayer.take cutting the slots but not the branch's calls (a
    commit then replays another row's tokens), or cutting the marks in place (the copy's
    take reaches the source batch)."""
    model = tiny(family)
    prompts = [[1, 2, 3, 4], [9, 8, 7], [3] * 8, [11, 12], []]
    br = batch_of(model, prompts)
    br.fork()
    br.forward([[20, 21, 22], [23, 24, 25], [26, 27, 28], [29, 30, 31], [32, 33]])  # ragged
    br.leave(1)
    one = br.extract(2)
    copy = br.copy_row(4)
    for b in (br, one, copy):
        b.check()
    copy.commit([2])
    br.commit({0: 2, 3: 3, 4: 1})
    one.commit([1])
    want = {
        br: {0: prompts[0] + [20, 21], 3: prompts[3] + [29, 30, 31], 4: [32]},
        one: {2: prompts[2] + [26]},
        copy: {4: [32, 33]},
    }
    for b, rows in want.items():
        b.check()
        logits = b.forward([[40]] * len(b))
        for rid, held in rows.items():
            assert b.tokens(rid) == held + [40]
            close(logits[b.index(rid), 0], solo(model, held).forward([40])[0, 0], f"row {rid}")
    rt = one.to_runtime(2)
    rt.check()
    assert rt.tokens == prompts[2] + [26, 40]
    close(rt.forward([41])[0, 0], solo(model, prompts[2] + [26, 40]).forward([41])[0, 0], "to_runtime")


@pytest.mark.parametrize("family", ("nemotron_h", "lfm2"))
def test_batched_decoding_with_drafts_gives_each_row_its_greedy_tokens_alone(family):
    """BatchDecoder over a state family (prompt-lookup drafts verified in ragged rounds):
    each row's greedy tokens are those of the same prompt generated alone."""
    model = tiny(family)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [3, 4, 3, 4, 3, 4, 3, 4, 3]]
    dec = make_decoder(model, num_draft_tokens=3, gate=False)
    for i, p in enumerate(prompts):
        rt = Runtime(model)
        rt.forward(p[:-1])
        dec.add(i, rt, p[-1], max_tokens=12)
    got = {i: [] for i in range(len(prompts))}
    while dec.rows:
        for rid, emitted in dec.step().items():
            got[rid].extend(t for t, _, _ in emitted)
            if len(got[rid]) >= 12:
                dec.remove(rid)
        dec.batch.check()
    tk = test_tokenizer.tokenizer(eos=False)
    for i, p in enumerate(prompts):
        assert got[i][:12] == [r.token for r in stream_generate(model, tk, p, max_tokens=12)], f"row {i}"


@pytest.mark.parametrize("family", ("recurrent_gemma", "longcat_flash_ngram", "falcon_h1"))
def test_state_families_a_batch_cannot_hold_are_refused_before_anything_changed(family):
    """recurrent_gemma starts a None state otherwise than zeros (an empty row beside others
    would be wrong), longcat's n-gram context grows with the first tokens, falcon_h1's
    layers are CacheLists (composites are not batched)."""
    model = tiny(family)
    classes = [type(m) for _, m in model.named_modules()]
    with pytest.raises(UnsupportedModelError, match="decode-concurrency 1"):
        BatchRuntime(model)
    assert [type(m) for _, m in model.named_modules()] == classes  # no module was adapted
