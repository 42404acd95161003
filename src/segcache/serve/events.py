"""What the request engine takes and gives: a validated request, and the events of its answer.

    GenRequest                  in: the prompt's ids and every control, no HTTP
    Progress                    out: the prompt's prefill fed another chunk (processed of total)
    Chunk (TokenLogprob)        out: the text a choice produced in one step
    Finish (Usage) / Failure    out: a choice ended / the request failed
    Early                       out: events to send now; the request's generator goes on in
                                the same scheduler step (a choice's last text, before its row
                                leaves and publishes; its Finish follows)

Consumers of a request's events skip what they do not know (a `Progress` above all).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from ..controls import Controls
from ..session.session import Progress

__all__ = ["Chunk", "Early", "Failure", "Finish", "GenRequest", "Progress", "StepFailed", "TokenLogprob", "Usage"]


@dataclass
class GenRequest:
    """A validated request, as the worker needs it (no HTTP in here).

    Attributes:
        id: the response id ("cmpl-..." or "chatcmpl-...").
        ids: prompt token ids, all < the vocabulary size, fewer than the context.
        checkpoints: prompt positions to checkpoint (chat message boundaries).
        max_tokens: tokens to generate at most (>= 1).
        seed: the request's own random stream (None: a fresh secret one); a request
            never draws from a stream another request can touch.
        top_logprobs: alternatives per token; -1 for no logprobs at all.
        n: choices: independent samples of one prompt, prefilled once.
        controls: every sampling control (penalties, logit_bias, XTC, response_format, ...);
            None: the plain fields above (temperature, top_p, top_k, min_p, seed).
        cache_salt: the request's prefix-cache isolation domain (`isolation.domain`; None: shared).
        arrival: time.perf_counter() when the request arrived (for TTFT).
    """

    id: str
    ids: list[int]
    max_tokens: int
    checkpoints: list[int] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stops: list[str] = field(default_factory=list)
    top_logprobs: int = -1
    cache_salt: Optional[str] = None
    n: int = 1
    controls: Optional[Controls] = None
    arrival: float = field(default_factory=time.perf_counter)

    def settings(self) -> Controls:
        """Its sampling controls: `controls`, or the plain fields as Controls."""
        if self.controls is not None:
            return self.controls
        return Controls(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        seed=self.seed)


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Chunk:
    """Text choice `index` produced in one step (may be empty while a stop string is undecided)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0


@dataclass
class Usage:
    """A choice's token counts, and what served it (the `segcache` usage field of responses).

    Attributes:
        tier: where the cached tokens came from ("ram", "disk", "ram+disk", "remote"; "-": none).
        drafter: "plain", "draft", "lookup", "mtp", "dflash" or "lookup+dflash"; drafted / accepted: its draft tokens
            proposed / accepted by the target.
        ttft: seconds from the request's arrival to its first token (server side).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tier: str = "-"
    drafter: str = "plain"
    drafted: int = 0
    accepted: int = 0
    ttft: float = 0.0


@dataclass
class Finish:
    """Choice `index` ended: "stop" (EOS or a stop string) or "length".

    Attributes:
        usage: this choice's completion tokens (the prompt counted once per request).
        index: the choice (0 .. n-1).
        last: the request's last event (every choice ended).
        stop: the stop string that ended the text (None: EOS or length).
    """

    reason: str
    usage: Usage
    index: int = 0
    last: bool = True
    stop: Optional[str] = None


class Early(list):
    """Events the scheduler delivers at once and then advances the request's generator again in
    the same scheduler step, before any other request's: a choice's last text goes out while its
    row leaves (a forward, the publish, keeping it hot), and its `Finish` only after that, so an
    answer ends once its state is where the next turn resumes it."""


@dataclass
class Failure:
    """The worker failed on this request (a bug or an MLX error); others go on."""

    message: str


class StepFailed(RuntimeError):
    """The decoder step this request's row was in failed (every row of it fails: the culprit
    cannot be told apart); the decoder is as before the step."""
