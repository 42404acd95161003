"""Trees on batched rows (issue 31, docs/tree.md): a tree per row in one BatchRuntime forward,
a path kept per row; the decoder's tree rounds over a batch with late joins; the tree gate.

The reference for a row is a Runtime that only ever saw its committed tokens (a chain
forward of its path): batched rows and a forward of N rows round differently from one of
L rows, so logits agree within float rounding with the same greedy token (docs/tree.md,
docs/batching.md); a rejected tree leaves the bits a rollback leaves.
"""

import segcache  # noqa: F401

from unittest import mock

import mlx.core as mx
import mlx_lm
import pytest

from conftest import tiny
from segcache import Runtime
from segcache.batch import BatchRuntime
from segcache.batch.gate import Gate
from segcache.batch.tree_gate import TreeGate
from segcache.drafters import make_decoder
from segcache.errors import BranchError, UnsupportedOperationError
from segcache.layers.protocol import PAGES
from segcache.layers.tree import Tree
from segcache.serve.engine import Chunk, Engine, GenRequest
from segcache.serve.worker import Job, Scheduler
from segcache.testing.statemachine import assert_logits_close
from serve_util import TARGET
from test_batch_decode import PROMPTS
from test_generate_sampling import Biased
from test_mtp_batched import _run_batched
from test_mtp_decode import fitted, reference
from test_tree_generate import _prompt

ROWS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8], []]  # the last row joins empty
TREES = [([7, 8, 9, 10, 11, 12], [-1, 0, 0, 1, 3, 2]), ([5, 6], [-1, 0]), ([9, 4, 4, 2], [-1, 0, 1, 1])]
CASES = {"llama": "auto", "qwen3_next": "states", "qwen3_5": "replay", "gemma3_text": "auto"}  # gemma3: window 8


def _batch(family):
    model = tiny(family)
    br = BatchRuntime(model, recurrent_strategy=CASES[family])
    for i, prompt in enumerate(ROWS):
        rt = None
        if prompt:
            rt = Runtime(model, recurrent_strategy=CASES[family])
            rt.forward(prompt)
        br.join(i, rt)
    return model, br


def _alone(model, family, tokens):
    rt = Runtime(model, recurrent_strategy=CASES[family])
    if tokens:
        rt.forward(tokens)
    return rt


def _state(rt):
    if not rt.offset:
        return []
    out = []
    for layer in rt.cache:
        arrays = layer.export_rows(0, rt.offset) if layer.resumes_from == PAGES else layer.export_state()[0]
        out += [arrays[k] for k in sorted(arrays)]
    return out


@pytest.mark.parametrize("family", list(CASES))
def test_each_rows_path_commits_as_the_chain_forward_of_it(family):
    model, br = _batch(family)
    br.fork()
    logits = br.forward_trees([t for t, _ in TREES], [p for _, p in TREES])
    br.check()
    for i, (tokens, parents) in enumerate(TREES):  # every node of every row: its path's chain forward
        tree = Tree(parents)
        for leaf in sorted(set(range(tree.size)) - set(parents)):
            nodes = tree.path(leaf)
            want = _alone(model, family, ROWS[i]).forward([tokens[j] for j in nodes])
            assert_logits_close(logits[i : i + 1, mx.array(nodes)], want, f"row {i}, the path to node {leaf}")
    with pytest.raises(BranchError):  # not a root path: nothing changes
        br.keep_paths([[0, 2, 4], [1], [0]])
    paths, keep = [[0, 2, 5], [0, 1], [0, 1, 3]], [3, 1, 2]  # row 1 keeps less than its path (a settle)
    br.keep_paths(paths)
    br.check()
    br.commit(keep)
    br.check()
    probe = [[1], [2], [3]]
    after = br.forward(probe)
    for i, (tokens, _) in enumerate(TREES):
        held = ROWS[i] + [tokens[j] for j in paths[i][: keep[i]]]
        assert br.tokens(i) == held + probe[i]
        ref = _alone(model, family, held)
        assert_logits_close(after[i : i + 1, :1], ref.forward(probe[i]), f"row {i} after keeping {keep[i]}")


@pytest.mark.parametrize("family", ["qwen3_next", "llama", "gemma3_text"])
def test_a_kept_path_is_the_state_of_its_chain_and_a_rejected_tree_a_rollback(family):
    model, br = _batch(family)
    br.fork()
    br.forward_trees([t for t, _ in TREES], [p for _, p in TREES])
    paths = [[0, 1, 3, 4], [], [0, 1, 2]]  # row 1's tree rejected whole (it keeps nothing)
    br.keep_paths(paths)
    br.commit([len(p) for p in paths])
    br.check()
    for i, (tokens, _) in enumerate(TREES):
        held = ROWS[i] + [tokens[j] for j in paths[i]]
        got, want = br.to_runtime(i), _alone(model, family, held)
        assert got.tokens == want.tokens
        if family == "gemma3_text":  # a ring's layout follows how its tokens came: the forward after shows it
            assert_logits_close(got.forward([1]), want.forward([1]), f"row {i} after path {paths[i]}")
            continue
        for a, b in zip(_state(got), _state(want), strict=True):
            assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), f"row {i}: committed state after path {paths[i]}"
    # a rejected tree leaves exactly the bits of the batch before the fork
    model, before = _batch(family)
    states = [_state(before.to_runtime(i)) for i in range(len(ROWS))]
    before.fork()
    before.forward_trees([t for t, _ in TREES], [p for _, p in TREES])
    before.keep_paths([[], [], []])
    before.commit([0, 0, 0])
    for i in range(len(ROWS)):
        for a, b in zip(_state(before.to_runtime(i)), states[i], strict=True):
            assert mx.array_equal(a, b).item(), f"row {i}: a rejected tree changed its state"


def _plain(model, prompt, n):
    rt, out = Runtime(model), []
    logits = rt.forward(prompt)
    for _ in range(n):
        out.append(mx.argmax(logits[0, -1]).item())
        logits = rt.forward(out[-1:])
    return out


@pytest.mark.parametrize("family,drafter", [("qwen3_5", "lookup"), ("gemma3_text", "draft"), ("qwen3_next", "draft")])
def test_batched_greedy_trees_are_plain_greedy_with_late_joins(family, drafter):
    model = tiny(family)
    draft = Biased(model, scale=2.0) if drafter == "draft" else None
    prompts = {i: _prompt(20 + i) for i in range(3)}
    want = {i: _plain(model, p, 20) for i, p in prompts.items()}
    decoder = make_decoder(model, num_draft_tokens=3, draft_model=draft, draft_tree=8, gate=False)
    rows_per_tree = []
    keep_paths = BatchRuntime.keep_paths

    def spy(br, paths):
        rows_per_tree.append(len(paths))
        return keep_paths(br, paths)

    got = {i: [] for i in prompts}
    with mock.patch.object(BatchRuntime, "keep_paths", spy):
        for step in range(120):
            if step in (0, 2, 5):  # rows join while others are mid-generation
                i = (0, 2, 5).index(step)
                rt = Runtime(model)
                rt.forward(prompts[i][:-1])
                decoder.add(i, rt, prompts[i][-1], max_tokens=20)
            if not decoder.rows:
                break
            for rid, toks in decoder.step().items():
                got[rid] += [t for t, _, _ in toks]
            decoder.check()
            for rid in [r for r, s in decoder.rows.items() if s.finished]:
                rt = decoder.release(rid)
                rt.check()
                assert rt.tokens == prompts[rid] + got[rid]
    assert got == want
    assert max(rows_per_tree, default=0) > 1, "no tree round verified several rows"


def test_the_tree_gate_picks_chains_where_trees_do_not_pay_and_trees_where_they_do():
    gate = TreeGate(8, trial=2, probe=4)
    chosen = []
    for _ in range(24):  # trees emit 1.2x the chain's tokens for 1.5x its cost: chains
        b = gate.choose()
        chosen.append(b)
        gate.record(b, 3 if b == 0 else 3.6, 1.0 if b == 0 else 1.5)
        gate.check()
    assert chosen[:4] == [0, 0, 8, 8]  # each tried, the chain first
    assert chosen[4:].count(8) == len(chosen[4:]) // 5  # then trees once per probe only
    gate = TreeGate(8, trial=2, probe=4)
    for _ in range(12):  # trees emit 1.3x for 1.05x the cost: trees
        b = gate.choose()
        gate.record(b, 3 if b == 0 else 3.9, 1.0 if b == 0 else 1.05)
    assert [gate.choose() for _ in range(5)].count(8) == 4  # chains once per probe only


def test_a_gated_decoder_measures_trees_and_chains_and_stays_plain_greedy():
    model = tiny("qwen3_5")
    prompt = _prompt(9)
    ticks = iter(range(10**6))
    decoder = make_decoder(model, num_draft_tokens=3, draft_tree=8, gate=True, one_row=True)
    decoder.gate.clock = lambda: float(next(ticks))
    decoder.gate.choose = lambda avail, rows: max(avail)  # every step drafts: the tree gate decides the shape
    rt = Runtime(model)
    rt.forward(prompt[:-1])
    decoder.add(0, rt, prompt[-1], max_tokens=24)
    got = []
    while not decoder.rows[0].finished:
        got += [t for t, _, _ in decoder.step()[0]]
        decoder.check()
    assert got == _plain(model, prompt, 24)
    assert decoder.trees.rounds[0] >= 2 and decoder.trees.rounds[8] >= 1


def test_rows_of_a_model_without_tree_layers_verify_chains():
    model = tiny("nemotron_h", seed=3)  # Mamba-2 state layers: no tree adapter (a model of its own: said once per model)
    br = BatchRuntime(model)
    br.join(0, None)
    assert not br.takes_trees
    br.fork()
    with pytest.raises(UnsupportedOperationError):
        br.forward_trees([[1, 2]], [[-1, 0]])
    prompt = _prompt(5)
    decoder = make_decoder(model, num_draft_tokens=3, draft_tree=8, gate=False)
    rt = Runtime(model)
    rt.forward(prompt[:-1])
    decoder.add(0, rt, prompt[-1], max_tokens=24)
    got = []
    with pytest.warns(UserWarning, match="verify no trees"):
        while not decoder.rows[0].finished:
            got += [t for t, _, _ in decoder.step()[0]]
    assert got == _plain(model, prompt, 24)


@pytest.mark.parametrize("one_row", [True, False])
def test_mtp_trees_are_plain_greedy_one_row_and_batched_with_late_joins(one_row):
    """The MTP head's trees (its next likeliest tokens at each depth beside its chain): plain
    greedy's tokens; the head's rows keep the target states of each kept path (check())."""
    model, head = fitted("qwen3_5")
    want = {i: reference(model, p, 16) for i, p in enumerate(PROMPTS)}
    off_chain = []
    target = Runtime if one_row else BatchRuntime
    keep = target.keep_path if one_row else target.keep_paths

    def spy(rt, paths):
        off_chain.extend(p for p in ([paths] if one_row else paths) if p != list(range(len(p))))
        return keep(rt, paths)

    def decoder():
        return make_decoder(model, num_draft_tokens=3, mtp=head, gate=False, adaptive=False, draft_tree=8,
                            one_row=one_row)

    with mock.patch.object(target, "keep_path" if one_row else "keep_paths", spy):
        if one_row:
            got = {i: _run_batched(decoder(), model, [p], late=(), n=16)[0][0] for i, p in enumerate(PROMPTS[:3])}
            want = {i: want[i] for i in got}
        else:
            got, _ = _run_batched(decoder(), model, PROMPTS, late=(1, 3), n=16)
    assert got == want
    assert off_chain, "no accepted path left the head's chain"


def test_the_servers_engine_decodes_batched_trees_with_late_joins_as_plain_greedy(monkeypatch):
    """`segcache serve --prompt-lookup --draft-tree 8` at --decode-concurrency 4 (the engine through its
    scheduler, requests arriving while others decode), every step drafting and every round a tree:
    each request's text is mlx-lm's greedy text."""
    model, tok = mlx_lm.load(str(TARGET))
    monkeypatch.setattr(Gate, "choose", lambda self, avail, rows: max(avail))  # every step drafts
    monkeypatch.setattr(TreeGate, "choose", lambda self: self.budget)  # every round a tree
    text = open(TARGET.parent / "heldout_stdlib.txt").read()
    prompts = [tok.encode(text[i : i + 300]) for i in (0, 900, 1800)]
    want = [mlx_lm.generate(model, tok, prompt=p, max_tokens=24) for p in prompts]
    engine = Engine(model, tok, decode_concurrency=4, prompt_lookup=True, draft_tree=8)
    sched = Scheduler(engine, max_queue=4, max_running=4, begin_step=engine.begin_step)
    events = [[] for _ in prompts]
    rows_per_tree = []
    keep_paths = BatchRuntime.keep_paths

    def spy(br, paths):
        rows_per_tree.append(len(paths))
        return keep_paths(br, paths)

    with mock.patch.object(BatchRuntime, "keep_paths", spy):
        for step in range(2000):
            if step in (0, 3, 6):
                i = (0, 3, 6).index(step)
                sched.submit(Job(GenRequest(f"r{i}", prompts[i], 24), events[i].append))
            if not sched.step() and step > 6:
                break
    got = ["".join(e.text for e in ev if isinstance(e, Chunk)) for ev in events]
    assert got == want
    assert max(rows_per_tree, default=0) > 1, "no tree round verified several rows"
