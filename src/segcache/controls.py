"""A request's sampling controls: mlx_lm.server's fields and defaults, checked, built.

    Controls(fields...) ──check(vocab)──> ParamError naming the field, or fine
                        ──sampler(tokenizer)──> Sampler | None (greedy)
                        ──processors(vocab, grammars)──> the row's Processors
                        ──keys()──> the request's own random stream

The defaults are mlx_lm.server's for a request that leaves a field out
(temperature, top_p, top_k and min_p default to the server's command line,
which the caller passes in). A penalty of 0 is off, as in mlx-lm; a context
size of 0 is the whole history, as mlx-lm's `tokens[-0:]` makes it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Optional

from .errors import ParamError
from .processors import CONTEXT_SIZE, Processors, make_processors
from .sampling import XTC_THRESHOLD, Keys, Sampler, make_sampler


@dataclass(frozen=True)
class Controls:
    """The sampling and output controls of one request (every field mlx_lm.server takes,
    plus `response_format`).

    Attributes:
        temperature, top_p, top_k, min_p: the sampler (temperature 0 = greedy,
            and then the filters do nothing, as in mlx-lm).
        xtc_probability, xtc_threshold: XTC (0 = off).
        logit_bias: token id -> amount added to its logit (JSON's string keys accepted).
        repetition_penalty, presence_penalty, frequency_penalty: 0 = off.
        *_context_size: tokens of history each penalty reads (0 = all).
        seed: the request's random stream (None = a fresh one).
        response_format: OpenAI's response_format (json_object / json_schema).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = XTC_THRESHOLD
    logit_bias: Optional[dict] = None
    repetition_penalty: float = 0.0
    repetition_context_size: int = CONTEXT_SIZE
    presence_penalty: float = 0.0
    presence_context_size: int = CONTEXT_SIZE
    frequency_penalty: float = 0.0
    frequency_context_size: int = CONTEXT_SIZE
    seed: Optional[int] = None
    response_format: Optional[dict] = None

    def check(self, vocab_size: int) -> None:
        """Raise `ParamError` naming the first field segcache cannot honour."""
        for name, lo, hi in (("temperature", 0, math.inf), ("top_p", 0, 1), ("min_p", 0, 1),
                             ("xtc_probability", 0, 1), ("xtc_threshold", 0, 0.5),
                             ("repetition_penalty", 0, math.inf),
                             ("presence_penalty", -math.inf, math.inf), ("frequency_penalty", -math.inf, math.inf)):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not lo <= value <= hi:
                rng = f"in [{lo}, {hi}]" if hi != math.inf else (f">= {lo}" if lo != -math.inf else "finite")
                raise ParamError(name, f"'{name}' must be a number {rng}, got {value!r}")
            if not math.isfinite(value):
                raise ParamError(name, f"'{name}' must be finite, got {value!r}")
        for name in ("top_k", "repetition_context_size", "presence_context_size", "frequency_context_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ParamError(name, f"'{name}' must be an integer >= 0, got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ParamError("seed", f"'seed' must be an integer, got {self.seed!r}")
        bias = self.bias()
        bad = [t for t in bias if not 0 <= t < vocab_size]
        if bad:
            raise ParamError("logit_bias", f"'logit_bias' names token ids outside the vocabulary "
                             f"[0, {vocab_size}): {bad[:5]}")

    def bias(self) -> dict:
        """logit_bias as {int: float} (JSON object keys are strings)."""
        if self.logit_bias is None:
            return {}
        if not isinstance(self.logit_bias, dict):
            raise ParamError("logit_bias", "'logit_bias' must be an object of token id -> number")
        out = {}
        for k, v in self.logit_bias.items():
            try:
                key = int(k)
                value = float(v)
            except (TypeError, ValueError):
                raise ParamError("logit_bias", f"'logit_bias' maps token ids to numbers; got {k!r}: {v!r}") from None
            if isinstance(v, bool) or not math.isfinite(value):
                raise ParamError("logit_bias", f"'logit_bias' amounts are finite numbers; got {k!r}: {v!r}")
            out[key] = value
        return out

    def sampler(self, tokenizer) -> Optional[Sampler]:
        """The request's `Sampler` (None = greedy), XTC sparing what mlx_lm.server spares:
        the encoding of "\\n" and the EOS tokens."""
        special = ()
        if self.xtc_probability > 0:
            special = list(tokenizer.encode("\n")) + list(tokenizer.eos_token_ids)
        return make_sampler(self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                            xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold,
                            xtc_special_tokens=special)

    def processors(self, vocab_size: int, grammars=None) -> Processors:
        """The row's `Processors` (penalties, bias, and the response_format's grammar).

        Args:
            grammars: the model's `segcache.grammar.Grammars` (needed only with a
                structured response_format).
        """
        grammar = None
        if self.response_format is not None and self.response_format.get("type") != "text":
            if grammars is None:
                raise ParamError("response_format", "structured output is not available on this server")
            grammar = grammars.compile(self.response_format)
        return make_processors(
            vocab_size=vocab_size, logit_bias=self.bias(),
            repetition_penalty=self.repetition_penalty, repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty, presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty, frequency_context_size=self.frequency_context_size,
            grammar=grammar)

    def keys(self) -> Keys:
        """The request's random stream (n choices: `keys().spawn(i)` for choice i,
        from one `keys()` so that they differ when no seed is given)."""
        return Keys(self.seed)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
