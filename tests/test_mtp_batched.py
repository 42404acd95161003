"""The MTP head batched over rows (segcache.mtp.segment.HeadRows: one head call per depth for
every row): each row's drafts against the single-row head on mlx-lm's own KVCache (the same
argmax within 1e-5 for a row alone, bit for bit where the BLAS rounds a product's rows alike
whatever the rows around them; within the batches' tolerance with the same argmax for rows of different
lengths batched), rounds that commit, roll back and lose rows, and greedy MTP decoding of
batched rows with late joins and per-row acceptance equal to mlx-lm's greedy decoding on
qwen3_5, qwen3_next and the shipped target with its head."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from segcache.batch.gate import Gate
from segcache.drafters import make_decoder
from segcache.errors import BranchError, InvariantError
from segcache.mtp import forward_with_hidden, load_head
from segcache.mtp.segment import HeadRows
from segcache.runtime import Runtime
from test_batch_decode import PROMPTS
from test_mtp_decode import fitted, reference

TOL = 1e-4  # the batches' float32 tolerance (docs/batching.md)
ALONE_TOL = 1e-5  # a row alone: the same calls, only the BLAS's rounding by row count apart
TARGET = Path(segcache.__file__).parent / "models" / "target"
FAMILIES = ("qwen3_next", "qwen3_5")

# rows of different lengths: a prefix of n tokens joined, then k more kept (a plain step or a
# round's close), so their tails differ (1 + k states) and one row does not draft
SEQS = [[(t * 7 + i) % 60 + 2 for t in range(22)] for i in range(4)]
JOINED, KEPT, DRAFTING = [5, 9, 3, 12], [1, 3, 2, 4], [True, True, False, True]
DEPTH = 3


def mtp_decoder(model, **options):
    """The decoder under test (the one place it is built)."""
    return make_decoder(model, **options)


def _rows(head, full, index):
    """HeadRows of rows `index`: joined at JOINED, then given KEPT more target states."""
    rows = HeadRows(head)
    for i in index:
        rows.join(i, full[i][: JOINED[i]], SEQS[i][: JOINED[i] + 1], 2048)
    K = max(KEPT[i] for i in index)
    H = full[0].shape[1]
    extra = mx.stack([mx.concatenate([full[i][JOINED[i] : JOINED[i] + KEPT[i]], mx.zeros((K - KEPT[i], H))])
                      for i in index])
    rows.close(extra, [KEPT[i] for i in index])
    histories = [SEQS[i][: JOINED[i] + KEPT[i] + 1] for i in index]
    rows.check([len(h) - 1 for h in histories])
    return rows, histories


def _batched_drafts(head, rows, histories, drafting):
    """Greedy drafts of a round on `rows`: per depth the logits [B, V] (the round left open)."""
    rows.fork()
    h = rows.catch_up(drafting, histories)
    logits = head.project(h)[:, 0]
    out = [logits]
    for j in range(1, DEPTH):
        tok = mx.argmax(logits, axis=-1).astype(mx.uint32)
        logits, h = rows.depth(h, tok[:, None], j)
        logits = logits[:, 0]
        out.append(logits)
    return out


def _single_row_drafts(head, full, i):
    """The same round of row i on the single-row head (mlx-lm KVCache), fed in the same calls."""
    cache = head.make_cache()
    n, k = JOINED[i], KEPT[i]
    head(full[i][None, : n - 1], mx.array(SEQS[i][1:n])[None], cache)
    logits, h = head(full[i][None, n - 1 : n + k], mx.array(SEQS[i][n : n + k + 1])[None], cache)
    logits, h = logits[:, -1], h[:, -1:]
    out = [logits[0]]
    for j in range(1, DEPTH):
        tok = mx.argmax(logits, axis=-1).astype(mx.uint32)
        logits, h = head(h, tok[:, None], cache, depth=j)
        logits = logits[:, 0]
        out.append(logits[0])
    return out


def _target_states(model):
    return [forward_with_hidden(model, mx.array(s)[None])[1][0] for s in SEQS]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_alone_drafts_what_the_single_row_head_drafts(family):
    model, head = fitted(family)
    full = _target_states(model)
    for i in range(len(SEQS)):
        rows, histories = _rows(head, full, [i])
        got = _batched_drafts(head, rows, histories, [True])
        for j, want in enumerate(_single_row_drafts(head, full, i)):
            # Bit for bit with the reference BLAS and on the Intel machines this first ran on;
            # OpenBLAS's kernels on AMD EPYC round a product's rows by how many there are (a
            # catch-up's one query against the reference's k + 1): 2-8e-6 apart there.
            assert mx.argmax(got[j][0]).item() == mx.argmax(want).item(), (i, j)
            assert mx.abs(got[j][0] - want).max().item() <= ALONE_TOL, (i, j)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_draft_what_each_row_alone_drafts(family):
    """Rows of different lengths and tails in one call per depth: every drafting row's logits
    within TOL of the single-row head's and the same greedy drafts; after the round closes
    every row (the one that did not draft too) holds the pairs of its committed tokens."""
    model, head = fitted(family)
    full = _target_states(model)
    index = list(range(len(SEQS)))
    rows, histories = _rows(head, full, index)
    got = _batched_drafts(head, rows, histories, DRAFTING)
    worst = 0.0
    for i in index:
        if not DRAFTING[i]:
            continue
        for j, want in enumerate(_single_row_drafts(head, full, i)):
            worst = max(worst, mx.abs(got[j][i] - want).max().item())
            assert mx.argmax(got[j][i]).item() == mx.argmax(want).item(), (i, j)
    assert worst < TOL
    # the verify kept 1 + accepted tokens per row: their target states join the tails
    accepted = [2, 0, 0, 1]
    keep = [1 + a for a in accepted]
    hist = [SEQS[i][: JOINED[i] + KEPT[i] + 1 + keep[i]] for i in index]
    K = max(keep)
    verify = mx.stack([full[i][len(histories[i]) - 1 : len(histories[i]) - 1 + K] for i in index])
    rows.close(verify, keep)
    rows.check([len(h) - 1 for h in hist])
    rows.feed_tails(hist, 0)  # every pair but the last
    for i in index:
        n = rows.held[i]
        assert n == len(hist[i]) - 2
        ref = head.make_cache()
        head(full[i][None, :n], mx.array(hist[i][1 : n + 1])[None], ref)
        k, v = ref[0].keys_and_values()
        assert mx.allclose(rows.layers[0].keys[i : i + 1, :, :n], k, atol=TOL).item()
        assert mx.allclose(rows.layers[0].values[i : i + 1, :, :n], v, atol=TOL).item()


def test_a_round_rolls_back_and_rows_leave_mid_round():
    model, head = fitted("qwen3_5")
    full = _target_states(model)
    rows, histories = _rows(head, full, [0, 1, 2, 3])
    before = (list(rows.held), list(rows.lags), rows.tail, [list(layer.lengths) for layer in rows.layers])
    _batched_drafts(head, rows, histories, DRAFTING)
    with pytest.raises(BranchError):
        rows.join("late", None, [1], 2048)
    with pytest.raises(InvariantError):
        rows.check()
    rows.rollback()
    rows.check([len(h) - 1 for h in histories])
    assert (rows.held, rows.lags, [layer.lengths for layer in rows.layers]) == (before[0], before[1], before[3])
    assert rows.tail is before[2]
    # a row leaving an open round takes its part along; the others close as if it never was
    _batched_drafts(head, rows, histories, DRAFTING)
    rows.leave(1)
    kept = [0, 2, 3]
    rows.close(mx.stack([full[i][len(histories[i]) - 1 : len(histories[i])] for i in kept]), [1, 1, 1])
    rows.check([len(histories[i]) for i in kept])
    assert rows.ids == kept


def _run_batched(dec, model, prompts, late, n):
    """Greedy MTP on rows joining at step 0 and (late) at step 2; per step each drafting row's
    accepted count. Returns (tokens per row, accepted counts of steps where rows drafted)."""
    got = {i: [] for i in range(len(prompts))}
    steps, per_step = 0, []

    def start(i):
        rt = Runtime(model)
        rt.forward(prompts[i][:-1])
        dec.add(i, rt, prompts[i][-1], max_tokens=n)

    for i in range(len(prompts)):
        if i not in late:
            start(i)
    while dec.rows or steps <= 2:
        if steps == 2:
            for i in late:
                start(i)
        out = dec.step()
        drafted = {rid: sum(d for _, _, d in emitted) for rid, emitted in out.items()
                   if dec.rows[rid].stats.drafted_per_round[-1]}
        if len(drafted) > 1:
            per_step.append(drafted)
        for rid, emitted in out.items():
            got[rid].extend(t for t, _, _ in emitted)
            if dec.rows[rid].finished or len(got[rid]) >= n:
                dec.remove(rid)
        dec.check()
        steps += 1
    return {i: g[:n] for i, g in got.items()}, per_step


def _shipped():
    model, tok = mlx_lm.load(str(TARGET))
    head = load_head(model, TARGET)
    text = (TARGET.parent / "heldout_stdlib.txt").read_text()
    prompts = [tok.encode(text[i * 2000 : i * 2000 + 200 + 40 * i]) for i in range(5)]
    return model, head, prompts


@pytest.mark.parametrize("target", ("qwen3_next", "qwen3_5", "shipped"))
def test_greedy_batched_mtp_with_late_joins_equals_plain_greedy(target):
    """Rows of different lengths, two joining late, each accepting its own count per round
    (some round has rows accepting different counts): every row's tokens are mlx-lm's
    greedy ones, ungated at depths 1 and 3 and gated."""
    if target == "shipped":
        model, head, prompts = _shipped()
        n = 24
    else:
        model, head = fitted(target)
        prompts, n = PROMPTS, 20
    want = {i: reference(model, p, n) for i, p in enumerate(prompts)}
    differing = False
    for k, gate in ((1, False), (3, False), (3, True)):
        dec = mtp_decoder(model, num_draft_tokens=k, mtp=head, gate=gate, adaptive=False)
        got, per_step = _run_batched(dec, model, prompts, late=(1, 3), n=n)
        assert got == want, (k, gate)
        differing |= any(len(set(s.values())) > 1 for s in per_step)
    assert differing


def test_the_gate_times_steps_by_its_own_clock():
    """A Gate's `clock` is what the decoder times its steps with (a CPU-time clock on a shared
    machine): every recorded step cost is two of that clock's differences, the step's own and
    the settling of its round at the start of the next step (each 3 ticks here)."""
    model, head = fitted("qwen3_5")
    ticks = iter(range(0, 10_000, 3))
    gate = Gate(clock=lambda: float(next(ticks)))
    dec = mtp_decoder(model, num_draft_tokens=2, mtp=head, gate=gate)
    _run_batched(dec, model, PROMPTS[:3], late=(), n=8)
    samples = [x for kept in gate.cost.samples.values() for x in kept]
    assert samples and all(x == 6.0 for x in samples)


def test_a_float16_head_drafts_for_a_float32_target_from_a_float32_copy_bit_for_bit():
    model, head, prompts = _shipped()
    params = dict(tree_flatten(head.module.parameters()))
    assert {v.dtype for v in params.values()} == {mx.float16}  # the shipped file
    run = mtp_decoder(model, num_draft_tokens=2, mtp=head).drafter.head
    assert run is not head and {v.dtype for _, v in tree_flatten(run.module.parameters())} == {mx.float32}
    assert {v.dtype for v in dict(tree_flatten(head.module.parameters())).values()} == {mx.float16}  # untouched
    hidden = forward_with_hidden(model, mx.array(prompts[0])[None])[1]
    toks = mx.array(prompts[0][1:] + [0])[None]
    a, ha = head(hidden, toks, head.make_cache())
    b, hb = run(hidden, toks, run.make_cache())
    assert mx.array_equal(a, b).item() and mx.array_equal(ha, hb).item()
    fitted_head = fitted("qwen3_5")[1]
    assert fitted_head.for_drafting() is fitted_head  # float32 already: the head itself
