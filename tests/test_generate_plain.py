"""Plain (pipelined) generation on a runtime: mlx-lm's tokens, and exact state at every stop."""

import segcache  # noqa: F401

import mlx.core as mx
import pytest
from mlx_lm import stream_generate as mlx_stream_generate

from conftest import tiny
from segcache import Runtime, stream_generate
from segcache.testing.tokenizer import tokenizer

PROMPT = [5, 17, 3, 42, 8, 8, 1]


@pytest.mark.parametrize("fam", ["qwen3_5", "llama"])
def test_closing_plain_generation_at_any_token_leaves_prompt_plus_emitted(fam):
    model, tok = tiny(fam), tokenizer(eos=False)
    reference = [r.token for r in mlx_stream_generate(model, tok, mx.array(PROMPT), max_tokens=12)]
    for stop in range(1, 13):
        rt = Runtime(model)
        stream = stream_generate(model, tok, PROMPT, max_tokens=12, runtime=rt)
        got = []
        for response in stream:
            got.append(response.token)
            if len(got) == stop:
                break
        stream.close()
        rt.check()
        assert got == reference[:stop]
        assert rt.tokens == PROMPT + got and rt.depth == 0
        fresh = Runtime(model)
        fresh.forward(PROMPT + got)
        assert mx.allclose(rt.forward([3]), fresh.forward([3]), atol=1e-4).item()
