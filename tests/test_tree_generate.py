"""Tree speculation end to end (issue 31, docs/tree.md): prompt lookup's trees of several
matches, the greedy walk, `draft_tree=` on stream_generate / generate / make_decoder."""

import segcache  # noqa: F401

import random
from unittest import mock

import mlx.core as mx
import mlx_lm
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny
from segcache import Runtime
from segcache.drafters import make_drafter
from segcache.generation import generate, stream_generate
from segcache.layers.tree import Tree
from segcache.lookup import PromptLookup
from segcache.processors import make_processors
from segcache.testing import tokenizer as test_tokenizer
from test_generate_sampling import Biased


def _prompt(seed: int) -> list[int]:
    """A prompt where one 3-gram recurs with different continuations (so lookup proposes trees)."""
    rng = random.Random(seed)
    stem = [rng.randrange(64) for _ in range(3)]
    out = []
    for _ in range(6):
        out += stem + [rng.randrange(64) for _ in range(4)]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "qwen3_5", "gemma3_text"])
def test_greedy_tree_speculation_is_plain_greedy(family):
    model, tok = tiny(family), test_tokenizer.tokenizer(eos=False)
    kept = []
    keep_path = Runtime.keep_path

    def spy(rt, path):
        kept.append(list(path))
        return keep_path(rt, path)

    for seed in range(2):
        prompt = _prompt(seed)
        want = [r.token for r in mlx_lm.stream_generate(model, tok, mx.array(prompt), max_tokens=48)]
        rt = Runtime(model)
        with mock.patch.object(Runtime, "keep_path", spy):
            got = [r.token for r in stream_generate(model, tok, prompt, prompt_lookup=True, draft_tree=8,
                                                    max_tokens=48, runtime=rt)]
        assert got == want
        rt.check()
        assert rt.tokens == prompt + got and rt.depth == 0
    assert kept, "no round verified a tree"


def test_generate_takes_draft_tree_and_refuses_it_without_lookup():
    model, tok = tiny("qwen3_next"), test_tokenizer.tokenizer(eos=False)
    prompt = _prompt(3)
    assert generate(model, tok, prompt, prompt_lookup=True, draft_tree=12, max_tokens=20) == \
        generate(model, tok, prompt, max_tokens=20)
    with pytest.raises(ValueError, match="draft_tree"):
        generate(model, tok, prompt, draft_tree=4, max_tokens=4)
    with pytest.raises(ValueError, match="draft_tree"):
        make_drafter(model, prompt_lookup=True, draft_tree=-1)


def test_a_model_without_tree_layers_verifies_chains_and_says_so():
    model, tok = tiny("nemotron_h"), test_tokenizer.tokenizer(eos=False)
    prompt = _prompt(4)
    want = [r.token for r in mlx_lm.stream_generate(model, tok, mx.array(prompt), max_tokens=24)]
    with pytest.warns(UserWarning, match="verify no trees"):
        got = [r.token for r in stream_generate(model, tok, prompt, prompt_lookup=True, draft_tree=8,
                                                max_tokens=24)]
    assert got == want


@settings(max_examples=200, deadline=None)
@given(history=st.lists(st.integers(0, 5), min_size=2, max_size=40), depth=st.integers(1, 6),
       budget=st.integers(1, 16))
def test_lookup_tree_holds_the_continuations_of_earlier_matches(history, depth, budget):
    lookup = PromptLookup()
    lookup.extend(history)
    tokens, parents = lookup.draft_tree(depth, budget)
    assert len(tokens) == len(parents) <= budget
    if not tokens:
        assert lookup.draft(depth) == []
        return
    tree = Tree([-1] + parents)
    paths = {tuple(tokens[i - 1] for i in tree.path(node)[1:]) for node in range(1, tree.size)}
    assert len(paths) == tree.size - 1  # no two siblings hold one token
    assert max(tree.depths) <= depth
    chain = lookup.draft(depth)
    assert tuple(chain[: min(depth, budget)]) in paths | {()}  # the first branch is the chain
    # every path is a prefix of some earlier occurrence's continuation (brute force)
    size = len(history)
    followers = set()
    for n in range(1, min(3, size - 1) + 1):
        gram = history[size - n :]
        for s in range(size - n):
            if history[s : s + n] == gram:
                followers.add(tuple(history[s + n : s + n + depth]))
    followers.add(tuple(chain))
    for p in paths:
        assert any(f[: len(p)] == p for f in followers), p


def test_processors_see_each_nodes_own_history():
    model, tok = tiny("qwen3_5"), test_tokenizer.tokenizer(eos=False)
    kept = []
    keep_path = Runtime.keep_path

    def spy(rt, path):
        kept.append(list(path))
        return keep_path(rt, path)

    for seed in range(2):
        prompt = _prompt(seed + 10)
        options = dict(repetition_penalty=1.3, repetition_context_size=6, logit_bias={prompt[2]: 2.0})
        plain = [r.token for r in stream_generate(model, tok, prompt, max_tokens=40,
                                                  processors=make_processors(vocab_size=64, **options))]
        with mock.patch.object(Runtime, "keep_path", spy):
            got = [r.token for r in stream_generate(model, tok, prompt, max_tokens=40, prompt_lookup=True,
                                                    draft_tree=8, processors=make_processors(vocab_size=64,
                                                                                             **options))]
        assert got == plain
    assert kept


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_draft_model_trees_are_plain_greedy_and_keep_the_draft_rows_a_prefix(family):
    # a draft that agrees with the target often, not always: the target's own weights, biased
    model, tok = tiny(family), test_tokenizer.tokenizer(eos=False)
    draft = Biased(model, scale=2.0)
    kept = []
    keep_path = Runtime.keep_path

    def spy(rt, path):
        kept.append(list(path))
        return keep_path(rt, path)

    prompt = _prompt(7)
    want = [r.token for r in mlx_lm.stream_generate(model, tok, mx.array(prompt), max_tokens=48)]
    rt, drt = Runtime(model), Runtime(draft)
    with mock.patch.object(Runtime, "keep_path", spy):
        got = [r.token for r in stream_generate(model, tok, prompt, draft_model=draft, draft_tree=12,
                                                num_draft_tokens=3, max_tokens=48, runtime=rt, draft_runtime=drt)]
    assert got == want
    rt.check()
    drt.check()
    assert drt.tokens == rt.tokens[: drt.offset] and rt.tokens == prompt + got
    off_chain = [p for p in kept if p != list(range(len(p)))]
    assert off_chain, "no accepted path left the draft's chain"
