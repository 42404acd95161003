"""One request's generation: a private store-backed Runtime, resumed, generated, published, dropped.

    Runtime(model, store) ── stream_generate(ids, runtime=rt, prefill_checkpoints=boundaries)
        prefill: resume the longest cached prefix (RAM or disk, copy-on-write),
                 compute the rest, checkpoint the boundaries and the prompt's end
        decode:  plain, draft model or prompt lookup (token-identical greedy)
        close:   publish prompt + completion (stream_generate does it on close)

`Engine.generate` is a generator the scheduler advances one token per step, so
the one model thread can interleave requests (and batch them, later) between
steps. Everything here runs on that thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx

from ..generation import stream_generate
from ..runtime import Runtime
from ..sampling import make_sampler
from .text import StopText

log = logging.getLogger("segcache.serve")


@dataclass
class GenRequest:
    """A validated request, as the worker needs it (no HTTP in here).

    Attributes:
        id: the response id ("cmpl-..." or "chatcmpl-...").
        ids: prompt token ids, all < the vocabulary size, fewer than the context.
        checkpoints: prompt positions to checkpoint (chat message boundaries).
        max_tokens: tokens to generate at most (>= 1).
        top_logprobs: alternatives per token; -1 for no logprobs at all.
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
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Chunk:
    """Text produced by one step (may be empty while a stop string is undecided)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Finish:
    """The request's end: "stop" (EOS or a stop string) or "length"."""

    reason: str
    usage: Usage


@dataclass
class Failure:
    """The worker failed on this request (a bug or an MLX error); others go on."""

    message: str


def hit_tiers(before: dict, after: dict) -> str:
    ram = after["ram_reads"] - before["ram_reads"]
    disk = after["disk_reads"] - before["disk_reads"]
    return "+".join(t for t, n in (("ram", ram), ("disk", disk)) if n) or "-"


class Engine:
    """The models, the store and the generation settings shared by every request.

    Args:
        model, tokenizer: the target and its mlx-lm TokenizerWrapper.
        store: a `PrefixStore`, or None to serve without a prefix cache.
        draft_model: a draft sharing the tokenizer, or None.
        prompt_lookup: draft by n-gram lookup instead (exclusive with draft_model).
        num_draft_tokens: drafts per round, at most.
        prefill_step: prompt tokens per prefill forward.
        checkpoint_interval: also checkpoint every this many prompt tokens (0: never),
            so a later prompt sharing only part of this one (another session on the
            same long context) resumes within that many tokens of where they part.
        kv: mlx-lm's KV quantization (`segcache.kvquant.KVQuantization`) for every
            request's runtimes, or None.
    """

    def __init__(self, model, tokenizer, *, store=None, draft_model=None, prompt_lookup: bool = False,
                 num_draft_tokens: int = 4, prefill_step: int = 2048, checkpoint_interval: int = 256, kv=None):
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.draft_model = draft_model
        self.prompt_lookup = prompt_lookup
        self.num_draft_tokens = num_draft_tokens
        self.prefill_step = prefill_step
        self.checkpoint_interval = checkpoint_interval
        self.kv = kv
        self._dirty = False  # published records may still be only in RAM

    def _stats(self) -> dict:
        keys = ("hit_tokens", "ram_reads", "disk_reads")
        if self.store is None or self.store.closed:
            return dict.fromkeys(keys, 0)
        st = self.store.stats()
        return {k: st[k] for k in keys}

    def warm_up(self) -> None:
        """Run each model once on a few tokens, so the first request does not pay for MLX's first calls."""
        ids = list(self.tokenizer.encode("def warm_up(self):\n    return None\n"))[:16] or [0]
        for model in filter(None, (self.model, self.draft_model)):
            rt = Runtime(model, gdn_prefill="auto")  # no store: nothing of this reaches the prefix cache
            mx.eval(rt.forward(ids))
            mx.eval(rt.forward(ids[:1]))

    def flush(self) -> None:
        """Write published records to disk, so a crash after this loses none of them."""
        if self._dirty and self.store is not None and not self.store.closed:
            try:
                self.store.flush()
            except Exception as exc:  # a cache that cannot be written is not worth failing requests
                log.warning("prefix store flush failed: %s", exc)
            self._dirty = False

    def generate(self, req: GenRequest) -> Iterator[object]:
        """Yield a `Chunk` per generated token, then one `Finish`. Closing it early cancels
        the request: the runtime is settled and prompt + emitted tokens are published."""
        tok = self.tokenizer
        if req.seed is not None:
            mx.random.seed(req.seed)
        sampler = make_sampler(req.temperature, top_p=req.top_p if req.top_p < 1.0 else 0.0,
                               top_k=req.top_k, min_p=req.min_p)
        rt = Runtime(self.model, store=self.store, gdn_prefill="auto")
        draft_rt = None
        if self.draft_model is not None:
            draft_rt = Runtime(self.draft_model, store=self.store, gdn_prefill="auto")
            if self.store is not None and len(req.ids) > 1:
                draft_rt.prefill(req.ids[:-1], step_size=self.prefill_step)  # its own records, same store
        before = self._stats()
        responses = stream_generate(
            self.model, tok, req.ids, runtime=rt, draft_runtime=draft_rt,
            draft_model=self.draft_model, prompt_lookup=self.prompt_lookup,
            num_draft_tokens=self.num_draft_tokens, max_tokens=req.max_tokens, sampler=sampler,
            prefill_step_size=self.prefill_step, prefill_checkpoints=self._checkpoints(req),
            **({} if self.kv is None else dict(kv_bits=self.kv.bits, kv_group_size=self.kv.group_size,
                                                quantized_kv_start=self.kv.start)),
        )
        stop = StopText(req.stops)
        eos = tok.eos_token_ids
        n = cached = 0
        ttft = 0.0
        tier = "-"
        finish = "length"
        stats = None
        outcome = "cancelled"  # unless it ends or fails
        try:
            for r in responses:
                if n == 0:
                    ttft = time.perf_counter() - req.arrival
                    after = self._stats()
                    cached = after["hit_tokens"] - before["hit_tokens"]
                    tier = hit_tiers(before, after) if cached else "-"
                n += 1
                stats = r.stats
                text = stop.feed(r.text)
                if r.finish_reason is not None:
                    finish = r.finish_reason
                    text += stop.flush()
                if stop.stopped:
                    finish = "stop"
                logprobs = []
                if req.top_logprobs >= 0 and r.token not in eos:
                    logprobs.append(self._logprob(r.token, r.logprobs, req.top_logprobs))
                yield Chunk(text, logprobs)
                if stop.stopped or r.finish_reason is not None:
                    break
            responses.close()  # publishes prompt + completion before the answer ends
            outcome = finish
            if draft_rt is not None and self.store is not None:
                draft_rt.publish()
            self._dirty = self.store is not None
            yield Finish(finish, Usage(len(req.ids), n, cached))
        except Exception:
            outcome = "failed"
            raise
        finally:
            responses.close()
            self._dirty = self._dirty or self.store is not None
            self._log(req, n, cached, tier, ttft, stats, outcome)

    def _checkpoints(self, req: GenRequest) -> list[int]:
        """The request's own boundaries, plus every `checkpoint_interval` tokens of its prompt."""
        every = self.checkpoint_interval
        grid = range(every, len(req.ids) - 1, every) if every > 0 else ()
        return sorted(set(req.checkpoints).union(grid))

    def _logprob(self, token: int, logprobs: mx.array, top: int) -> TokenLogprob:
        decode = self.tokenizer.decode
        alts = []
        if top > 0:
            idx = mx.argpartition(-logprobs, kth=top - 1)[:top]
            vals = logprobs[idx]
            order = mx.argsort(-vals)
            alts = [(decode([i]), v) for i, v in zip(idx[order].tolist(), vals[order].tolist())]
        return TokenLogprob(decode([token]), logprobs[token].item(), alts)

    def _log(self, req, n, cached, tier, ttft, stats, outcome) -> None:
        gen = f"{stats.generation_tps:.1f} tok/s" if stats is not None else "-"
        acc = ""
        if stats is not None and stats.mode != "plain":
            acc = f", {stats.mode} accepted {stats.acceptance_rate:.0%} ({stats.mean_accepted:.2f}/round)"
        log.info("%s: prompt %d tok, cached %d (%s), generated %d tok, ttft %.3f s, %s%s, %s",
                 req.id, len(req.ids), cached, tier, n, ttft, gen, acc, outcome)
