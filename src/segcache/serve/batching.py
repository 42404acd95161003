"""Continuous batching for `segcache serve --decode-concurrency N --prompt-concurrency M`.

    job generators ──next()──> buffer empty? ──> BatchEngine.step(): one BatchDecoder.step
         ^                                       (one forward for every running row)
         └──── tokens of this row ─────────────── per-row buffers

Each request is still a generator the scheduler advances (worker.py is
unchanged but for `begin_step` and "no event yet"): it resumes its prompt from
the prefix store on a private Runtime, feeds the rest one chunk
(`prefill_chunk` tokens) per scheduler step (`Runtime.prefill_steps`: the
store's checkpoints and publish as `Runtime.prefill`), so the running rows
decode between two chunks, then joins the batch as a row and yields one Chunk
per token from its buffer. The first job of a scheduler step whose buffer is
empty runs the batched step for all; a job sends every token its row has in
one Chunk. At most M prompts are being prefilled at once. Closing a job's
generator (finished, or a client gone) removes its row at once and publishes
prompt + completion; closed mid-prefill, it frees its prefill slot and its
Runtime and publishes nothing.

    scheduler step:  [resume B] [decode A]  |  [chunk 1 of B] [decode A]  |  ...
                     | [last chunk of B, publish, join] [decode A, B]
"""

from __future__ import annotations

import collections
import time
from typing import Generator, Iterator

from ..acceptors import make_acceptor
from ..batch.decoder import BatchDecoder, RowState
from ..generation import DRAFT_MIN_PROB, GenerationStats
from ..runtime import Runtime
from ..sampling import make_sampler
from .engine import Chunk, Engine, Finish, GenRequest, Usage, hit_tiers
from .text import StopText


class BatchEngine(Engine):
    """An Engine whose requests share one batched forward per step.

    Args:
        decode_concurrency: rows decoding together at most (the scheduler's max_running).
        prompt_concurrency: prompts being prefilled at once, at most (mlx-lm's meaning).
        Others as `Engine`; a draft model is batched too (a second batch of the
        draft's rows, see batch/decoder.py).

    Attributes:
        prefill_chunk: prompt tokens a joining request feeds per scheduler step at
            most (also bounded by `prefill_step`); the running rows decode between
            two chunks.
    """

    # On the shipped target (2 idle cores, native GDN) prefill ran ~2,950 tok/s
    # for chunks of 128..512 tokens and 1,920 tok/s at 2,048; a decode step of 8
    # rows took ~5 ms. 256 keeps the prefill rate, stalls running rows ~86 ms per
    # chunk, and is the default checkpoint interval, where chunks end anyway.
    prefill_chunk = 256

    def __init__(self, model, tokenizer, *, decode_concurrency: int, prompt_concurrency: int, **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        self.decode_concurrency = decode_concurrency
        self.prompt_concurrency = prompt_concurrency
        drafting = self.prompt_lookup or self.draft_model is not None
        self.mode = "draft" if self.draft_model is not None else "lookup" if self.prompt_lookup else "plain"
        self.decoder = BatchDecoder(model, num_draft_tokens=self.num_draft_tokens if drafting else 0,
                                    draft_model=self.draft_model, prefill_step=self.prefill_step,
                                    draft_min_prob=DRAFT_MIN_PROB if self.draft_model is not None else 0.0)
        self._buffers: dict[str, collections.deque] = {}
        self._prefilling = 0  # prompts being prefilled (at most prompt_concurrency)
        self._stepped = False  # the batched step of this scheduler step has run
        self.decode_steps = 0  # batched steps run (counters for tests and logs)
        self.prefill_chunks = 0  # prompt chunks forwarded

    def begin_step(self) -> None:
        self._stepped = False

    def _step(self) -> None:
        if self._stepped or not len(self.decoder):
            return
        self._stepped = True
        self.decode_steps += 1
        for rid, emitted in self.decoder.step().items():
            self._buffers[rid].extend(emitted)

    def generate(self, req: GenRequest) -> Iterator[object]:
        """Yield None until admitted to the batch, then a Chunk per token and one Finish."""
        rt, cached, tier = yield from self._prefill(req)
        if req.seed is not None:
            import mlx.core as mx

            mx.random.seed(req.seed)
        sampler = make_sampler(req.temperature, top_p=req.top_p if req.top_p < 1.0 else 0.0,
                               top_k=req.top_k, min_p=req.min_p)
        # `cached` is the target's own resume; the draft's runtime (prefilled at join) is not counted.
        self.decoder.add(req.id, rt, req.ids[-1], acceptor=make_acceptor(sampler), max_tokens=req.max_tokens,
                         draft_runtime=self._draft_runtime(req))
        row = self.decoder.rows[req.id]
        self._buffers[req.id] = buffer = collections.deque()
        tok = self.tokenizer
        detok = tok.detokenizer
        eos = tok.eos_token_ids
        stop = StopText(req.stops)
        n, ttft, finish, outcome = 0, 0.0, "length", "cancelled"
        emitted = []
        try:
            while True:
                if not buffer:
                    self._step()
                if not buffer:
                    yield None  # this step's forward ran before this row joined
                    continue
                # Every token this row has (a round may emit several) goes out in one chunk.
                texts, logprobs_out, done = [], [], None
                while buffer and done is None and not stop.stopped:
                    token, logprobs, _ = buffer.popleft()
                    if n == 0:
                        ttft = time.perf_counter() - req.arrival
                    n += 1
                    if token in eos:
                        detok.finalize()
                        done = "stop"
                    else:
                        emitted.append(token)
                        detok.add_token(token)
                        if n == req.max_tokens:
                            detok.finalize()
                            done = "length"
                    texts.append(stop.feed(detok.last_segment))
                    if done is not None:
                        finish = done
                        texts.append(stop.flush())
                    if stop.stopped:
                        finish = "stop"
                    if req.top_logprobs >= 0 and token not in eos:
                        logprobs_out.append(self._logprob(token, logprobs, req.top_logprobs))
                yield Chunk("".join(texts), logprobs_out)
                if stop.stopped or done is not None:
                    break
            outcome = finish
            self._leave(req, emitted)
            yield Finish(finish, Usage(len(req.ids), n, cached), stop.matched)
        finally:
            self._leave(req, emitted)
            self._log(req, n, cached, tier, ttft, self._row_stats(row, n, req.arrival + ttft), outcome)

    def _draft_runtime(self, req: GenRequest) -> Runtime | None:
        """The draft's runtime for a joining row: resumed from the prefix store (its own
        records) and prefilled to the prompt but its last token; None without a draft model
        or a store (the decoder feeds a fresh one)."""
        if self.draft_model is None or self.store is None:
            return None
        drt = Runtime(self.draft_model, store=self.store)
        if len(req.ids) > 1:
            drt.prefill(req.ids[:-1], step_size=self.prefill_step)
        return drt

    def _row_stats(self, row: RowState, n: int, first: float) -> GenerationStats:
        """The log line's figures for a row: tokens per second since its first token, drafts accepted."""
        elapsed = time.perf_counter() - first if n else 0.0
        return GenerationStats(mode=self.mode, generation_tokens=n, generation_time=elapsed, rounds=row.rounds,
                               drafted=row.drafted, accepted=row.accepted)

    def _prefill(self, req: GenRequest) -> Generator[None, None, tuple[Runtime, int, str]]:
        """Resume the prompt (all but its last token) from the store, then feed the rest one
        chunk per scheduler step, yielding between chunks so the running rows decode meanwhile.

        At most `prompt_concurrency` prompts are being prefilled at once; the others wait.
        Returns (as the generator's value) the Runtime, the tokens restored from the store and
        the tiers they came from ("ram", "disk", "ram+disk" or "-", as `Engine`'s log line).
        """
        while self._prefilling >= self.prompt_concurrency:
            yield None  # wait for a prefill slot
        self._prefilling += 1
        steps = None
        try:
            rt = Runtime(self.model, store=self.store, gdn_prefill="auto")  # as Engine: chunked GDN off Metal
            if len(req.ids) == 1:
                return rt, 0, "-"
            steps = rt.prefill_steps(req.ids[:-1], step_size=min(self.prefill_step, self.prefill_chunk),
                                     checkpoints=self._checkpoints(req))
            before = self._stats()
            cached = held = next(steps)  # the resume: what the store held
            tier = hit_tiers(before, self._stats()) if cached else "-"  # one thread: these reads are this resume's
            done = False
            while not done:
                yield None  # another scheduler step: the running rows decode before the next chunk
                try:
                    next(steps)  # one forward (the last one also publishes)
                except StopIteration:
                    done = True
                if rt.offset > held:  # nothing was left to feed after a whole-prompt hit
                    held = rt.offset
                    self.prefill_chunks += 1
            return rt, cached, tier
        finally:
            self._prefilling -= 1
            if steps is not None:
                steps.close()  # cancelled mid-prefill: stop there (a finished one is unaffected)

    def _leave(self, req: GenRequest, emitted: list) -> None:
        """Free the row now; publish prompt + what the client received."""
        if req.id not in self._buffers:
            return
        del self._buffers[req.id]
        try:
            if self.store is not None:
                held = req.ids + emitted
                rt = self.decoder.held(req.id)  # history but the pending token (a lookahead never counts)
                row = rt.tokens
                if len(row) <= len(held) and row == held[: len(row)]:
                    rt.store = self.store
                    if len(row) < len(held):
                        rt.forward(held[len(row) :])
                    rt.publish()
                else:  # the row ran ahead of the client (drafts buffered, not sent): recompute from the store
                    Runtime(self.model, store=self.store).prefill(held, step_size=self.prefill_step)
                self._dirty = True
        finally:
            self.decoder.remove(req.id)
