"""A prompt's prefill on one runtime, resumed from the prefix store: the one caller of the
prefix-cache protocol (`resume`, `snapshot`, `prefilled`, `publish`) outside `store/`.

    begin    held ── store.resume (a prompt that ends quantized: the quantized layout first)
                  ── the ranks agree it (ranks.Agreement) ── restore, all or nothing
                  ── the ranks agree the restore, else every rank undoes it and computes
                  ── drafter segments (the MTP head's) loaded from their records, agreed too
    feed     resume.tokens ──chunk──chunk── stop ──chunk── ... ── L      a Snapshot at each stop
             (on the runtime itself: `Prefill.feed`; a PrefillBatch row: `Prefill.reached`)
             resume.tokens ──────chunk─┼──┼─────── L                    stops inside one forward, where
                                      stop stop                         the layers keep their states there
    finish   prefilled(ids, resume, snapshots, seconds): counted, pages and checkpoints published

The cache answers and the runtime computes: nothing here looks at a layer's
kind (kv_bits goes through the layers' own hooks). This module imports neither
`runtime.py` nor anything above it: `Runtime.prefill` / `prefill_steps` /
`publish` delegate here, and a request's `Session` drives it.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Callable, Generator, Iterable

import mlx.core as mx

from .errors import BranchError, InvariantError, StoreError
from .store import Resume, drafter_records
from .tokens import token_ids

# The longest chunk that passes stops inside it (`Prefill.feed`). Passing them saves a forward's
# fixed cost per stop; a longer chunk costs more per token: the shipped target prefilled ~2,950
# tok/s in chunks of 128..512 tokens and 1,920 tok/s at 2,048 (serve/engine.py), so a prompt
# checkpointed every 256 tokens is not fed in 2,048-token forwards.
PASS_SPAN = 512


class Prefill:
    """One prompt's prefill on one runtime: where it resumed, where it stops, what it took.

    Made by `begin` (resumed, restored, agreed); fed by `feed` or by a batch row's
    `reached`; published by `finish`.

    Attributes:
        ids: the prompt (every token the runtime will hold).
        resume: where it resumed (`Resume`, its states consumed by the runtime).
        cache: the runtime's `PrefixCache` when it began, None without a store.
        pos: prompt tokens the runtime holds now.
        stops: the positions still to reach, ascending; the runtime's state is
            snapshot at each (with a store), and the last is len(ids).
        snaps: the store's snapshots at the stops passed, in order.
        seconds: time spent in the forwards that fed it.
        logits: the last position's logits once known (restored with a whole
            prompt, or computed by the forward reaching the end), else None.
        want_logits: compute the last position's logits (the caller reads them; the
            store's checkpoint of the prompt then keeps them). Without, no output head
            runs, and the last layer's attention runs for none of the last chunk's
            queries: after a long context that is most of a short chunk's forward (mlx-lm's
            generate skips it too: it evaluates a prefill's states and feeds the last
            token alone, as a server's session does). The checkpoint at the end then
            holds no logits: a later prompt ending there that wants them resumes before.
        share_at: stops another prompt waits for (serve/fanout.py): the prefix up to each
            is published as soon as it is reached, not only at the end.
        shared: the stops of `share_at` passed (published, or the publish failed: warned).
        last_alone: the prompt's last token is fed in a forward of its own, as a decoder's first
            step feeds it after a prefill of all but it, so its logits are that step's bit for bit
            (a stop at len(ids) - 1, never passed inside a forward: with a store, today's
            checkpoint of the prompt but its last token, besides the whole prompt's).
    """

    def __init__(self, ids: list, resume: Resume, cache, stops: list, logits, want_logits: bool,
                 last_alone: bool = False):
        self.ids, self.resume, self.cache = ids, resume, cache
        # Invariant: resume.tokens <= pos <= len(ids); stops ascend, each in (pos, len(ids)],
        # the last len(ids) while pos < len(ids), none once pos == len(ids); with last_alone,
        # len(ids) - 1 among them while pos < len(ids) - 1.
        self.pos = resume.tokens
        self.last_alone = last_alone
        if last_alone and self.pos < len(ids) - 1:
            stops = sorted({*stops, len(ids) - 1})
        self.stops = [p for p in stops if p > self.pos]
        self.snaps: list = []
        self.seconds = 0.0
        self.logits = logits
        self.want_logits = want_logits
        self.share_at: set[int] = set()
        self.shared: set[int] = set()  # Invariant: shared <= share_at, each <= pos

    @property
    def left(self) -> int:
        """Prompt tokens still to feed."""
        return len(self.ids) - self.pos

    def feed(self, rt, step_size: int | Callable[[], int]) -> Generator[int, None, mx.array | None]:
        """Forward the rest on `rt` in chunks of `step_size` (or of what it returns, asked before
        each forward). Yields the position between two forwards (never after the last); returns the
        last position's logits (None if not wanted).

        A chunk passes the stops inside it where the runtime's layers keep their states there
        (`PrefixCache.capturing`: a warm turn's new tokens, its message boundaries among them, in
        one forward); elsewhere it ends at the next stop at the latest."""
        start = self.pos
        while self.stops:
            if self.pos > start:
                yield self.pos
            tic = time.perf_counter()
            size = step_size() if callable(step_size) else step_size
            cuts, layers, end = self._cuts(rt, size)
            stop = self.stops[len(cuts)]
            try:
                # the head at the last position only (adapters/head.py); where no logits are wanted
                # it never runs: nothing evaluated below depends on it
                out = rt.forward(self.ids[self.pos : end], last_only=True)
                state = [layer.state for layer in rt.cache] + rt.drafters.state + [layer.cut_states for layer in layers]
                # logits at the prompt's end only: elsewhere they would cost the last layer's attention at
                # every query of the chunk, which the layers' states never need (mlx-lm's prefill skips it
                # too): a 200-token chunk after a 16k context took 1.9x the forward. A checkpoint inside
                # the prompt holds none then; only a later prompt ending exactly there would read them.
                if end == stop == len(self.ids) and self.want_logits:
                    self.logits = out[:, -1, :] * 1  # own buffer: a model not split slices its [S, vocab] logits
                    mx.eval(self.logits, state)
                else:
                    mx.eval(state)
                    if end == stop:
                        self.logits = None  # its checkpoint holds none (an earlier stop's are not these)
                del out, state
                if end - self.pos >= size:  # a long prompt's chunks would otherwise keep their buffers cached;
                    mx.clear_cache()  # after a short one (a warm turn's rest) mlx-lm keeps them too: the next reuses them
                at, self.pos = self.pos, end
                for position in cuts:
                    self._passed(rt, position, position - at)
            finally:
                for layer in layers:
                    layer.cuts, layer.cut_states = (), {}
            if end == stop:
                self._stop(rt, self.logits)
            self.seconds += time.perf_counter() - tic  # not the time the caller spent between steps
        return self.logits

    def _cuts(self, rt, step_size: int) -> tuple[list[int], list, int]:
        """(the stops the next chunk passes inside it, the layers told to keep their states there,
        where it ends). It ends at the next stop where it cannot pass one: no store, a layer that
        cannot keep its state there, or no stop within `PASS_SPAN` tokens; and at the latest at a
        stop another prompt waits for (`share_at`: published as soon as it is reached)."""
        nearest = min(self.pos + step_size, self.stops[0])
        if self.cache is None or len(self.stops) < 2 or self.stops[0] in self.share_at:
            return [], [], nearest
        last = next((p for p in self.stops if p in self.share_at), self.stops[-1])
        if self.last_alone and self.pos < len(self.ids) - 1:
            last = min(last, len(self.ids) - 1)  # the last token's forward is its own
        end = min(self.pos + min(step_size, PASS_SPAN), last)
        cuts = [p for p in self.stops if p < end]
        layers = self.cache.capturing(rt, end - self.pos) if cuts and self._cache_of(rt) is self.cache else None
        if layers is None:
            return [], [], nearest
        for layer in layers:
            layer.cuts = tuple(p - self.pos for p in cuts)
        return cuts, layers, end

    def _passed(self, rt, position: int, cut: int) -> None:
        """The last forward passed the next stop, `cut` tokens into it: its snapshot is the states
        the layers kept there (never a stop another prompt waits for: those end a chunk)."""
        self.stops.pop(0)
        try:
            self.snaps.append(self.cache.snapshot_cut(rt, position, cut))
        except KeyError as exc:  # its forward did not run as `captures` said: no checkpoint there
            self.cache.failed(f"taking the checkpoint at {position} inside a forward", exc)

    def reached(self, rt, position: int, logits, seconds: float = 0.0) -> None:
        """A forward elsewhere (a `PrefillBatch` row, fed to these stops) reached `position`, the
        next stop: `rt` holds the prompt up to there, `logits` are its last position's; the
        forward's share of `seconds` is this prompt's."""
        if not self.stops or position != self.stops[0]:
            raise InvariantError(f"a prefill reached {position}; its next stop is {self.stops[:1]}")
        self.pos, self.seconds = position, self.seconds + seconds
        self.logits = logits
        self._stop(rt, logits)

    def share(self, position: int) -> bool:
        """Publish the prefix up to `position` as soon as the prefill reaches it (another prompt
        waits for it): a stop is added there. The caller makes a `PrefillBatch` row feeding this
        plan stop there too. False (nothing changed) without a store, or past or outside the prompt."""
        if self.cache is None or not self.pos < position <= len(self.ids):
            return False
        if position not in self.stops:
            bisect.insort(self.stops, position)
        self.share_at.add(position)
        return True

    def _stop(self, rt, logits) -> None:
        position = self.stops.pop(0)
        if self.cache is None:
            return
        snap = self.cache.snapshot(rt, logits)
        self.snaps.append(snap)
        if position in self.share_at:  # `rt` holds exactly the prefix: its pages and checkpoint, now
            try:
                self._cache_of(rt).publish(rt, self.ids[:position], [snap])
            except Exception as exc:  # the waiting prompt computes it itself
                self.cache.failed("publishing a shared prefix", exc)
            self.shared.add(position)

    def _cache_of(self, rt):
        """The prefix cache of the layout `rt` holds now (kv_bits may have quantized its KV layers)."""
        if self.cache.layouts != [layer.layout() for layer in rt.cache]:
            return rt.prefix_cache()
        return self.cache

    def keep_partial(self, rt) -> int:
        """The prefill stopped before the prompt's end (its client left): publish the prefix `rt`
        holds (a prefix of the prompt, between two forwards) with the snapshots taken up to there,
        so a retry of the prompt resumes what was computed instead of computing it again (Claude
        Code gives up on a stream after 300 s and sends the request again).

        Returns the records written (0 without a store, with nothing new, or when it failed: a warning).
        """
        held = rt.committed_tokens
        n = len(held)
        if self.cache is None or not self.resume.tokens < n < len(self.ids) or held != self.ids[:n]:
            return 0
        try:
            cache = self._cache_of(rt)
            snaps = [s for s in self.snaps if s.length <= n]
            if not snaps or snaps[-1].length < n:  # the state where it stopped: a retry resumes there
                snaps.append(cache.snapshot(rt, None))
            return cache.prefilled(rt, self.ids[:n], self.resume, snaps, self.seconds)
        except Exception as exc:  # what was computed is lost, as before: never fail the cancel
            self.cache.failed("publishing a cancelled prefill's prefix", exc)
            return 0

    def finish(self, rt) -> int:
        """The whole prompt is in `rt`: count the prefill and publish it (pages, checkpoints).

        Returns the records written (0 without a store, or when it failed: a warning).
        """
        if self.left:
            raise InvariantError(f"finish() of a prefill {self.left} tokens short of its prompt")
        if self.cache is None:
            return 0
        return self._cache_of(rt).prefilled(rt, self.ids, self.resume, self.snaps, self.seconds)

    def check(self) -> None:
        """Verify the invariants of the fields (see `__init__`)."""
        L = len(self.ids)
        if not self.resume.tokens <= self.pos <= L:
            raise InvariantError(f"prefill at {self.pos}, resumed {self.resume.tokens}, of {L} tokens")
        if self.stops != sorted(set(self.stops)) or any(not self.pos < p <= L for p in self.stops):
            raise InvariantError(f"prefill stops {self.stops} not ascending inside ({self.pos}, {L}]")
        if (self.pos < L) != bool(self.stops) or (self.stops and self.stops[-1] != L):
            raise InvariantError(f"prefill at {self.pos} of {L} with stops {self.stops}")
        if self.last_alone and self.pos < L - 1 and L - 1 not in self.stops:
            raise InvariantError(f"prefill at {self.pos} of {L} feeds its last token alone, stops {self.stops}")
        lengths = [s.length for s in self.snaps]
        if lengths != sorted(lengths) or any(n > self.pos for n in lengths):
            raise InvariantError(f"prefill snapshots at {lengths}, at position {self.pos}")
        if not self.shared <= self.share_at or any(p > self.pos for p in self.shared):
            raise InvariantError(f"prefill shared {sorted(self.shared)} of {sorted(self.share_at)} at {self.pos}")


def held_prefix(rt, ids: list[int]) -> int:
    """How many tokens of the prompt `ids` the runtime holds; raises unless it may prefill them."""
    if rt.depth:
        raise BranchError(
            f"prefill() with {rt.depth} open branch(es): commit or roll them back first "
            "(speculative tokens are never published)"
        )
    held = rt.tokens
    if len(held) >= len(ids) or held != ids[: len(held)]:
        raise BranchError(
            f"prefill() of {len(ids)} tokens on a runtime holding {len(held)} tokens that are not a "
            "strict prefix of them; pass the whole prompt (held tokens first, at least one new), "
            "or use a fresh Runtime (or a clone of one holding a prefix)"
        )
    return len(held)


def begin(rt, ids: list[int], held: int, checkpoints: Iterable[int] = (), agree=None,
          want_logits: bool = True, last_alone: bool = False) -> Prefill:
    """Resume the prompt `ids` on `rt` (holding ids[:held]) from its store, agreed by the ranks.

    Store failures are a miss, never an error. `agree`: the ranks' `ranks.Agreement`
    (None: a process of its own). `last_alone`: see `Prefill`. Returns the `Prefill`, the
    runtime holding `resume.tokens`.
    """
    L = len(ids)
    cache = rt.prefix_cache() if rt.store is not None else None
    unquantized = None  # the layers to put back if a quantized resume does not load
    if cache is not None and _ends_quantized(rt, ids, held):
        cache, resume, unquantized = _quantized_resume(rt, ids, held, want_logits)
    else:
        resume = Resume(held) if cache is None else cache.resume(rt, ids, held, want_logits)
    if cache is not None and agree is not None:
        resume = _agreed(agree, resume, held)  # then every rank restores, or none (the same tokens)
    point = rt.savepoint() if resume.states is not None and agree is not None else None
    restored = True
    if resume.states is not None:
        try:
            rt.restore(ids[: resume.tokens], list(resume.states))  # drafter segments stale, until:
            drafter_records.load(rt, resume.drafters)
        except Exception as exc:  # states that do not load are a miss, never a failed prefill
            cache.failed("restoring the resumed prefix", exc)
            resume, restored = Resume(held), False
            if unquantized is not None:  # computed from scratch: at full precision until the start
                rt.put_back(unquantized)
    agreed = point is not None and agree.restored(restored)
    if point is not None and not agreed:
        if restored:  # another rank could not: every rank computes
            rt.undo(point)
        resume = Resume(held)
    del point
    if agreed and rt.drafters:  # the drafters resume on every rank or on none: a drafter that
        # recomputes runs the target's forwards, collectives included (every rank decides alike here)
        if not agree.restored(all(not seg.stale for seg in rt.drafters.segments)):
            rt.drafters.invalidate()
    # The layers hold the states now. No other reference may stay: the next forward writes
    # into a KV buffer in place only if nothing else references it (else it copies it whole).
    logits, resume = resume.logits, dataclasses.replace(resume, states=None, logits=None, drafters=())
    stops = [L]
    if cache is not None:
        start = resume.tokens
        stops = sorted({L, *resume.stops, *(p for p in checkpoints if isinstance(p, int) and start < p < L)})
    return Prefill(ids, resume, cache, stops, logits, want_logits, last_alone)


def prefill_steps(rt, tokens, *, step_size: int = 2048, checkpoints: Iterable[int] = (),
                  agree=None) -> Generator[Resume | int, None, mx.array]:
    """`Runtime.prefill_steps` (see there): the arguments checked now, then a generator."""
    ids = token_ids(tokens)
    if not isinstance(step_size, int) or isinstance(step_size, bool) or step_size <= 0:
        raise ValueError(f"prefill(step_size={step_size!r}): step_size must be a positive int")
    held = held_prefix(rt, ids)
    if rt.store is not None:
        rt.prefix_cache()  # raises now on layers the store cannot hold
    return _steps(rt, ids, held, step_size, checkpoints, agree)


def _steps(rt, ids, held, step_size, checkpoints, agree):
    plan = begin(rt, ids, held, checkpoints, agree)
    yield plan.resume  # the caller may run other work first
    last = yield from plan.feed(rt, step_size)
    plan.finish(rt)
    return last


def lookahead(rt, ids: list[int]) -> tuple[int, float]:
    """(tokens of `ids` the store of `rt`, a fresh runtime, would restore now; the store's
    seconds per computed prompt token). A lookup only: nothing changes; a failure is 0."""
    cache = rt.prefix_cache()
    try:
        tokens = cache.lookup(rt, ids, 0)[0].resume
    except Exception:  # a miss: the prefill's own lookup warns and counts it
        tokens = 0
    return tokens, cache.layout.spt


def publish(rt) -> int:
    """`Runtime.publish` (see there): the committed tokens and state, to the runtime's store."""
    if rt.store is None:
        raise StoreError("publish() on a Runtime without a store: pass store=open_store(...) to Runtime()")
    return rt.prefix_cache().publish_runtime(rt)


def _ends_quantized(rt, ids: list[int], held: int) -> bool:
    """True if kv_bits will have quantized this fresh runtime's KV layers by the prompt's end."""
    q = rt.kv_quantization
    return q is not None and held == 0 and len(ids) >= q.start and any(layer.kv_switches for layer in rt.cache)


def _quantized_resume(rt, ids: list[int], held: int, logits: bool = True):
    """The store's resume of a prompt that ends quantized: quantized pages first.

    The prompt is looked up under the quantized layout (empty quantized layers
    swapped in, nothing to convert). On a miss the unquantized layers come
    back, so the prompt is computed as mlx-lm computes it (at full precision
    until `quantized_kv_start`), resuming what the unquantized layout holds
    (prompts published before they reached the start).

    Returns:
        (the prefix cache of the layout resumed, its `Resume`, the unquantized
        layers when the quantized ones stay in place, else None).
    """
    own = rt.quantize_now()
    cache = rt.prefix_cache()
    resume = cache.resume(rt, ids, held, logits)
    if resume.states is not None and resume.tokens >= rt.kv_quantization.start:  # below, mlx-lm holds them unquantized
        return cache, resume, own
    rt.put_back(own)
    cache = rt.prefix_cache()
    return cache, cache.resume(rt, ids, held, logits), None


def _agreed(agree, resume: Resume, held: int) -> Resume:
    """The resume every rank of the group found, or a miss on every rank (segcache/ranks.py)."""
    tokens, stops = agree.resume(held, resume.tokens, resume.stops)
    if tokens != resume.tokens:
        return Resume(held)
    return resume if stops == tuple(resume.stops) else dataclasses.replace(resume, stops=())
