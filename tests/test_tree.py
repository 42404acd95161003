"""Tree verify (issue 31, docs/tree.md): one forward of a tree of drafts, then commit a path.

The reference for every node is a chain forward of its root path on a fresh
runtime holding the same prompt; the reference for a committed path is that
chain forward committed whole. A forward of N rows rounds differently from
one of L (the matrix products block by rows), so rows agree within float
rounding with the same greedy token (docs/tree.md); a rejected tree leaves the
bits a rollback leaves.
"""

import segcache  # noqa: F401

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny
from segcache import Runtime
from segcache.errors import BranchError, UnsupportedOperationError
from segcache.layers.protocol import PAGES
from segcache.layers.tree import Tree
from segcache.testing import models
from segcache.testing.statemachine import assert_logits_close
from segcache.testing.strategies import draft_trees, token_chunks

# (family, Runtime options, committed state compared array by array)
CASES = {
    "llama": ("llama", {}, True),
    "llama-kv8": ("llama", dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0), False),
    "qwen3_next-states": ("qwen3_next", dict(recurrent_strategy="states"), True),
    "qwen3_next-replay": ("qwen3_next", dict(recurrent_strategy="replay"), True),
    "qwen3_5": ("qwen3_5", {}, True),
    "gemma3_text": ("gemma3_text", {}, True),  # a window of 8: prompts past it wrap the ring
}
_MODELS = {}


def _model(name):
    family, options, _ = CASES[name]
    if name not in _MODELS:
        _MODELS[name] = models.build(family, head_dim=32) if "kv_bits" in options else tiny(family)
    return _MODELS[name]


def _runtime(name, prompt):
    rt = Runtime(_model(name), **CASES[name][1])
    mx.eval(rt.forward(prompt))
    return rt


def _same(got, want, name, what):
    # A forward of N rows rounds differently from one of L rows (the matrix products' blocking),
    # so a tree's rows are the chain's within float rounding, with the same greedy token. With
    # quantized KV that rounding can put a key or value in the next bucket (~1e-3 in the logits).
    if "kv_bits" in CASES[name][1]:
        assert_logits_close(got, want, what, atol=5e-3, rtol=5e-3, margin=1e-2)
    else:
        assert_logits_close(got, want, what)


def _state(rt, n=None):
    """Every array of the state of the first `n` tokens (all: None), as the store exports it."""
    n = rt.offset if n is None else n
    out = []
    for layer in rt.cache:
        arrays = layer.export_rows(0, n) if layer.resumes_from == PAGES else layer.export_state()[0]
        out += [arrays[k] for k in sorted(arrays)]
    return out


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_commit_path_is_the_chain_forward_of_the_path(name, data):
    vocab = models.VOCAB
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=14), label="prompt")
    tokens, parents = data.draw(draft_trees(vocab, max_nodes=16), label="tree")
    tree = Tree(parents)
    end = data.draw(st.integers(-1, tree.size - 1), label="path end")
    path = tree.path(end) if end >= 0 else []
    probe = data.draw(token_chunks(vocab, 3), label="probe")

    rt = _runtime(name, prompt)
    with rt.fork() as branch:
        logits = rt.forward_tree(tokens, parents)
        rt.check()
        branch.commit(path)
    rt.check()
    committed = _state(rt)
    after = rt.forward(probe)

    for leaf in sorted(set(range(tree.size)) - set(parents)):
        nodes = tree.path(leaf)
        chain = _runtime(name, prompt)
        want = chain.forward([tokens[i] for i in nodes])
        _same(logits[:, mx.array(nodes)], want, name, f"the tree's rows of the path to node {leaf}")

    ref = _runtime(name, prompt)
    if path:
        with ref.fork() as branch:
            ref.forward([tokens[i] for i in path])
            branch.commit()
    assert rt.tokens[: len(prompt) + len(path)] == ref.tokens == prompt + [tokens[i] for i in path]
    if CASES[name][2]:  # a quantized row may land in the next bucket: the forward after shows it
        for got, want in zip(committed, _state(ref), strict=True):
            assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), f"committed state after path {path}"
    want = ref.forward(probe)
    _same(after, want, name, f"the forward after committing path {path}")
    assert rt.tokens == ref.tokens


@pytest.mark.parametrize("name", ["llama", "qwen3_next-states", "gemma3_text"])
def test_rejected_nodes_leave_what_a_rollback_leaves(name):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    tokens, parents = [7, 8, 9, 10, 11, 12], [-1, 0, 0, 1, 3, 2]
    rt, plain = _runtime(name, prompt), _runtime(name, prompt)
    with rt.fork() as branch:
        rt.forward_tree(tokens, parents)
        branch.rollback()
    with rt.fork() as branch:
        rt.forward_tree(tokens, parents)
        branch.commit([])
    rt.check()
    assert rt.tokens == prompt
    for got, want in zip(_state(rt), _state(plain)):
        assert mx.array_equal(got, want).item()
    assert mx.array_equal(rt.forward([5, 6]), plain.forward([5, 6])).item()


def test_misuse_raises_and_changes_nothing():
    rt = _runtime("qwen3_next-states", [1, 2, 3, 4])
    with pytest.raises(BranchError):
        rt.forward_tree([5, 6], [-1, 0])  # no branch open
    with rt.fork() as branch:
        rt.forward([9])
        with pytest.raises(BranchError):
            rt.forward_tree([5, 6], [-1, 0])  # the branch holds a token already
        branch.rollback()
    with rt.fork() as branch:
        with pytest.raises(ValueError):
            rt.forward_tree([5, 6, 7], [-1, 1, 0])  # a parent after its child
        with pytest.raises(ValueError):
            rt.forward_tree([5, 6], [-1, 0, 0])  # a token short
        rt.forward_tree([5, 6, 7, 8], [-1, 0, 0, 2])
        before = (rt.offset, rt.tokens)
        for bad in ([0, 3], [1, 3], [0, 2, 1], 3, -1, 5):
            with pytest.raises(BranchError):
                branch.commit(bad)
            assert (rt.offset, rt.tokens, rt.depth) == (*before, 1)
        with pytest.raises(BranchError):
            rt.forward([1])  # a tree pending: commit a path first
        rt.check()
        branch.commit([0, 2, 3])
    assert rt.tokens == [1, 2, 3, 4, 5, 7, 8]
    with rt.fork() as branch:  # an int n: the chain of nodes 0..n-1, where the tree has one
        rt.forward_tree([5, 6, 7], [-1, 0, 1])
        branch.commit(2)
    assert rt.tokens == [1, 2, 3, 4, 5, 7, 8, 5, 6]
    rt.check()


@pytest.mark.parametrize("family", ["nemotron_h"])
def test_other_recurrent_kinds_verify_chains(family):
    rt = Runtime(tiny(family))
    rt.forward([1, 2, 3])
    assert not rt.takes_trees
    with rt.fork():
        with pytest.raises(UnsupportedOperationError):
            rt.forward_tree([4, 5], [-1, 0])
        assert rt.offset == 3
    rt.check()
