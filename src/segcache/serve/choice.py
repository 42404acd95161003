"""One choice of a request: its row's tokens as text, logprobs and an end, and its log line.

A step's tokens for the row wait in `buffer`; `drain` turns them into a `Chunk`
(and a `Finish` when the choice ends: its EOS, `max_tokens`, a stop string).
A choice that ends inside a step's tokens settles its row at what it took, so
its row keeps exactly what its client received (`Session.settle`).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Optional

import mlx.core as mx

from ..stats import GenerationStats
from .events import Chunk, Finish, GenRequest, StepFailed, TokenLogprob, Usage
from .text import StopText

log = logging.getLogger("segcache.serve")


class Choice:
    """Choice `index` of `req`, the row `row` of `session`, resumed `cached` tokens from `tier`.

    Invariant: `buffer` holds only tokens of the decoder's last step (or its `StepFailed`).
    """

    def __init__(self, session, tokenizer, req: GenRequest, index: int, mode: str):
        self.session, self.tokenizer, self.req, self.index = session, tokenizer, req, index
        self.cached, self.tier = session.restored, session.tier
        self.row = req.id if req.n == 1 else (req.id, index)
        self.buffer: collections.deque = collections.deque()
        self.detok = tokenizer.detokenizer
        self.stop = StopText(req.stops)
        self.stats = GenerationStats(mode=mode, prompt_tokens=len(req.ids))
        self.n = 0  # tokens taken, an EOS included
        self.ttft = 0.0
        self.finish: Optional[str] = None  # "stop" or "length" once it ended
        self.outcome = "cancelled"  # unless it ends or fails

    def drain(self) -> list:
        """Every token its row has: a Chunk, and a Finish if it ended (settling the decoder's round
        at what it took). Raises StepFailed if its step failed."""
        req, eos = self.req, self.tokenizer.eos_token_ids
        texts, logprobs_out, taken, given = [], [], 0, len(self.buffer)
        while self.buffer and self.finish is None:
            item = self.buffer.popleft()
            if isinstance(item, StepFailed):
                self.outcome = "failed"
                raise item
            token, logprobs, _ = item
            taken += 1
            if self.n == 0:
                self.ttft = time.perf_counter() - req.arrival
            self.n += 1
            done = None
            if token in eos:
                self.detok.finalize()
                done = "stop"
            else:
                self.detok.add_token(token)
                if self.n == req.max_tokens:
                    self.detok.finalize()
                    done = "length"
            texts.append(self.stop.feed(self.detok.last_segment))
            if done is not None:
                texts.append(self.stop.flush())
            if self.stop.stopped:
                done = "stop"
            if req.top_logprobs >= 0 and token not in eos:
                logprobs_out.append(token_logprob(self.tokenizer, token, logprobs, req.top_logprobs))
            self.finish = done
        events = [Chunk("".join(texts), logprobs_out, self.index)]
        if self.finish is not None:
            if taken < given:  # it ended inside a round: its row keeps what its client got
                self.buffer.clear()
                self.session.settle(self.row, taken)
            self.outcome = self.finish
            usage = Usage(len(req.ids), self.n, self.cached, self.tier, self.stats.mode, self.stats.drafted,
                          self.stats.accepted, self.ttft)
            events.append(Finish(self.finish, usage, self.index,
                                 last=False, stop=self.stop.matched))
        return events

    def log(self) -> None:
        """Its line in the server's log: prompt, cache, tokens, speed, speculation, outcome."""
        req, stats, n = self.req, self.stats, self.n
        stats.generation_tokens = n
        stats.generation_time = time.perf_counter() - (req.arrival + self.ttft) if n else 0.0
        gen = f"{stats.generation_tps:.1f} tok/s" if n else "-"
        acc = ""
        if stats.mode != "plain" and stats.drafted:
            drafting = sum(1 for d in stats.drafted_per_round if d)
            acc = (f", {stats.mode} accepted {stats.acceptance_rate:.0%} "
                   f"({stats.accepted / drafting:.2f}/round)")
        elif stats.mode != "plain":  # the cost gate (or the drafter's offer) chose plain steps throughout
            acc = f", {stats.mode} drafted nothing"
        rid = req.id if req.n == 1 else f"{req.id}[{self.index}]"
        log.info("%s: prompt %d tok, cached %d (%s), generated %d tok, ttft %.3f s, %s%s, %s",
                 rid, len(req.ids), self.cached, self.tier, n, self.ttft, gen, acc, self.outcome)


def token_logprob(tokenizer, token: int, logprobs: mx.array, top: int) -> TokenLogprob:
    """The token's log probability as text, with its `top` most likely alternatives."""
    decode = tokenizer.decode
    alts = []
    if top > 0:
        idx = mx.argpartition(-logprobs, kth=top - 1)[:top]
        vals = logprobs[idx]
        order = mx.argsort(-vals)
        alts = [(decode([i]), v) for i, v in zip(idx[order].tolist(), vals[order].tolist())]
    return TokenLogprob(decode([token]), logprobs[token].item(), alts)
