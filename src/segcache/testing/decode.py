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
