"""One request's life, once: its prompt resumed and prefilled, its rows on the decoder, their end.

    Session(decoder, runtime, history, draft=...)
      begin()            the target resumes from the prefix store (agreed by the ranks)
      feed(chunk)        ... and computes the rest, one forward per step: Progress      ┐ or, with
      join_batch(batch)  ... or as a row of a PrefillBatch, `reached` per forward       ┘ several rows
                         at its end the prompt is published (pages, checkpoints)
      ready()            the draft model's runtime resumed and prefilled too (or, with MTP,
                         the prefill's hidden states); the prompt held but its last token
      join(row, ...)     a row joins the decoder (the last one on the prefilled runtimes
                         themselves, the others on clones); the decoder's steps emit its tokens
      settle(row, k)     it delivered k of a step's tokens: the round is settled there
      leave(row)         it ends: released and published (target and draft), or removed

The end-of-sequence rule, the same on every path: a row that ends (its EOS, its
length, a stop string, its client gone) keeps every token it delivered, its
EOS included, all fed, and that is what is published. Only that rule gives one
state whatever the decoder ran: a lone row's plain step has fed the EOS
already (mlx-lm's pipelined `generate_step` feeds each token as it emits it, so
its prompt cache holds the EOS too), and a chat's next turn renders the
assistant message closed by that same token (`<|im_end|>`), so the state past
it prefixes the next prompt. A row whose step failed runs no further forward
and publishes nothing.

`stream_generate` is one Session on a lone-row decoder; the server's engine
runs one per request, its rows in the shared decoder.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Generator, Hashable, Iterable, Optional

import mlx.core as mx

from ..errors import InvariantError
from ..runtime import Runtime
from .. import prefill as store_prefill
from .hidden import SEGMENT_MODES, Hidden, carry_segment, collecting

log = logging.getLogger("segcache")


def prompt_checkpoints(boundaries: Iterable[int], total: int, every: int) -> list[int]:
    """A request's checkpoints: its own `boundaries` (chat messages), plus every `every` tokens of
    its `total` (0: none), so a later prompt sharing only part of it resumes within that many."""
    grid = range(every, total - 1, every) if every > 0 else ()
    return sorted(set(boundaries).union(grid))


@dataclass
class Progress:
    """A prompt's prefill fed another chunk: `processed` of its `total` tokens are held
    (restored ones included); the decoder's first step feeds the last."""

    processed: int
    total: int


@dataclass
class _Row:
    """A row of the session in the decoder: the draft runtime it joined with (a Runtime, the
    MTP `HiddenStates`, or None) and where its figures are counted."""

    draft: object
    stats: object


class Session:
    """One request's prompt and its rows on a `BatchDecoder` (see the module docstring).

    Args:
        decoder: the decoder its rows join.
        runtime: the target's Runtime, holding a strict prefix of `history` (none, or
            a conversation's earlier turns); with a store, it resumes from it.
        history: every token of the request: what `runtime` holds, then the prompt.
        draft: the draft model's Runtime, holding a prefix of `history[:-1]` (None:
            the decoder feeds a fresh one; unused with MTP).
        checkpoints: prompt positions to checkpoint on the way (chat message boundaries).
        prefill_step: prompt tokens per forward, at most.
        agree: the ranks' `segcache.ranks.Agreement` (None: a process of its own).
        keep: the caller keeps the runtimes afterwards (`stream_generate`'s
            `runtime=`): a row that ends is released fed even without a store.
        whole: prefill the whole prompt, its last token too, and start the rows from its
            last position's logits (`BatchDecoder.add(logits=)`): a prompt the store holds
            whole (its end's checkpoint keeps the logits) runs no forward before its first
            token. The last token is fed in a forward of its own (alone on the runtime, after
            a `PrefillBatch` row's end too), the forward a decoder's first step would run, so
            the answer is the one without `whole`, bit for bit on one row; with a store both
            ends are published (the prompt but its last token, and all of it with its logits).
            False: all but the last token (the decoder's first step feeds it).

    Raises:
        ValueError: the draft runtime holds tokens that are not a prefix of `history`,
            or ids the draft (or an MTP head) needs are unknown (fed without `forward`).

    Invariants (check()): until a row joins, `runtime` holds history[:plan.pos] outside any
    branch (unless a PrefillBatch row feeds it); every row of `rows` is the decoder's; the
    plan's own (prefill.Prefill).
    """

    def __init__(self, decoder, runtime, history: list, *, draft=None, checkpoints: Iterable[int] = (),
                 prefill_step: int = 2048, agree=None, keep: bool = False, whole: bool = False):
        self.decoder, self.runtime, self.history, self.draft = decoder, runtime, list(history), draft
        self.checkpoints, self.prefill_step, self.agree, self.keep = list(checkpoints), prefill_step, agree, keep
        self.whole = whole
        self.plan: store_prefill.Prefill | None = None  # the target's prefill, once begun
        self.hidden = Hidden(decoder)  # with MTP: the hidden states of what the prefill fed
        self.rows: dict[Hashable, _Row] = {}
        self.joined = 0  # rows that joined so far (left ones included)
        self.failed: Optional[str] = None  # a forward of a batch that fed it failed
        self._check_start()
        self.in_batch = False  # a PrefillBatch row feeds it (then that row holds plan.pos, not `runtime`)
        self.fed = 0  # prompt tokens fed so far (a PrefillBatch row's count, between its stops too)
        self.held = 0  # prompt tokens `runtime` held when it began (a clone of a hot runtime, serve/hot.py)

    def _check_start(self) -> None:
        history, drt = self.history, self.draft
        if drt is not None and self.decoder.mode == "draft":
            held = drt.tokens
            if held != history[: len(held)] or len(held) >= len(history):
                raise ValueError(
                    f"draft_runtime holds {len(held)} tokens that are not a prefix of the target's "
                    f"{len(history) - 1} + the prompt's last; pass a draft runtime that followed this target"
                )
            if None in history[len(held) : len(history) - 1]:  # ids the draft must still be fed
                raise ValueError(
                    "the target runtime holds tokens fed without Runtime.forward (ids unknown) that the draft "
                    "runtime has not seen, so it cannot be brought up to date; use prompt lookup, a draft runtime "
                    "holding those tokens (e.g. loaded from the same prompt cache file), or a fresh runtime"
                )
        if self.decoder.mode == "mtp" and None in history[: len(history) - 1]:
            raise ValueError("the target runtime holds tokens fed without Runtime.forward (ids unknown), "
                             "which the MTP head needs; use a fresh runtime")

    # -- the prompt --------------------------------------------------------------------

    @property
    def restored(self) -> int:
        """Prompt tokens restored from the prefix store, else those the runtime held when it began."""
        return 0 if self.plan is None else self.plan.resume.restored or self.held

    @property
    def tier(self) -> str:
        """Where they came from ("ram", "disk", "ram+disk", "remote"; "hot": the runtime held them; "-": none)."""
        if self.plan is None:
            return "-"
        return "hot" if self.held and not self.plan.resume.restored else self.plan.resume.tier

    @property
    def prefilled(self) -> bool:
        """The target's runtime holds the prompt but its last token (`whole`: all of it)."""
        return self.plan is not None and not self.plan.left

    def begin(self) -> store_prefill.Prefill:
        """Resume the target's prompt (all but its last token; `whole`: all of it, with its last
        logits) from the store; nothing is fed yet."""
        ids = self.history if self.whole else self.history[:-1]
        held = self.held = len(self.runtime.tokens)
        if self.decoder.mode in SEGMENT_MODES:  # the drafter's cache rides with the runtime: fed, stored, resumed
            self.decoder.drafter.attach(self.runtime)
        if held < len(ids):
            self.plan = store_prefill.begin(self.runtime, ids, store_prefill.held_prefix(self.runtime, ids),
                                            self.checkpoints, self.agree, want_logits=self.whole,
                                            last_alone=self.whole)
        else:  # it holds the prompt already (a one-token prompt after its conversation)
            self.plan = store_prefill.Prefill(ids, store_prefill.Resume(held), None, [], None, False)
        return self.plan

    def feed(self, chunk) -> Generator[Progress, None, None]:
        """Feed the rest on the runtime itself, one forward of at most `chunk` tokens per step (an
        int, or a callable asked before each forward);
        yields `Progress` between two forwards; the last one publishes the prompt."""
        plan, total = self.plan, len(self.history)
        steps = plan.feed(self.runtime, chunk)
        try:
            while True:
                with collecting([self.hidden]):
                    try:
                        next(steps)
                    except StopIteration:
                        break
                if not (self.whole and plan.pos == total - 1):  # the last token's forward follows at once
                    yield Progress(plan.pos, total)
        except GeneratorExit:  # closed mid-prefill (the request cancelled): stop there, keep what was computed
            steps.close()
            self.keep_partial()
            raise
        finally:
            steps.close()  # a failed forward: stop there, publish nothing
        plan.finish(self.runtime)

    def keep_partial(self, batch=None, row_id=None) -> int:
        """The request left mid-prefill: publish the prefix computed so far (the runtime's, or, in
        `batch` as `row_id`, the row's), so a retry of the prompt resumes it. Returns the records
        written."""
        if self.plan is None or self.plan.left == 0:
            return 0
        try:
            rt = batch.runtime_of(row_id) if self.in_batch else self.runtime
        except Exception as exc:  # what was computed is lost, as before: never fail the cancel
            log.warning("a cancelled prefill's prefix could not be taken from its batch row: %s", exc)
            return 0
        return self.plan.keep_partial(rt)

    @property
    def batch_end(self) -> int:
        """Where a `PrefillBatch` row of this prompt ends (`whole`: its last token is fed alone)."""
        return len(self.plan.ids) - self.plan.last_alone

    def join_batch(self, batch, row_id: Hashable) -> None:
        """Feed the rest as row `row_id` of a `PrefillBatch` (its forwards run by the caller,
        each row's outcome handed to `reached`), up to `batch_end`."""
        end = self.batch_end
        # no logits at the row's end: the decoder's first step (or, `whole`, the last token's own
        # forward) computes the ones it reads
        batch.add(row_id, self.runtime, self.plan.ids[:end], [p for p in self.plan.stops if p <= end], logits=False)
        self.in_batch, self.fed = True, self.plan.pos

    def reached(self, fed: int, seconds: float, stop=None) -> None:
        """A batch forward fed the prompt up to `fed` in `seconds` (its share). At a stop, `stop`
        (a `PrefillBatch` `Reached`) holds the prompt up to there in a runtime of its own, which
        becomes the session's at the row's end (`batch_end`; `whole`: then its last token is fed
        alone on it) and the prompt is published."""
        plan, end = self.plan, self.batch_end
        self.fed, plan.seconds = fed, plan.seconds + seconds
        if stop is not None:
            if stop.position == end and stop.runtime is not self.runtime:  # fed elsewhere: the drafter's
                carry_segment(self.runtime, stop.runtime, self.hidden, plan.ids[:end])  # segment goes on with it
            plan.reached(stop.runtime, stop.position, stop.logits)
            if stop.position == end:
                self.runtime, self.in_batch = stop.runtime, False
                try:
                    with collecting([self.hidden]):
                        for _ in plan.feed(self.runtime, 1):  # `whole`: the last token, one forward
                            pass
                except Exception as exc:  # as a failed batch forward: this prompt fails, publishing nothing
                    self.failed = f"{type(exc).__name__}: {exc}"
                    return
                self.fed = plan.pos
                plan.finish(self.runtime)

    def ready(self):
        """The draft's side of the prompt: its runtime resumed from its own records and fed up
        to the target's prompt but its last token (the decoder feeds what it still lacks); with
        MTP the prefill's hidden states. Returns what a row joins with as its draft."""
        if self.hidden.hands_states:
            return self.hidden.states(len(self.plan.ids))
        drt, ids = self.draft, self.history[:-1]
        if drt is not None and drt.store is not None and len(drt.tokens) < len(ids):
            plan = store_prefill.begin(drt, ids, store_prefill.held_prefix(drt, ids), (), self.agree,
                                       want_logits=False)
            for _ in plan.feed(drt, self.prefill_step):
                pass
            plan.finish(drt)
        return drt

    # -- its rows ----------------------------------------------------------------------

    def join(self, row: Hashable, draft, *, last: bool = True, stats=None, **options) -> None:
        """Row `row` joins the decoder: on the prefilled runtimes themselves if `last`, else on
        copy-on-write clones (another row follows); `options` are `BatchDecoder.add`'s."""
        rt = self.runtime if last else self.runtime.clone()
        if not last and draft is not None:
            draft = draft.clone()
        if self.whole:  # its first token from the prompt's last logits (restored or computed)
            options["logits"] = self.plan.logits
        self.decoder.add(row, rt, None if self.whole else self.history[-1], draft_runtime=draft, stats=stats,
                         **options)
        self.rows[row] = _Row(draft, stats)
        self.joined += 1

    def step(self, row: Hashable) -> list:
        """The decoder's step (for a decoder of this session's rows only): `row`'s tokens."""
        return self.decoder.step()[row]

    def settle(self, row: Hashable, taken: int) -> None:
        """`row` delivered only `taken` of its last step's tokens: it keeps those and must leave."""
        self.decoder.settle({row: taken})

    def leave(self, row: Hashable, *, failed: bool = False):
        """The row leaves the decoder under the module's end-of-sequence rule; returns its
        Runtime when it was released (None when it was removed, or had left already)."""
        state = self.rows.pop(row)
        decoder = self.decoder
        if row not in decoder.rows:  # its step failed it out already
            return None
        if failed:  # no further forward: a lone row's runtime is the caller's, left as it was fed
            return decoder.release(row, pending=False) if decoder.one_row else decoder.remove(row)
        if not self.keep and self.runtime.store is None:
            decoder.remove(row)  # nobody keeps what it holds
            return None
        tic = time.perf_counter()
        rt = decoder.release(row, pending=True)  # every delivered token fed, an EOS included
        mx.eval([layer.state for layer in rt.cache])
        if state.stats is not None:
            state.stats.commit_time += time.perf_counter() - tic
        if rt.store is not None:
            store_prefill.publish(rt)  # the next turn resumes from prompt + reply
        draft = state.draft
        if decoder.one_row and isinstance(draft, Runtime) and draft.store is not None:
            store_prefill.publish(draft)  # it was the draft row itself: committed to a prefix of rt
        return rt

    def check(self) -> None:
        """Verify the invariants of the fields (see the class docstring)."""
        if self.plan is not None:
            self.plan.check()
            if not self.joined and not self.in_batch and not self.failed:
                held = self.runtime.tokens
                if self.runtime.depth or len(held) != self.plan.pos:
                    raise InvariantError(f"the session's runtime holds {len(held)} tokens "
                                         f"({self.runtime.depth} branches), its prefill is at {self.plan.pos}")
        stray = [r for r in self.rows if r not in self.decoder.rows]
        if stray:
            raise InvariantError(f"the session's rows {stray} are not in the decoder")
