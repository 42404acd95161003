"""The request engine: the models, one decoder, one `Session` per request, and the step.

    job generators ──next()──> buffer empty? ──> Engine._step(): one decoder step for every row
         ^                                       (one forward, speculative or plain)
         └──── tokens of this row ─────────────── per-row buffers

Each request is a generator the scheduler advances once per scheduler step (worker.py). Its
`Session` (segcache/session/) resumes the prompt on a private Runtime (a clone of its conversation's
hot runtime, serve/hot.py, or from the prefix store) and feeds the rest one chunk per scheduler step
(a `Progress` event after each), so the running rows decode between two chunks; the prompt is
published when its prefill ends. Then each choice joins the decoder as a row and yields one `Chunk`
per scheduler step with every token its row emitted. The first job of a scheduler step whose buffer
is empty runs the decoder's step for all.

    scheduler step:  [resume B] [decode A]  |  [chunk 1 of B] [decode A]  |  ...
                     | [last chunk of B, publish, join] [decode A, B]

One engine for one row and many: with `decode_concurrency` 1 the decoder holds
the request's Runtime itself (`one_row`: every layer kind mlx-lm has, decode
steps exactly mlx-lm's code path) and prompts are fed in `prefill_step` chunks;
above 1 the rows share a `BatchRuntime`, prompts joining together share a
`PrefillBatch`'s forwards, and a cost gate sizes speculative steps.

What a request delivered is what it keeps: a choice whose client takes fewer tokens than a step
emitted (a stop string, EOS inside a speculative round) settles its row at what it took, and a
finished or cancelled row publishes exactly prompt + delivered tokens, its EOS included, all fed
(the session's one end-of-sequence rule); one that ended well is kept hot. Closed mid-prefill, a
request frees its prefill slot and its Runtime and publishes nothing more. Everything here runs on
the model thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import Generator, Iterator, Optional

import mlx.core as mx

from ..acceptors import make_acceptor
from ..batch.gate import DRAFT_MIN_PROB
from ..batch.prefill import PrefillBatch
from ..controls import Controls
from ..drafters import make_decoder
from ..errors import RowError
from ..grammar import Grammars
from ..ranks import agreement
from ..runtime import Runtime
from ..session.hidden import collecting
from ..session.session import Session, prompt_checkpoints
from .choice import Choice
from .fanout import Fanout
from .events import Chunk, Early, Failure, Finish, GenRequest, Progress, StepFailed, TokenLogprob, Usage
from .hot import HotRuntimes

__all__ = ["Chunk", "Early", "Engine", "Failure", "Finish", "GenRequest", "Progress", "StepFailed", "TokenLogprob", "Usage"]

log = logging.getLogger("segcache.serve")


class Engine:
    """The models, the store, the decoder and the settings shared by every request.

    Args:
        model, tokenizer: the target and its mlx-lm TokenizerWrapper.
        store: a `PrefixStore`, or None to serve without a prefix cache.
        draft_model: a draft sharing the tokenizer, or None.
        prompt_lookup: draft by n-gram lookup instead (exclusive with draft_model), or beside dflash.
        num_draft_tokens: drafts per round, at most. draft_tree: a lone row's tree budget (docs/tree.md).
        prefill_step: prompt tokens per prefill forward.
        checkpoint_interval: also checkpoint every this many prompt tokens (0: never), so a later
            prompt sharing only part of this one resumes within that many tokens of where they part.
        decode_concurrency: rows decoding together at most (the scheduler's max_running).
        prompt_concurrency: prompts being prefilled at once, at most (mlx-lm's meaning).
        vocab_size: the model's vocabulary (its logits' width; default: the tokenizer's).
        grammars: the model's structured-output compiler, shared with the HTTP side (which
            compiles a request's schema first, so a bad one is a 400); built here when None.
        mtp, dflash: the target's `MTPHead`, or a DFlash `Drafter`, to draft with (exclusive) or None.
        kv: mlx-lm's KV quantization (`segcache.kvquant.KVQuantization`) for every request's
            runtimes (target and draft), or None. Batched rows hold unquantized KV only, so it
            needs `decode_concurrency` 1 (mlx_lm.server too serves kv_bits one at a time).
        group: a `segcache.distributed.Channel` when this engine is one rank's of a sharded model
            (`segcache serve` under mlx.launch): every Runtime it builds agrees its prefix resumes
            with the other ranks, and batches draft without the cost gate (it times each rank's own
            steps, so the ranks' widths would differ); no prompt waits for another's (fanout.py).
        hot: the recent conversations' runtimes a next turn continues from (serve/hot.py); None: none.
        whole_prompt: every request's Session is `whole` (session.py): a prompt the store holds whole
            runs no forward before its first token, and each prompt's end is published with its logits.

    Attributes:
        prefill_chunk: with several rows, prompt tokens a joining request feeds per scheduler
            step at most (also bounded by `prefill_step`); the running rows decode between two.
    """

    # On the shipped target (2 idle cores, native GDN) prefill ran ~2,950 tok/s
    # for chunks of 128..512 tokens and 1,920 tok/s at 2,048; a decode step of 8
    # rows took ~5 ms. 256 keeps the prefill rate, stalls running rows ~86 ms per
    # chunk, and is the default checkpoint interval, where chunks end anyway.
    prefill_chunk = 256

    def __init__(self, model, tokenizer, *, store=None, draft_model=None, prompt_lookup: bool = False,
                 num_draft_tokens: int = 4, prefill_step: int = 2048, checkpoint_interval: int = 256,
                 decode_concurrency: int = 1, prompt_concurrency: int = 8, vocab_size: Optional[int] = None,
                 grammars: Optional[Grammars] = None, kv=None, group=None, mtp=None, hot=None,
                 draft_tree: int = 0, dflash=None, whole_prompt: bool = True):
        self.model, self.tokenizer, self.store, self.draft_model = model, tokenizer, store, draft_model
        self.prompt_lookup, self.num_draft_tokens = prompt_lookup, num_draft_tokens
        self.prefill_step, self.checkpoint_interval = prefill_step, checkpoint_interval
        if kv is not None and decode_concurrency != 1:
            raise ValueError(f"kv quantization ({kv.describe()}) with decode_concurrency={decode_concurrency}: "
                             "batched rows hold unquantized KV only; decode one row at a time (decode_concurrency 1)")
        self.kv, self.vocab_size = kv, vocab_size or len(tokenizer.vocab)
        self.grammars, self.decode_concurrency, self.group = grammars, decode_concurrency, group
        self.prompt_concurrency, self.mtp, self.hot = prompt_concurrency, mtp, hot or HotRuntimes(0)
        self.whole_prompt = whole_prompt
        drafting = dflash is None and (prompt_lookup or draft_model is not None or mtp is not None)
        one = decode_concurrency == 1
        # One row: the width adapts per round, as stream_generate's (the gate is for batches: a wider verify x rows)
        self.decoder = make_decoder(model, num_draft_tokens=num_draft_tokens if drafting else 0, dflash=dflash,
                                    prompt_lookup=prompt_lookup and dflash is not None, draft_model=draft_model,
                                    prefill_step=prefill_step,
                                    draft_min_prob=DRAFT_MIN_PROB if draft_model is not None else 0.0,
                                    gate=not one and group is None, one_row=one, mtp=mtp, draft_tree=draft_tree)
        self._buffers: dict[str, collections.deque] = {}
        self._prefilling = 0  # prompts being prefilled (at most prompt_concurrency)
        # Prompts fed together (several rows only): the batch holds exactly the `_joining` sessions
        # whose prefill has not ended.
        self.prefill_batch = None if one else PrefillBatch(model, gdn_prefill="auto")
        self._joining: dict[str, Session] = {}
        self.agree = agreement(group)  # how this rank's prefills agree their resumes (None: alone)
        self._stepped = self._prefilled = False  # the decoder's / prefill batch's step of this scheduler step ran
        self._dirty = False  # published records may still be only in RAM
        self.decode_steps = self.prefill_chunks = 0  # decoder steps run, prompt chunks forwarded (tests, logs)
        self.fanout = Fanout(self)  # prompts waiting for a prefix another one computes (fanout.py)

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
        """Yield None until admitted to the decoder (a `Progress` after each prefill chunk), then per
        scheduler step the events of its choices: a `Chunk` each (what its row emitted) and a `Finish`
        for one that ended (the request's last one marked `last`).

        The prompt is resumed and prefilled once; each of the `n` choices is a row of its own on a
        copy-on-write clone of it (with several rows all at once, else one after another), with its own
        random stream (`Keys.spawn`) and processors. A choice that ended sends its last text at once
        (an `Early` list), then leaves, then sends its `Finish`.
        Closing the generator cancels the request: its rows leave and each publishes prompt + what its
        client received."""
        session = yield from self._prefill(req)
        controls = req.settings()
        sampler = controls.sampler(self.tokenizer)
        processors = controls.processors(self.vocab_size, self._grammars(controls)) or None
        keys = controls.keys()
        draft = session.ready()
        waiting = list(range(req.n))
        running: list[Choice] = []
        leaving: list[Choice] = []  # ended, their text sent: they leave before their Finish goes out
        try:
            while waiting or running:
                while waiting and not (running and self.decoder.one_row):  # one row: one choice at a time
                    i = waiting.pop(0)
                    last = not waiting  # the last choice takes the prefilled runtimes themselves
                    choice = Choice(session, self.tokenizer, req, i, self.decoder.mode)
                    session.join(choice.row, draft, last=last, stats=choice.stats,
                                 acceptor=make_acceptor(sampler, keys.spawn(i)), max_tokens=req.max_tokens,
                                 processors=processors if last or processors is None else processors.fork(),
                                 stop_tokens=self.tokenizer.eos_token_ids)
                    self._buffers[choice.row] = choice.buffer
                    running.append(choice)
                if not any(c.buffer for c in running):
                    self._step()
                if not any(c.buffer for c in running):
                    yield None  # this scheduler step's decoder step ran before these rows joined
                    continue
                events, finishes = [], []
                for choice in [c for c in running if c.buffer]:
                    drained = choice.drain()
                    if choice.finish is None:
                        events += drained
                    else:  # it ended: its text goes out now, its Finish once it has left
                        running.remove(choice)
                        leaving.append(choice)
                        events += [e for e in drained if not isinstance(e, Finish)]
                        finishes += [e for e in drained if isinstance(e, Finish)]
                if leaving:
                    yield Early(events)
                    while leaving:
                        self._leave(leaving[0])
                        leaving.pop(0)
                    events = finishes
                if not waiting and not running:
                    events[-1].last = True
                yield events
        finally:
            for choice in leaving + running:  # cancelled, or a step failed
                self._leave(choice)

    def _draft_runtime(self, req: GenRequest) -> Runtime | None:
        """The draft's runtime; None without a draft model, or with neither store nor kv (the decoder feeds one)."""
        if self.draft_model is None or (self.store is None and self.kv is None):
            return None
        return Runtime(self.draft_model, store=self.store, cache_salt=req.cache_salt, gdn_prefill="auto",
                       group=self.group, **self._kv_options())

    def _kv_options(self) -> dict:
        """A request runtime's KV quantization (as mlx-lm's generate_step: after each forward)."""
        q = self.kv
        return {} if q is None else dict(kv_bits=q.bits, kv_group_size=q.group_size, quantized_kv_start=q.start)

    def _prefill(self, req: GenRequest) -> Generator[Optional[Progress], None, Session]:
        """The request's session, its prompt resumed and fed but its last token: yields between
        forwards so the running rows decode meanwhile (None, or the `Progress` of a chunk).

        With several rows, the rest goes through the engine's `PrefillBatch`: every prompt being
        prefilled advances in one forward per scheduler step. A prompt mostly restored (or hot) is
        fed alone instead (copying its prefix into the batch would cost more than its rest), one
        chunk per scheduler step, as is a lone row's (in `prefill_step` chunks). At most
        `prompt_concurrency` at once; the others wait (first for a shared prefix: fanout.py).
        """
        yield from self.fanout.wait(req)
        while self._prefilling >= self.prompt_concurrency:
            yield None  # wait for a prefill slot
        self._prefilling += 1
        try:
            rt = self.hot.take(req.ids[:-1], req.cache_salt) or Runtime(  # a clone of its conversation's, or new
                self.model, store=self.store, cache_salt=req.cache_salt, gdn_prefill="auto", group=self.group,
                **self._kv_options())
            session = Session(self.decoder, rt, req.ids, draft=self._draft_runtime(req), keep=self.hot.enabled,
                              checkpoints=prompt_checkpoints(req.checkpoints, len(req.ids), self.checkpoint_interval),
                              prefill_step=self.prefill_step, agree=self.agree, whole=self.whole_prompt)
            plan = session.begin()  # where the prompt resumed from: this request's own answer
            self.fanout.lead(req, session)
            # the first event: what the store restored (the surfaces' usage split before the first token)
            restored = Progress(plan.resume.tokens, len(req.ids))
            one = self.decoder.one_row
            if one or plan.left <= plan.last_alone or plan.resume.tokens > plan.left:
                yield restored  # another scheduler step: the running rows decode before the first chunk
                forwards = plan.left > 0
                with contextlib.closing(session.feed(self.prefill_step if one else self._chunk)) as feed:
                    for progress in feed:  # closed mid-prefill: it stops there, publishing what it computed
                        self.prefill_chunks += 1
                        yield progress
                self.prefill_chunks += forwards  # the last forward
            else:
                self._joining[req.id] = session
                session.join_batch(self.prefill_batch, req.id)
                shown, news = session.fed, restored
                while not session.prefilled:  # the batch's forward for this scheduler step runs once, for all
                    yield news
                    self._prefill_step()
                    if session.failed is not None:
                        raise StepFailed(session.failed)
                    news = Progress(session.fed, len(req.ids)) if session.fed != shown else None
                    shown = session.fed
            self._dirty |= self.store is not None  # the prompt is published: the flush writes it
            return session
        finally:
            self._prefilling -= 1
            self.fanout.end(req.id)
            joining = self._joining.pop(req.id, None)
            if joining is not None and req.id in self.prefill_batch.prompts:
                # cancelled mid-prefill: what its row computed is published, then it leaves
                joining.keep_partial(self.prefill_batch, req.id)
                self.prefill_batch.remove(req.id)

    def _chunk(self) -> int:
        """A prompt's next forward fed alone, beside a batch decoder: `prefill_chunk` tokens while
        rows decode (they step between two chunks), up to `prefill_step` while none does (a lone
        agent turn's ~300 new tokens in one forward, not two: at 52k tokens of context the second
        cost 250 ms more)."""
        return min(self.prefill_step, self.prefill_chunk) if len(self.decoder) else self.prefill_step

    def _prefill_step(self) -> None:
        """One forward of the prefill batch per scheduler step: while rows decode, at most one
        `prefill_chunk` per joining prompt (each advances as fed alone), else up to `prefill_step`;
        each joining session is told where its row got (a stop: a snapshot; the end: published)."""
        batch = self.prefill_batch
        if self._prefilled or not len(batch):
            return
        self._prefilled = True
        ids = batch.ids
        sessions = [self._joining[rid] for rid in ids]
        budget = min(self.prefill_step, self.prefill_chunk * len(ids)) if len(self.decoder) else self.prefill_step
        tic = time.perf_counter()
        try:
            # with MTP, each prompt's row of the forward, its real positions only (a shorter row's pads are not its)
            with collecting([s.hidden for s in sessions], lambda: [batch.fed[rid] for rid in ids]):
                reached = {r.row_id: r for r in batch.step(budget)}
        except Exception as exc:  # every prompt of the forward fails; the batch is dropped whole
            log.exception("a prefill forward of %d prompt(s) failed; failing each of them", len(ids))
            for rid, s in zip(ids, sessions):
                s.failed = f"{type(exc).__name__}: {exc}"
                batch.remove(rid)
            return
        self.prefill_chunks, share = self.prefill_chunks + 1, (time.perf_counter() - tic) / len(ids)
        with contextlib.nullcontext() if self.store is None else self.store.merging():  # one write for all
            for rid, s in zip(ids, sessions):
                s.reached(batch.prompts[rid].pos if rid in batch.prompts else len(s.plan.ids), share, reached.get(rid))

    def _leave(self, choice: Choice) -> None:
        """Free the choice's row now (published under the session's end-of-sequence rule, unless
        its step failed); log its line."""
        if self._buffers.pop(choice.row, None) is None:
            return
        try:
            if (rt := choice.session.leave(choice.row, failed=choice.outcome == "failed")) is not None:
                self._dirty |= self.store is not None
                self.hot.ended(rt, choice.req.cache_salt, choice.outcome)  # kept hot if it ended well
        finally:
            choice.log()

    # -- helpers ----------------------------------------------------------------------

    def _grammars(self, controls: Controls):
        """The model's grammar compiler, built on the first structured request."""
        fmt = controls.response_format
        if fmt is None or fmt.get("type") == "text":
            return None
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab_size)
        return self.grammars
