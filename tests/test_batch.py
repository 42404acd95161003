"""BatchRuntime: every row of a batch matches the same sequence run alone.

Tolerance: rows are exact per position, but a batched forward multiplies
[B, S] activations and attends over the longest row's keys (others masked),
so float32 sums may round differently: logits within TOL of the row run
alone, and the same greedy tokens (docs/batching.md).
"""

import mlx.core as mx
import pytest

from conftest import tiny
from segcache.batch import BatchRuntime
from segcache.errors import BranchError
from segcache.runtime import Runtime

TOL = 1e-4
FAMILIES = ("qwen3_5", "qwen3_next", "llama")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [3] * 12, [11, 12]]


def close(a, b, what=""):
    diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
    assert diff <= TOL, f"{what}: logits differ by {diff}"


def solo(model, tokens):
    rt = Runtime(model)
    if tokens:
        rt.forward(tokens)
    return rt


def batch_of(model, prompts, **kw):
    br = BatchRuntime(model, **kw)
    for i, p in enumerate(prompts):
        br.join(i, solo(model, p) if p else None)
    br.check()
    return br


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_length_batch_decodes_as_each_prompt_alone(family):
    model = tiny(family)
    br = batch_of(model, [p[:-1] for p in PROMPTS])
    alone = [solo(model, p[:-1]) for p in PROMPTS]
    last = [[p[-1]] for p in PROMPTS]
    outs = [[] for _ in PROMPTS]
    for _ in range(6):
        logits = br.forward(last)
        nxt = []
        for i, rt in enumerate(alone):
            want = rt.forward(last[i])[0, 0]
            close(logits[i, 0], want, f"row {i}")
            tok = mx.argmax(logits[i, 0]).item()
            assert tok == mx.argmax(want).item()
            outs[i].append(tok)
            nxt.append([tok])
        last = nxt
        br.check()
    for i, p in enumerate(PROMPTS):
        assert br.tokens(i) == p + outs[i][:-1]


@pytest.mark.parametrize("family", ("qwen3_5", "llama"))
def test_empty_and_populated_rows_merged_keep_every_row(family):
    model = tiny(family)
    # an empty row first, then populated rows, then an empty one again
    br = BatchRuntime(model)
    br.join("e1")
    br.join("p1", solo(model, PROMPTS[0]))
    br.join("e2")
    br.join("p2", solo(model, PROMPTS[2]))
    br.check()
    feed = {"e1": [5, 6, 7], "p1": [1, 1, 2], "e2": [8, 9, 10], "p2": [4, 4, 4]}
    logits = br.forward([feed[r] for r in br.ids])
    for i, rid in enumerate(br.ids):
        held = {"p1": PROMPTS[0], "p2": PROMPTS[2]}.get(rid, [])
        want = solo(model, held).forward(feed[rid])[0]
        close(logits[i], want, rid)
        assert br.tokens(rid) == held + feed[rid]
    # and an empty row joining a populated batch after it decoded
    br.join("late")
    logits = br.forward([[3]] * 4 + [[12]])
    close(logits[4, 0], solo(model, []).forward([12])[0, 0], "late")
    close(logits[1, 0], solo(model, PROMPTS[0] + feed["p1"]).forward([3])[0, 0], "p1")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ("states", "replay"))
def test_rows_accept_none_some_and_all_drafts_in_one_round(family, strategy):
    model = tiny(family)
    prompts = [p[:-1] for p in PROMPTS[:3]]
    br = batch_of(model, prompts, recurrent_strategy=strategy)
    pending = [p[-1] for p in PROMPTS[:3]]
    # greedy continuations of each row alone: the drafts that will be accepted
    truth = []
    for p in PROMPTS[:3]:
        rt, seq, tok = solo(model, p[:-1]), [], p[-1]
        for _ in range(4):
            tok = mx.argmax(rt.forward([tok])[0, -1]).item()
            seq.append(tok)
        truth.append(seq)
    wrong = lambda t: (t + 1) % 64
    drafts = [
        [wrong(truth[0][0]), truth[0][1], truth[0][2]],  # accepts 0
        [truth[1][0], truth[1][1], wrong(truth[1][2])],  # accepts 2 of 3
        truth[2][:3],  # accepts all 3
    ]
    br.fork()
    logits = br.forward([[pending[i]] + drafts[i] for i in range(3)])
    br.check()
    accepted = []
    for i in range(3):
        targets = mx.argmax(logits[i], axis=-1).tolist()
        n = 0
        while n < 3 and drafts[i][n] == targets[n]:
            n += 1
        accepted.append(n)
    assert accepted == [0, 2, 3]
    br.commit([1 + n for n in accepted])
    br.check()
    for i, p in enumerate(PROMPTS[:3]):
        kept = [pending[i]] + drafts[i][: accepted[i]]
        assert br.tokens(i) == p + kept[1:]
    logits = br.forward([[truth[i][accepted[i]]] for i in range(3)])
    for i, p in enumerate(PROMPTS[:3]):
        kept = p + drafts[i][: accepted[i]] + [truth[i][accepted[i]]]
        want = solo(model, kept[:-1]).forward(kept[-1:])[0, 0]
        close(logits[i, 0], want, f"row {i} after accepting {accepted[i]}")
    br.check()


@pytest.mark.parametrize("family", ("qwen3_5", "llama"))
def test_filter_and_extract_during_and_right_after_a_branch(family):
    model = tiny(family)
    br = batch_of(model, [p[:-1] for p in PROMPTS])
    br.fork()
    br.forward([[p[-1], 20, 21] for p in PROMPTS])
    # during the branch: row 1 leaves, row 2 is extracted with its records
    br.leave(1)
    one = br.extract(2)
    br.check()
    one.check()
    assert br.ids == [0, 3] and one.ids == [2]
    br.commit({0: 2, 3: 3})
    one.commit([1])
    br.check()
    one.check()
    # right after: filter to one row, extract another
    br.filter([1])
    assert br.ids == [3]
    for b, rid, kept in ((br, 3, [PROMPTS[3][-1], 20, 21]), (one, 2, [PROMPTS[2][-1]])):
        held = PROMPTS[rid][:-1] + kept
        assert b.tokens(rid) == held
        got = b.forward([[30]])[0, 0]
        close(got, solo(model, held).forward([30])[0, 0], f"row {rid}")
        b.check()
    # and back to a single-sequence Runtime that continues exactly
    rt = one.to_runtime(2)
    assert rt.tokens == PROMPTS[2] + [30]
    close(rt.forward([31])[0, 0], solo(model, PROMPTS[2] + [30]).forward([31])[0, 0], "to_runtime")


def test_misuse_changes_nothing():
    model = tiny("qwen3_5")
    br = batch_of(model, [PROMPTS[0], PROMPTS[1]])
    before = [br.tokens(0), br.tokens(1)]
    with pytest.raises(BranchError):
        br.forward([[1, 2], [3]])  # ragged outside a branch
    with pytest.raises(ValueError):
        br.forward([[1]])
    br.fork()
    br.forward([[1, 2], [3]])
    with pytest.raises(BranchError):
        br.forward([[1], [1]])  # sealed
    with pytest.raises(BranchError):
        br.commit([2, 2])  # row 1 fed only 1
    with pytest.raises(BranchError):
        br.join("x")
    br.check()
    br.rollback()
    assert [br.tokens(0), br.tokens(1)] == before
    br.check()
