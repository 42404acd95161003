"""A reference lockstep decoding loop and tiny model directories, for the distributed tests and bench.

The loop is the protocol `segcache serve` follows across ranks, at its
smallest: rank 0 decides every step, the other ranks replay its decisions.
Greedy decoding, optionally with prompt-lookup drafts verified in a branch:

    decision d_t (rank 0 -> all, one message):  [done, commit, k, emitted_1..k, drafts...]
    every rank:  append the emitted tokens; commit the last round's branch to `commit`
                 tokens (-1: it opened none); stop if done; else
                 fork (if drafts) ─ lockstep(forward([pending, *drafts])) ─ evaluate the logits
                 (pending: the last token emitted, at first the prompt's last)
    rank 0:      accept (greedy match), the next token, the next drafts ─> d_{t+1}

Only rank 0 reads the logits; the others evaluate them to run the same
collectives, and never decide anything. It is not the serving engine (that
is `segcache.serve`); it exists so the primitives of `segcache.distributed`
are tested in the loop they were made for.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config
from mlx_lm.utils import save_model as save_weights

from ..distributed import Channel, fingerprint, lockstep
from ..lookup import PromptLookup
from ..sampling import match_accept
from . import models, tokenizer

NO_BRANCH = -1  # the commit word when the round opened no branch


class Fault(RuntimeError):
    """The failure `generate(fail=...)` injects into one rank's step."""


def generate(rt, channel: Channel, prompt: list[int], *, max_tokens: int, width: int = 0,
             fail: tuple[int, int] | None = None, step_size: int = 64, stats: dict | None = None) -> list[int]:
    """Greedy tokens after `prompt`, decided by rank 0 and replayed by every rank.

    Args:
        rt: this rank's Runtime (of its shard), holding nothing yet.
        channel: the group's channel.
        prompt: token ids (every rank passes the same; the fingerprints check it).
        max_tokens: tokens to generate.
        width: prompt-lookup drafts per round (0: plain decoding).
        fail: (rank, step): raise `Fault` while building that step on that rank
            (tests: every rank must fail the step together and keep its state).
        step_size: prompt tokens per prefill forward.
        stats: if given, rank 0 adds "rounds", "drafted", "accepted" and "partial"
            (rounds that accepted some drafts but not all) to it.

    Returns:
        The generated tokens (the same list on every rank). The runtime then holds
        prompt + tokens[:-1], all committed.

    Raises:
        RankFailedError, RankDivergedError: a step failed on some rank; every
            rank raised it, with its runtime as before that step.
    """
    lookup = PromptLookup() if channel.leader and width else None
    step = 0

    def forward(tokens: list[int]) -> mx.array:
        nonlocal step

        def build():
            if fail is not None and fail == (channel.rank, step):
                return _failing_forward(rt, tokens, f"injected at step {step} on rank {channel.rank}")
            return rt.forward(tokens)

        try:
            logits = lockstep(channel, build, [rt], fingerprint=fingerprint(rt.offset, tokens), what=f"step {step}")
        finally:
            step += 1
        mx.eval(logits)  # every rank: the forward's collectives run here, in the same order
        return logits[0]

    for i in range(0, len(prompt) - 1, step_size):
        forward(prompt[i : min(i + step_size, len(prompt) - 1)])
    if lookup is not None:
        lookup.extend(prompt)
    out: list[int] = []
    # decision: [done, commit, k, emitted_1..emitted_k, drafts...]; the next pending token is
    # the last one emitted (the prompt's last at first), fed with the drafts
    decision = [0, NO_BRANCH, 0, *(lookup.draft(min(width, max_tokens - 1)) if lookup else [])]
    branch = None
    while True:
        d = channel.broadcast(decision if channel.leader else None)
        done, commit, k = d[0], d[1], d[2]
        emitted, drafts = d[3 : 3 + k], d[3 + k :]
        out += emitted
        if branch is not None:
            branch.commit(commit)
            branch = None
        if done:
            return out
        pending = out[-1] if out else prompt[-1]
        branch = rt.fork() if drafts else None
        logits = forward([pending, *drafts])
        if not channel.leader:
            continue
        targets = mx.argmax(logits, axis=-1).tolist()
        n = match_accept(drafts, targets)
        if stats is not None:
            for key, value in (("rounds", 1), ("drafted", len(drafts)), ("accepted", n),
                               ("partial", int(0 < n < len(drafts)))):
                stats[key] = stats.get(key, 0) + value
        new = (drafts[:n] + [targets[n]])[: max_tokens - len(out)]
        if lookup is not None:
            lookup.extend(new)
        done = len(out) + len(new) >= max_tokens
        left = max_tokens - len(out) - len(new) - 1
        nxt = lookup.draft(min(width, left)) if lookup is not None and not done else []
        # The branch keeps pending and the accepted drafts that were emitted: the
        # last emitted token is fed next round (or never, at the end).
        decision = [int(done), len(new) if drafts else NO_BRANCH, len(new), *new, *nxt]


def _failing_forward(rt, tokens: list[int], message: str):
    """`rt.forward(tokens)` that raises half-way: in the last K/V layer past the first, after
    the layers before it built their graphs (their collectives included) and wrote their caches."""
    index = max(i for i, layer in enumerate(rt.cache) if hasattr(layer, "keys") and i > 0)
    layer = rt.cache[index]

    def fail(*args, **kwargs):
        raise Fault(message)

    layer.update_and_fetch = fail  # this object only, for this call
    try:
        return rt.forward(tokens)
    finally:
        del layer.update_and_fetch


def save_model(family: str, directory, *, seed: int = 0, **overrides) -> Path:
    """A tiny `family` model (segcache.testing.models) as an mlx-lm model directory.

    Writes config.json, the weights with model.safetensors.index.json (which
    mlx-lm's pipeline loading reads) and the test tokenizer.
    """
    directory = Path(directory)
    save_weights(directory, models.build(family, seed=seed, **overrides))
    save_config(models.config(family, **overrides), directory / "config.json")
    tokenizer.save(directory)
    return directory
