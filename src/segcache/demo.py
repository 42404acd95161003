"""`segcache demo`: the runtime on a built-in small hybrid model.

Prefills a prompt, drafts tokens in a branch and commits part of them, rolls
back a second branch, and checks the result against a recomputation.
"""

from __future__ import annotations

import argparse
import time

from . import BLAS, __version__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of the built-in model's weights")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="length of the demo prompt")


def _header() -> None:
    import mlx.core as mx

    print(f"segcache {__version__} | mlx {mx.__version__} on {mx.default_device()} | BLAS: {BLAS}")


def run(args) -> int:
    """Run the runtime demo; returns an exit code (0: every check held)."""
    import mlx.core as mx

    from .runtime import Runtime
    from .testing import models
    from .testing.statemachine import assert_logits_close

    _header()
    model = models.build(
        "qwen3_5", seed=args.seed, hidden_size=256, num_hidden_layers=6, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=512,
        full_attention_interval=3,
    )
    rt = Runtime(model)
    print(f"model: qwen3_5 hybrid, random weights; {rt}, recurrent strategy {rt.recurrent_strategy!r}")

    prompt = [(7 * i + 3) % 512 for i in range(args.prompt_tokens)]
    start = time.perf_counter()
    logits = rt.forward(prompt)
    mx.eval(logits, [c.state for c in rt.cache])
    took = time.perf_counter() - start
    print(f"prefill   {len(prompt)} tokens in {took * 1e3:.0f} ms ({len(prompt) / took:.0f} tok/s)")

    # Branch 1: draft 6 tokens greedily one by one, keep 4 of them.
    next_token = mx.argmax(logits[0, -1]).item()
    start = time.perf_counter()
    with rt.fork() as branch:
        draft = []
        for _ in range(6):
            draft.append(next_token)
            next_token = mx.argmax(rt.forward([next_token])[0, -1]).item()
        branch.commit(4)
    mx.eval([c.state for c in rt.cache])
    print(f"branch 1  drafted {draft}, committed the first 4 "
          f"({(time.perf_counter() - start) * 1e3:.0f} ms); offset {rt.offset}")

    # Branch 2: forward 5 tokens, then drop them.
    with rt.fork() as branch:
        rt.forward([1, 2, 3, 4, 5])
        print(f"branch 2  forwarded 5 tokens (offset {rt.offset}, depth {rt.depth}), rolling back")
        branch.rollback()
    print(f"after     offset {rt.offset}, depth {rt.depth}, tokens = prompt + {rt.tokens[len(prompt):]}")

    rt.check()
    fresh = Runtime(model)
    fresh.forward(prompt + draft[:4])
    probe = [11]
    ours, theirs = rt.forward(probe), fresh.forward(probe)
    diff = mx.abs(ours - theirs).max().item()
    assert_logits_close(ours, theirs, "demo")
    same = mx.argmax(ours[0, -1]).item() == mx.argmax(theirs[0, -1]).item()
    print(f"check     invariants hold; next-token logits vs a runtime that saw only the committed "
          f"tokens: max |diff| {diff:.2e}, same greedy token: {same}")
    return 0 if same else 1
