"""The request engine: every request a row of one decoder, resumed, generated, published, dropped.

    job generators ──next()──> buffer empty? ──> Engine._step(): one decoder step for every row
         ^                                       (one forward, speculative or plain)
         └──── tokens of this row ─────────────── per-row buffers

Each request is a generator the scheduler advances once per scheduler step
(worker.py). It resumes its prompt from the prefix store on a private
Runtime and feeds the rest one chunk per scheduler step (`Runtime.prefill_steps`:
the store's checkpoints and publish as `Runtime.prefill`), so the running rows
decode between two chunks; then it joins the decoder as a row and yields one
`Chunk` per scheduler step with every token its row emitted. The first job of
a scheduler step whose buffer is empty runs the decoder's step for all.

    scheduler step:  [resume B] [decode A]  |  [chunk 1 of B] [decode A]  |  ...
                     | [last chunk of B, publish, join] [decode A, B]

One engine for one row and many: with `decode_concurrency` 1 the decoder holds
the request's Runtime itself (`one_row`: every layer kind mlx-lm has, decode
steps exactly mlx-lm's code path) and prompts are fed in `prefill_step` chunks;
above 1 the rows share a `BatchRuntime` and a cost gate sizes speculative steps.

What a request delivered is what it keeps: a row whose client takes fewer
tokens than a step emitted (a stop string, EOS inside a speculative round)
settles the decoder's round at what it took, and a finished or cancelled row
publishes exactly prompt + delivered tokens, all fed (an end-of-sequence token
only where a step fed it already, a lone row's plain step: the next turn's
prompt rarely holds it, and a state past it would not prefix that prompt). Closed mid-prefill, a request frees its prefill slot and its
Runtime and publishes nothing. Everything here runs on the model thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Generator, Iterator, Optional

import mlx.core as mx

from ..acceptors import make_acceptor
from ..batch.prefill import PrefillBatch
from ..errors import RowError
from ..drafters import DRAFT_MIN_PROB, make_decoder
from ..runtime import Runtime
from ..controls import Controls
from ..grammar import Grammars
from ..stats import GenerationStats
from ..store import Resume
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
        drafter: "plain", "draft", "lookup" or "mtp"; drafted / accepted: its draft tokens
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
class Progress:
    """A prompt's prefill advanced: `processed` of its `total` tokens are held (restored or
    computed). The first one comes once the prompt resumed (processed: the tokens the store
    restored), then one after each prefill forward but the last."""

    processed: int
    total: int


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


@dataclass
class Failure:
    """The worker failed on this request (a bug or an MLX error); others go on."""

    message: str


class StepFailed(RuntimeError):
    """The decoder step this request's row was in failed (every row of it fails: the culprit
    cannot be told apart); the decoder is as before the step."""


class _Choice:
    """One choice of a request: its row's tokens as text (EOS, max_tokens, stop strings), its
    logprobs, its end. Invariant: `buffer` holds only tokens of the decoder's last step."""

    def __init__(self, engine: "Engine", req: GenRequest, index: int, cached: int, tier: str):
        self.engine, self.req, self.index, self.cached, self.tier = engine, req, index, cached, tier
        self.row = req.id if req.n == 1 else (req.id, index)
        self.buffer: collections.deque = collections.deque()
        self.detok = engine.tokenizer.detokenizer
        self.stop = StopText(req.stops)
        self.stats = GenerationStats(mode=engine.decoder.mode, prompt_tokens=len(req.ids))
        self.draft: Optional[Runtime] = None  # its draft runtime, when it has one of its own
        self.n = 0  # tokens taken, an EOS included
        self.ttft = 0.0
        self.finish: Optional[str] = None  # "stop" or "length" once it ended
        self.on_eos = False
        self.outcome = "cancelled"  # unless it ends or fails

    def drain(self) -> list:
        """Every token its row has: a Chunk, and a Finish if it ended (settling the decoder's round
        at what it took). Raises StepFailed if its step failed."""
        engine, req, eos = self.engine, self.req, self.engine.tokenizer.eos_token_ids
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
                done, self.on_eos = "stop", True
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
                logprobs_out.append(engine._logprob(token, logprobs, req.top_logprobs))
            self.finish = done
        events = [Chunk("".join(texts), logprobs_out, self.index)]
        if self.finish is not None:
            if taken < given:  # it ended inside a round: its row keeps what its client got
                self.buffer.clear()
                engine.decoder.settle({self.row: taken})
            self.outcome = self.finish
            usage = Usage(len(req.ids), self.n, self.cached, self.tier, self.stats.mode, self.stats.drafted,
                          self.stats.accepted, self.ttft)
            events.append(Finish(self.finish, usage, self.index,
                                 last=False, stop=self.stop.matched))
        return events


@dataclass
class _Joining:
    """A prompt the prefill batch is feeding (its row there), until `runtime` holds it whole."""

    ids: list
    resume: Resume
    cache: object  # the runtime's PrefixCache, None without a store
    salt: Optional[str]
    snaps: list = field(default_factory=list)  # the store's snapshots at its checkpoints so far
    seconds: float = 0.0  # its share of the forwards that fed it
    runtime: Optional[Runtime] = None  # the prompt, all fed: set when done
    failed: Optional[str] = None  # a forward that fed it failed
    hidden: list = field(default_factory=list)  # with MTP: the target's hidden states of what it fed


class Engine:
    """The models, the store, the decoder and the settings shared by every request.

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
        decode_concurrency: rows decoding together at most (the scheduler's max_running).
        prompt_concurrency: prompts being prefilled at once, at most (mlx-lm's meaning).
        vocab_size: the model's vocabulary (its logits' width; default: the tokenizer's).
        grammars: the model's structured-output compiler, shared with the HTTP side (which
            compiles a request's schema first, so a bad one is a 400); built here when None.
        mtp: the target's `MTPHead` to draft with (exclusive with draft_model and
            prompt_lookup), or None. Prefills keep the hidden states they compute for it.
        kv: mlx-lm's KV quantization (`segcache.kvquant.KVQuantization`) for every
            request's runtimes (target and draft), or None. Batched rows hold
            unquantized KV only, so it needs `decode_concurrency` 1 (mlx_lm.server
            too serves kv_bits one request at a time).
        group: a `segcache.distributed.Channel` when this engine is one rank's of a sharded
            model (`segcache serve` under mlx.launch): every Runtime it builds agrees its
            prefix resumes with the other ranks, and batches draft without the cost gate
            (it times each rank's own steps, so the ranks' widths would differ).

    Attributes:
        prefill_chunk: with several rows, prompt tokens a joining request feeds per
            scheduler step at most (also bounded by `prefill_step`); the running rows
            decode between two chunks.
    """

    # On the shipped target (2 idle cores, native GDN) prefill ran ~2,950 tok/s
    # for chunks of 128..512 tokens and 1,920 tok/s at 2,048; a decode step of 8
    # rows took ~5 ms. 256 keeps the prefill rate, stalls running rows ~86 ms per
    # chunk, and is the default checkpoint interval, where chunks end anyway.
    prefill_chunk = 256

    def __init__(self, model, tokenizer, *, store=None, draft_model=None, prompt_lookup: bool = False,
                 num_draft_tokens: int = 4, prefill_step: int = 2048, checkpoint_interval: int = 256,
                 decode_concurrency: int = 1, prompt_concurrency: int = 8, vocab_size: Optional[int] = None,
                 grammars: Optional[Grammars] = None, kv=None, group=None, mtp=None):
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.draft_model = draft_model
        self.prompt_lookup = prompt_lookup
        self.num_draft_tokens = num_draft_tokens
        self.prefill_step = prefill_step
        self.checkpoint_interval = checkpoint_interval
        if kv is not None and decode_concurrency != 1:
            raise ValueError(f"kv quantization ({kv.describe()}) with decode_concurrency={decode_concurrency}: "
                             "batched rows hold unquantized KV only; decode one row at a time (decode_concurrency 1)")
        self.kv = kv
        self.vocab_size = vocab_size or len(tokenizer.vocab)
        self.grammars = grammars
        self.decode_concurrency = decode_concurrency
        self.group = group
        self.prompt_concurrency = prompt_concurrency
        self.mtp = mtp
        drafting = prompt_lookup or draft_model is not None or mtp is not None
        one = decode_concurrency == 1
        # One row: the speculative width adapts per round, as stream_generate's (the cost gate
        # is for batches, where a wider verify multiplies over rows).
        self.decoder = make_decoder(model, num_draft_tokens=num_draft_tokens if drafting else 0,
                                    draft_model=draft_model, prefill_step=prefill_step,
                                    draft_min_prob=DRAFT_MIN_PROB if draft_model is not None else 0.0,
                                    gate=not one and group is None, one_row=one, mtp=mtp)
        self._buffers: dict[str, collections.deque] = {}
        self._prefilling = 0  # prompts being prefilled (at most prompt_concurrency)
        # Prompts fed together (several rows only): the batch holds exactly the `_joining` entries
        # whose runtime is not ready yet.
        self.prefill_batch = None if one else PrefillBatch(model, gdn_prefill="auto")
        self._joining: dict[str, _Joining] = {}
        self._hidden: dict[str, list] = {}  # with MTP: request id -> its prefill's hidden states
        self._stepped = self._prefilled = False  # the decoder's / prefill batch's step of this scheduler step ran
        self._dirty = False  # published records may still be only in RAM
        self.decode_steps = 0  # decoder steps run (counters for tests and logs)
        self.prefill_chunks = 0  # prompt chunks forwarded

    # -- the model thread's housekeeping -----------------------------------------------

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

    def begin_step(self) -> None:
        self._stepped = self._prefilled = False

    def _step(self) -> None:
        """The decoder's step for every row, once per scheduler step; its tokens go to the buffers."""
        if self._stepped or not len(self.decoder):
            return
        self._stepped = True
        self.decode_steps += 1
        while len(self.decoder):
            try:
                out = self.decoder.step()
                break
            except RowError as exc:  # one row's own rule failed: that row fails, the others step again
                log.error("%s: its sampling failed (%s); the other rows go on", exc.row_id, exc)
                self._buffers[exc.row_id].append(StepFailed(str(exc)))
                self.decoder.remove(exc.row_id)
            except Exception as exc:  # the culprit cannot be told apart: every row of the step fails
                log.exception("a decode step of %d row(s) failed; failing each of them", len(self.decoder))
                for rid in self.decoder.rows:
                    self._buffers[rid].append(StepFailed(f"{type(exc).__name__}: {exc}"))
                return
        else:
            return
        for rid, emitted in out.items():
            self._buffers[rid].extend(emitted)

    # -- one request --------------------------------------------------------------------

    def generate(self, req: GenRequest) -> Iterator[object]:
        """Yield None until admitted to the decoder, then per scheduler step the events of its
        choices: a `Chunk` each (what its row emitted) and a `Finish` for one that ended (the
        request's last one marked `last`).

        The prompt is resumed and prefilled once; each of the `n` choices is a row of its own on
        a copy-on-write clone of it (with several rows all at once, else one after another), with
        its own random stream (`Keys.spawn`) and processors. A choice leaves before its last chunk
        goes out. Closing the generator cancels the request: its rows leave and each publishes
        prompt + what its client received.
        """
        try:
            rt, cached, tier = yield from self._prefill(req)
        finally:
            hidden = self._hidden.pop(req.id, None)
        controls = req.settings()
        sampler = controls.sampler(self.tokenizer)
        processors = controls.processors(self.vocab_size, self._grammars(controls)) or None
        keys = controls.keys()
        drt = self._draft_runtime(req) if self.mtp is None else self._hidden_states(req, hidden)
        waiting = list(range(req.n))
        running: list[_Choice] = []
        try:
            while waiting or running:
                while waiting and not (running and self.decoder.one_row):  # one row: one choice at a time
                    i = waiting.pop(0)
                    last = not waiting  # the last choice takes the prefilled runtimes themselves
                    choice = _Choice(self, req, i, cached, tier)
                    choice.draft = drt if last or drt is None else drt.clone()
                    self.decoder.add(choice.row, rt if last else rt.clone(), req.ids[-1],
                                     acceptor=make_acceptor(sampler, keys.spawn(i)), max_tokens=req.max_tokens,
                                     draft_runtime=choice.draft, stats=choice.stats,
                                     processors=processors if last or processors is None else processors.fork(),
                                     stop_tokens=self.tokenizer.eos_token_ids)
                    self._buffers[choice.row] = choice.buffer
                    running.append(choice)
                if not any(c.buffer for c in running):
                    self._step()
                if not any(c.buffer for c in running):
                    yield None  # this scheduler step's decoder step ran before these rows joined
                    continue
                events = []
                for choice in [c for c in running if c.buffer]:
                    events += choice.drain()
                    if choice.finish is not None:  # it ended: it leaves before its last chunk goes out
                        running.remove(choice)
                        self._leave(choice, publish=True)
                if not waiting and not running:
                    events[-1].last = True
                yield events
        finally:
            for choice in running:  # cancelled, or a step failed
                self._leave(choice, publish=choice.outcome != "failed")

    def _draft_runtime(self, req: GenRequest) -> Runtime | None:
        """The draft's runtime for a joining row: resumed from the prefix store (its own
        records) and prefilled to the prompt but its last token; None without a draft model
        or a store (the decoder feeds a fresh one; with `kv`, a fresh one quantizing as the target's)."""
        if self.draft_model is None or (self.store is None and self.kv is None):
            return None
        drt = Runtime(self.draft_model, store=self.store, cache_salt=req.cache_salt, gdn_prefill="auto",
                      group=self.group, **self._kv_options())
        if self.store is not None and len(req.ids) > 1:
            drt.prefill(req.ids[:-1], step_size=self.prefill_step)
        return drt

    def _hidden_states(self, req: GenRequest, hidden: Optional[list]):
        """The MTP row's `HiddenStates`: what the prompt's forwards computed (the last positions;
        a prefix restored from the store has none, and the drafter computes it)."""
        from ..mtp import HiddenStates

        if not hidden:
            return None
        states = mx.concatenate(hidden, axis=0)
        return HiddenStates(states) if states.shape[0] <= len(req.ids) - 1 else None

    @contextlib.contextmanager
    def _collect(self, into: Optional[list]):
        """With MTP, keep the hidden states of the target's forwards run in the block (row 0)."""
        if into is None:
            yield
            return
        with self.decoder.drafter.tap.collecting() as chunks:
            try:
                yield
            finally:  # the prefill's last forward ends its generator (StopIteration)
                into.extend(c[0] for c in chunks)

    def _kv_options(self) -> dict:
        """A request runtime's KV quantization (as mlx-lm's generate_step: after each forward)."""
        q = self.kv
        return {} if q is None else dict(kv_bits=q.bits, kv_group_size=q.group_size, quantized_kv_start=q.start)

    def _prefill(self, req: GenRequest) -> Generator[Optional[Progress], None, tuple[Runtime, int, str]]:
        """Resume the prompt (all but its last token) from the store, then feed the rest, yielding
        between forwards so the running rows decode meanwhile.

        With several rows, the rest goes through the engine's `PrefillBatch`: every prompt being
        prefilled advances in one forward per scheduler step. A prompt the store mostly restored
        is fed alone instead (copying its prefix into the batch would cost more than its rest),
        one chunk per scheduler step, as is a lone row's (in `prefill_step` chunks, no yield).
        At most `prompt_concurrency` prompts are being prefilled at once; the others wait.
        Returns (as the generator's value) the Runtime, the tokens restored from the store and
        the tiers they came from ("ram", "disk", "ram+disk", "remote" or "-").
        """
        while self._prefilling >= self.prompt_concurrency:
            yield None  # wait for a prefill slot
        self._prefilling += 1
        steps = None
        try:
            rt = Runtime(self.model, store=self.store, cache_salt=req.cache_salt, gdn_prefill="auto",
                         group=self.group, **self._kv_options())
            if len(req.ids) == 1:
                return rt, 0, "-"
            ids = req.ids[:-1]
            one = self.decoder.one_row
            chunk = self.prefill_step if one else min(self.prefill_step, self.prefill_chunk)
            steps = rt.prefill_steps(ids, step_size=chunk, checkpoints=self._checkpoints(req))
            resume = next(steps)  # where the prompt resumed from: this request's own answer
            left = len(ids) - resume.tokens
            news = Progress(resume.tokens, len(ids))  # at the next pause: what the store restored
            hidden = self._hidden[req.id] = [] if self.mtp is not None else None
            if one or not left or resume.tokens > left:
                while True:
                    if news is not None or not one:
                        yield news  # several rows: another scheduler step, the running rows decode meanwhile
                        news = None
                    try:
                        with self._collect(hidden):
                            held = next(steps)  # one forward (the last one also publishes)
                    except StopIteration:
                        break
                    self.prefill_chunks += 1
                    news = Progress(held, len(ids))
                return rt, resume.restored, resume.tier
            steps.close()  # resumed; the batch feeds the rest (and this publishes nothing)
            stops = [p for p in (*resume.stops, *self._checkpoints(req)) if resume.tokens < p < len(ids)]
            joining = self._joining[req.id] = _Joining(ids, resume, rt.prefix_cache() if self.store else None,
                                                       req.cache_salt)
            self.prefill_batch.add(req.id, rt, ids, stops)
            held = resume.tokens
            while joining.runtime is None:
                yield news  # the batch's forward for this scheduler step runs once, for every prompt
                self._prefill_step()
                row = self.prefill_batch.prompts.get(req.id)
                now = row.pos if row is not None else held
                news, held = (Progress(now, len(ids)) if now != held else None), now
                if joining.failed is not None:
                    raise StepFailed(joining.failed)
            if hidden is not None:
                hidden.extend(joining.hidden)
            return joining.runtime, resume.restored, resume.tier
        finally:
            self._prefilling -= 1
            if steps is not None:
                steps.close()  # cancelled mid-prefill: stop there (a finished one is unaffected)
            if self._joining.pop(req.id, None) is not None and req.id in self.prefill_batch.prompts:
                self.prefill_batch.remove(req.id)  # cancelled mid-prefill: its row leaves, nothing published

    def _prefill_step(self) -> None:
        """One forward of the prefill batch per scheduler step: at most `prefill_chunk` tokens
        while rows decode (their stall stays one chunk), else up to `prefill_step`; snapshots
        at each prompt's checkpoints, and a finished prompt published as `Runtime.prefill` does."""
        batch = self.prefill_batch
        if self._prefilled or not len(batch):
            return
        self._prefilled = True
        rows = len(batch)
        tic = time.perf_counter()
        try:
            ids = batch.batch.ids
            with self._collect(None if self.mtp is None else []):
                reached = batch.step(self.prefill_chunk if len(self.decoder) else self.prefill_step)
                if self.mtp is not None:  # each prompt's row of the forward's hidden states
                    fed = self.decoder.drafter.tap.chunks[-1]
                    for i, rid in enumerate(ids):  # its real positions: a shorter row's pads are not its
                        self._joining[rid].hidden.append(fed[i, : batch.fed[rid]])
        except Exception as exc:  # every prompt of the forward fails; the batch is dropped whole
            log.exception("a prefill forward of %d prompt(s) failed; failing each of them", rows)
            for rid in list(batch.prompts):
                self._joining[rid].failed = f"{type(exc).__name__}: {exc}"
                batch.remove(rid)
            return
        self.prefill_chunks += 1
        share = (time.perf_counter() - tic) / rows
        for joining in self._joining.values():
            joining.seconds += share
        for r in reached:
            joining = self._joining[r.row_id]
            r.runtime.store, r.runtime.cache_salt = self.store, joining.salt
            if joining.cache is not None:
                joining.snaps.append(joining.cache.snapshot(r.runtime, r.logits))
            if r.done:
                if joining.cache is not None:
                    joining.cache.prefilled(r.runtime, joining.ids, joining.resume, joining.snaps, joining.seconds)
                joining.runtime = r.runtime

    def _leave(self, choice: _Choice, publish: bool) -> None:
        """Free the choice's row now; publish prompt + what its client received (an EOS only where
        a step fed it already); log its line."""
        req = choice.req
        if self._buffers.pop(choice.row, None) is None:
            return
        try:
            if choice.row not in self.decoder.rows:  # its step failed it out already
                return
            if not publish or self.store is None:
                self.decoder.remove(choice.row)
                return
            rt = self.decoder.release(choice.row, pending=not choice.on_eos)  # the row has left
            rt.store, rt.cache_salt = self.store, req.cache_salt  # a batch row's copy has neither
            rt.publish()
            if self.decoder.one_row and isinstance(choice.draft, Runtime):
                choice.draft.publish()  # its draft runtime itself was the draft row: the next turn resumes it
            self._dirty = True
        finally:
            self._log(choice)

    # -- helpers ----------------------------------------------------------------------

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

    def _grammars(self, controls: Controls):
        """The model's grammar compiler, built on the first structured request."""
        fmt = controls.response_format
        if fmt is None or fmt.get("type") == "text":
            return None
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab_size)
        return self.grammars

    def _log(self, choice: _Choice) -> None:
        req, stats, n = choice.req, choice.stats, choice.n
        stats.generation_tokens = n
        stats.generation_time = time.perf_counter() - (req.arrival + choice.ttft) if n else 0.0
        gen = f"{stats.generation_tps:.1f} tok/s" if n else "-"
        acc = ""
        if stats.mode != "plain" and stats.drafted:
            drafting = sum(1 for d in stats.drafted_per_round if d)
            acc = (f", {stats.mode} accepted {stats.acceptance_rate:.0%} "
                   f"({stats.accepted / drafting:.2f}/round)")
        rid = req.id if req.n == 1 else f"{req.id}[{choice.index}]"
        log.info("%s: prompt %d tok, cached %d (%s), generated %d tok, ttft %.3f s, %s%s, %s",
                 rid, len(req.ids), choice.cached, choice.tier, n, choice.ttft, gen, acc, choice.outcome)
