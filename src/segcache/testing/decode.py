"""Plain decoding with processors and per-request keys, step for step as mlx-lm.

A reference for tests and benchmarks of the sampling controls: the prompt is
prefilled as mlx-lm's `generate_step` does (all but the last token, then the
last one alone), and each step processes the raw logits with the row's
`Processors`, then picks the token greedily or with a `Sampler` and the
request's `Keys`. No speculation: the engine's rounds are checked against this.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..processors import Processors, normalize
from ..sampling import Keys, Sampler


def plain_decode(model, prompt: Sequence[int], *, max_tokens: int, processors: Optional[Processors] = None,
                 sampler: Optional[Sampler] = None, keys: Optional[Keys] = None,
                 eos: Sequence[int] = (), prefill_step: int = 2048) -> tuple[list, list]:
    """Generate up to `max_tokens` tokens (stopping after an EOS).

    Returns:
        (tokens, logprobs): the tokens, and the processed logprobs [V] each was chosen from.
    """
    if sampler is not None and keys is None:
        raise ValueError("a Sampler needs the request's Keys")
    cache = make_prompt_cache(model)
    prompt = list(prompt)
    for i in range(0, len(prompt) - 1, prefill_step):
        model(mx.array(prompt[i : min(i + prefill_step, len(prompt) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    history = list(prompt)
    step = prompt[-1:]
    tokens, logprobs = [], []
    while len(tokens) < max_tokens:
        logits = model(mx.array(step)[None], cache=cache)[0, -1:]
        lp = processors.process(logits, history) if processors else normalize(logits)
        tok = mx.argmax(lp, axis=-1) if sampler is None else sampler.sample(lp, keys)
        t = tok.item()
        tokens.append(t)
        logprobs.append(lp[0])
        history.append(t)
        if processors:
            processors.advance([t])
        if t in eos:
            break
        step = [t]
    return tokens, logprobs


def plain_decode_rows(model, prompt: Sequence[int], rows: Sequence[tuple], *, max_tokens: int,
                      eos: Sequence[int] = ()) -> list:
    """Several independent generations from one prompt, one batched forward per step.

    Every row has the same length at every step (rows that stopped keep
    feeding EOS, their output no longer read), so mlx-lm's own caches serve
    the batch without padding; each row keeps its own processors and keys.

    Args:
        rows: (processors, sampler, keys) per row; sampler None for greedy.

    Returns:
        The tokens of each row (up to and including its EOS).
    """
    if not eos:
        raise ValueError("rows stop at an EOS: pass the EOS tokens")
    filler = list(eos)[0]
    cache = make_prompt_cache(model)
    prompt = list(prompt)
    n = len(rows)
    if len(prompt) > 1:
        model(mx.array([prompt[:-1]] * n), cache=cache)
        mx.eval([c.state for c in cache])
    histories = [list(prompt) for _ in rows]
    outs: list = [[] for _ in rows]
    live = set(range(n))
    step = [prompt[-1]] * n
    while live and max(len(outs[i]) for i in live) < max_tokens:
        logits = model(mx.array(step)[:, None], cache=cache)[:, -1]
        picks = {}
        for i in sorted(live):
            procs, sampler, keys = rows[i]
            lp = procs.process(logits[i : i + 1], histories[i]) if procs else normalize(logits[i : i + 1])
            picks[i] = mx.argmax(lp, axis=-1) if sampler is None else sampler.sample(lp, keys)
        mx.eval(list(picks.values()))
        for i, tok in picks.items():
            t = tok.item()
            outs[i].append(t)
            histories[i].append(t)
            if rows[i][0]:
                rows[i][0].advance([t])
            step[i] = t
            if t in eos or len(outs[i]) == max_tokens:
                live.discard(i)
                step[i] = filler
    return outs
