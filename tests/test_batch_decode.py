"""Batched decoding, plain and speculative (prompt lookup per row): each row's greedy
tokens equal the same request generated alone, and rows come and go mid-way."""

import pytest

from conftest import tiny
from segcache.drafters import make_decoder
from segcache.generation import stream_generate
from segcache.runtime import Runtime
from segcache.testing import tokenizer as test_tokenizer

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [9, 10, 11],
    [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3],
    [20, 21, 22, 23, 24, 20, 21, 22],
    [1, 2],
]
MAX = 20


def alone(model, prompt, n=MAX):
    tk = test_tokenizer.tokenizer(eos=False)
    return [r.token for r in stream_generate(model, tk, prompt, max_tokens=n)]


def start(dec, model, rid, prompt, max_tokens=MAX):
    rt = Runtime(model)
    rt.forward(prompt[:-1]) if len(prompt) > 1 else None
    dec.add(rid, rt, prompt[-1], max_tokens=max_tokens)


@pytest.mark.parametrize("family", ("qwen3_5", "llama"))
@pytest.mark.parametrize("width", (0, 3))
def test_each_row_generates_as_alone_with_joins_and_leaves(family, width):
    model = tiny(family)
    dec = make_decoder(model, num_draft_tokens=width, gate=False)
    got = {i: [] for i in range(len(PROMPTS))}
    from_draft = 0
    for i in (0, 1, 2):
        start(dec, model, i, PROMPTS[i])
    steps = 0
    waiting = [3, 4]
    while dec.rows or waiting:
        if steps == 2 and waiting:  # rows join between steps, mid-generation of the others
            for i in waiting:
                start(dec, model, i, PROMPTS[i])
            waiting = []
        for rid, emitted in dec.step().items():
            got[rid].extend(t for t, _, _ in emitted)
            from_draft += sum(d for _, _, d in emitted)
            if len(got[rid]) >= MAX:
                dec.remove(rid)  # leaves; the others go on untouched
        dec.batch.check()
        steps += 1
    for i, p in enumerate(PROMPTS):
        assert got[i][:MAX] == alone(model, p), f"row {i}"
    if width:
        assert from_draft > 0  # rows accepted drafts in batched verify rounds


def test_rows_finish_early_and_the_rest_continue():
    model = tiny("qwen3_5")
    dec = make_decoder(model, num_draft_tokens=2, gate=False)
    for i in range(3):
        start(dec, model, i, PROMPTS[i], max_tokens=4 + 4 * i)
    got = {i: [] for i in range(3)}
    while dec.rows:
        for rid, emitted in dec.step().items():
            got[rid].extend(t for t, _, _ in emitted)
            if len(got[rid]) >= 4 + 4 * rid:
                rt = dec.runtime(rid)  # its whole history, fed, as a single Runtime
                assert rt.tokens == PROMPTS[rid] + got[rid]
                dec.remove(rid)
    for i in range(3):
        assert got[i][: 4 + 4 * i] == alone(model, PROMPTS[i], 4 + 4 * i)
