"""Sampled tree speculation is exact (issue 31, docs/tree.md): recursive rejection over siblings,
and seeded rows emit plain seeded decoding's tokens.

Chi-square tests (helpers of tests/test_generate_sampling.py) of the tokens emitted against the
target's own distribution, with power against the drafts' distribution, through the decoder's
tree round (prompt lookup's trees, the exact acceptor) and on the math alone.
"""

import segcache  # noqa: F401

import math
from unittest import mock

import mlx.core as mx

from segcache import Runtime
from segcache.acceptors import ExactSpeculative
from segcache.drafters import make_decoder
from segcache.generation import stream_generate
from segcache.lookup import PromptLookup
from segcache.sampling import Sampler, tree_speculative_accept
from test_generate import model, prompt_ids, tok
from test_generate_sampling import RUNS, TEMP, chi2, chi2_critical, dist
from test_tree_generate import _prompt


def _first_tokens(target, prompt, runs, seed):
    """The first token of `runs` sampled generations (temperature 1) on the decoder stream_generate
    runs (a lone row, prompt lookup's trees of up to 8 nodes, 2 deep), each on a clone of one
    prefill: (counts, how many came from a draft). The decoder itself, not stream_generate around
    it, so a sample costs its round only (half the time; the same round, acceptor and draws)."""
    rt = Runtime(target)
    rt.forward(prompt[:-1])
    decoder = make_decoder(target, num_draft_tokens=2, draft_tree=8, gate=False, one_row=True, adaptive=False)
    mx.random.seed(seed)
    counts, from_draft = {}, 0
    for i in range(runs):
        decoder.add(i, rt.clone(), prompt[-1], acceptor=ExactSpeculative(Sampler(TEMP)), max_tokens=4)
        token, _, drafted = decoder.step()[i][0]
        decoder.remove(i)
        counts[token] = counts.get(token, 0) + 1
        from_draft += drafted
    return counts, from_draft


def test_tree_sampling_matches_target_distribution():
    # "... X a .. X b .. X c .. X": the lookup's tree offers a, b and c after the final X.
    target, base = model("qwen3_5"), prompt_ids()
    x = base[-1]
    a, b, c = sorted(range(2, 64), key=lambda t: -dist(target, base)[t])[:3]
    prompt = base + [a, 5, x, b, 7, x, c, 9, x]
    p = dist(target, prompt)
    lookup = PromptLookup()
    lookup.extend(prompt)
    tokens, parents = lookup.draft_tree(2, 8)
    roots = {t for t, parent in zip(tokens, parents) if parent == 0}
    assert {a, b, c} <= roots
    accept = sum(p[t] for t in roots)  # some sibling is accepted with probability sum p(children)
    assert 0.1 < accept < 0.95
    trees = []
    forward_tree = Runtime.forward_tree

    def spy(rt, toks, pars):
        trees.append(len(toks))
        return forward_tree(rt, toks, pars)

    with mock.patch.object(Runtime, "forward_tree", spy):
        counts, from_draft = _first_tokens(target, prompt, RUNS, seed=3)
    assert len(trees) >= RUNS  # every first round verified a tree
    stat, df = chi2(counts, p, RUNS)
    assert df >= 5
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} at df {df}: not the target's distribution"
    # Power: the same samples are far from the drafts' own distribution (the root's children) ...
    q = [1.0 / len(roots) if t in roots else 0.0 for t in range(len(p))]
    stat_q, df_q = chi2(counts, [0.98 * w + 0.02 / len(p) for w in q], RUNS)
    assert stat_q > 3 * chi2_critical(df_q)
    # ... and drafts were accepted as often as rejection over siblings accepts them.
    sigma = math.sqrt(RUNS * accept * (1 - accept))
    assert abs(from_draft - RUNS * accept) < 4.5 * sigma


def test_tree_accept_alone_emits_the_target_distribution_at_each_depth():
    # Root with children 1 (token 0), 2 (token 2); node 1 with child 3 (token 1). V = 4.
    p = mx.array([[0.4, 0.1, 0.3, 0.2], [0.2, 0.5, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    parents, tokens = [-1, 0, 0, 1], [9, 0, 2, 1]
    mx.random.seed(5)
    first, second, runs = {}, {}, 6000
    for _ in range(runs):
        path, tok = tree_speculative_accept(p, parents, tokens)
        emitted = [tokens[i] for i in path[1:]] + [tok]
        first[emitted[0]] = first.get(emitted[0], 0) + 1
        if emitted[0] == 0:  # the second token follows node 1's distribution
            second[emitted[1]] = second.get(emitted[1], 0) + 1
    for counts, probs in ((first, p[0].tolist()), (second, p[1].tolist())):
        n = sum(counts.values())
        stat, df = chi2(counts, probs, n)
        assert stat < chi2_critical(df), f"chi2 {stat:.1f} at df {df}"
    # power: emitting the first child whenever it exists would give a point mass on token 0
    stat_q, df_q = chi2(first, [0.97, 0.01, 0.01, 0.01], runs)
    assert stat_q > 3 * chi2_critical(df_q)


def test_seeded_tree_speculation_is_plain_seeded_decoding():
    target = model("qwen3_next")
    trees = []
    forward_tree = Runtime.forward_tree

    def spy(rt, toks, pars):
        trees.append(len(toks))
        return forward_tree(rt, toks, pars)

    for seed in (1, 2):
        prompt = _prompt(seed)
        plain = [r.token for r in stream_generate(target, tok(), prompt, sampler=Sampler(0.7, top_p=0.9),
                                                  seed=seed, max_tokens=40)]
        with mock.patch.object(Runtime, "forward_tree", spy):
            got = [r.token for r in stream_generate(target, tok(), prompt, sampler=Sampler(0.7, top_p=0.9),
                                                    seed=seed, max_tokens=40, prompt_lookup=True, draft_tree=8)]
        assert got == plain
    assert trees
