"""Hypothesis strategies for driving runtimes."""

from __future__ import annotations

from hypothesis import strategies as st


def token_ids(vocab: int) -> st.SearchStrategy[int]:
    return st.integers(min_value=0, max_value=vocab - 1)


def token_chunks(vocab: int, max_len: int = 4) -> st.SearchStrategy[list[int]]:
    """A forward's worth of token ids (1..max_len of them)."""
    return st.lists(token_ids(vocab), min_size=1, max_size=max_len)


def commit_points(length: int) -> st.SearchStrategy[int]:
    """How many of a branch's `length` tokens to keep: all, none, or a strict prefix."""
    if length < 2:
        return st.integers(0, length)
    return st.one_of(st.integers(1, length - 1), st.sampled_from([0, length]))


@st.composite
def draft_trees(draw, vocab: int, max_nodes: int = 8) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a verify tree of 1..max_nodes nodes (layers/tree.py): node 0 the root,
    each other node's parent an earlier node, so chains, bushes and everything between come up."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    return draw(st.lists(token_ids(vocab), min_size=n, max_size=n)), parents
