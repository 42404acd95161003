"""Batched decoding on a BatchRuntime: one forward per step for every row, speculative or plain.

    step():   every row drafts (prompt lookup in its own history, or the batched draft model)
              no row drafted  -> forward [[y_i]]                        (no branch)
              else            -> fork, forward [[y_i] + drafts_i] ragged, commit [1 + n_i]
              each row emits drafts_i[:n_i] + [t_i]; t_i becomes its pending y_i

With a draft model, a second BatchRuntime holds the same rows of the draft:

    draft batch:   fork ─ [[y_i]] ─ [[d1_i]] ... ─ [[d(J-1)_i]] (─ [[dJ_i]])  ─ commit [1 + n_i]
    target batch:                                 fork ─ [[y_i] + drafts_i] ─ commit [1 + n_i]

Every draft forward is one token per row (rows never pad in the draft), one
sync per draft forward for all rows. Row i keeps its first k_i proposals
(its room, or up to the first the draft gives less than `draft_min_prob`);
the proposals past k_i are fed but never committed. The last forward
([[dJ_i]]) runs only when some row accepted all J drafts, so that row's draft
holds them. After a step the target batch holds each row's history but the
pending token, the draft batch a prefix of that: a plain step does not feed
the draft, whose rows catch up (one ragged forward) when they draft again.

With a gate (the default), each step first picks the batch's draft width K
(`gate.py`: expected tokens per second of step, 0 for a plain step).

As `generation._Speculator` for one sequence: a row's runtime holds its
history but the last emitted token (`pending`, fed by the next step). A row
leaves between steps (`remove`); the others are untouched.

Plain decoding (no drafter) pipelines one step ahead, as mlx-lm's generate_step:

    step t:   [commit 1 | forward [[y_i]]] ─ y'_i = choose(logits) lazily ─ fork ─
              forward [[y'_i]] (the lookahead) ─ async_eval ─ read y'_i ─ return them

so the next step's graph is built and queued before this step's tokens are
read, and the next step only commits the lookahead (its logits are in
flight). Between steps the batch then holds every row's whole history inside
a branch of one token per row; a join rolls the lookahead back first (one
forward wasted), a leaving row simply leaves with its branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

import mlx.core as mx

from ..acceptors import Acceptor, GreedyMatch
from ..drafters import feed, normalize
from ..errors import InvariantError
from ..lookup import PromptLookup
from ..runtime import Runtime
from .gate import Acceptance, Gate, MeasuredCost
from .runtime import BatchRuntime


@dataclass
class RowState:
    """One row's generation state.

    Invariant: the batch row holds exactly `history[:-1]` (committed); history[-1] is
    `pending`, which a plain decoder's lookahead (when in flight) holds fed in an open
    branch of one token; the draft batch row (with a draft model) holds a prefix of `history[:-1]`.
    """

    acceptor: Acceptor
    history: list
    lookup: Optional[PromptLookup] = None
    cap: int = 0  # this row's current draft width (adaptive as stream_generate's)
    remaining: int = -1  # tokens it may still emit (-1: no limit)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    per_round: list = field(default_factory=list)  # drafts accepted in each round that drafted
    estimate: Acceptance = field(default_factory=Acceptance)  # the gate's view of this row


class BatchDecoder:
    """Rows of one model generating together.

    Args:
        model: the target model.
        num_draft_tokens: drafts per row per round (0: plain decoding), by
            prompt lookup, or by `draft_model` when one is given.
        recurrent_strategy: as for `Runtime` (both batches).
        draft_model: a draft model sharing the target's vocabulary (dense or
            hybrid), batched in a BatchRuntime of its own; None: prompt lookup.
        draft_min_prob: with a draft model, a row drafts no further after a
            draft its draft model gives less than this (that draft is still
            verified), as `stream_generate`'s; the round ends when every row stopped.
        prefill_step: tokens per forward when a joining row's draft runtime is
            brought up to the target's tokens.
        gate: True: each step's draft width is chosen by a `Gate` on step
            costs measured online (0 when speculation does not pay); a `Gate`:
            that one (e.g. on a fixed cost table); False: every row drafts its
            own adaptive width every step (ungated).
        pipeline: plain decoding only (no drafter): build and queue the next
            step's forward before reading this step's tokens (see the module
            docstring). False: one forward per step, synced before the next is built.
    """

    def __init__(self, model, *, num_draft_tokens: int = 0, recurrent_strategy: str = "auto",
                 draft_model=None, draft_min_prob: float = 0.0, prefill_step: int = 2048,
                 gate: bool | Gate = True, pipeline: bool = True):
        if draft_model is not None and num_draft_tokens < 1:
            raise ValueError(f"a draft model needs num_draft_tokens >= 1, got {num_draft_tokens}")
        if not 0.0 <= draft_min_prob <= 1.0:
            raise ValueError(f"draft_min_prob must be a probability in [0, 1], got {draft_min_prob}")
        self.batch = BatchRuntime(model, recurrent_strategy=recurrent_strategy)
        self.draft = None if draft_model is None else BatchRuntime(draft_model, recurrent_strategy=recurrent_strategy)
        self.width = num_draft_tokens
        self.min_prob = draft_min_prob if draft_model is not None else 0.0
        self.prefill_step = prefill_step
        self.rows: dict[Hashable, RowState] = {}
        self.gate = None if not num_draft_tokens or gate is False else Gate() if gate is True else gate
        self.pipeline = pipeline and not num_draft_tokens
        # The lookahead in flight: (its logits [B, 1, V], the row ids it was built for, in order),
        # or None. Invariant: not None iff the batch's branch is open between steps; then every
        # row (a subset of those ids) has fed exactly its pending token in that branch.
        self._ahead: tuple | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row_id, runtime: Runtime, pending: int, *, acceptor: Acceptor | None = None,
            max_tokens: int = -1, draft_runtime: Runtime | None = None) -> None:
        """Add a row whose `runtime` holds its prompt but the last token `pending`.

        With a draft model, `draft_runtime` (of the draft model) holds a prefix
        of those tokens, e.g. resumed from the prefix store; the rest is fed to
        it here. None: a fresh draft runtime fed all of them.

        Raises:
            ValueError: the id is taken, or the draft runtime holds tokens that
                are not a prefix of the target's or is of another model; nothing
                changed. (If joining then fails, the draft runtime given has
                been fed up to the target's tokens, which it may keep.)
        """
        if row_id in self.rows:
            raise ValueError(f"add({row_id!r}): a row with that id is already in the batch")
        drt = None
        if self.draft is not None:
            drt = draft_runtime if draft_runtime is not None else Runtime(self.draft.model)
            if drt.model is not self.draft.model:
                raise ValueError(f"add({row_id!r}): the draft runtime is not of the draft model")
            held, want = drt.tokens, runtime.tokens
            if len(held) > len(want) or held != want[: len(held)] or None in want:
                raise ValueError(
                    f"add({row_id!r}): the draft runtime holds {len(held)} tokens that are not a prefix of "
                    f"the target runtime's {len(want)} known tokens"
                )
            feed(drt, want[len(held):], self.prefill_step)
        elif draft_runtime is not None:
            raise ValueError(f"add({row_id!r}): a draft runtime without a draft model")
        if runtime.model is not self.batch.model:
            raise ValueError(f"add({row_id!r}): the runtime is of another model")
        self._drop_lookahead()  # a row joins settled rows: theirs hold history[:-1] again
        self.batch.join(row_id, runtime)
        if drt is not None:
            try:
                self.draft.join(row_id, drt)
            except BaseException:
                self.batch.leave(row_id)
                raise
        history = runtime.tokens + [pending]
        lookup = None
        if self.width and self.draft is None:
            lookup = PromptLookup()
            lookup.extend(history)
        self.rows[row_id] = RowState(acceptor or GreedyMatch(), history, lookup, self.width, max_tokens)

    def remove(self, row_id) -> None:
        """The row leaves (finished or cancelled); the others keep their state (and lookahead)."""
        self.batch.leave(row_id)  # with a lookahead, its branch goes with it: never committed
        if self.draft is not None:
            self.draft.leave(row_id)
        del self.rows[row_id]
        if self._ahead is not None and not len(self.batch):
            self._drop_lookahead()

    def runtime(self, row_id) -> Runtime:
        """A single-sequence Runtime holding the row's history, all fed (e.g. to publish it)."""
        if self._ahead is not None:  # the pending token is fed in the lookahead: keep it in a copy
            one = self.batch.copy_row(row_id)
            one.commit([1])
            return one.to_runtime(row_id)
        rt = self.batch.to_runtime(row_id)
        rt.forward([self.rows[row_id].history[-1]])
        return rt

    def held(self, row_id) -> Runtime:
        """A single-sequence Runtime holding the row's history but the pending token (what a
        step committed), e.g. to publish a finished row without its end-of-sequence token."""
        if self._ahead is not None:
            one = self.batch.copy_row(row_id)
            one.rollback()
            return one.to_runtime(row_id)
        return self.batch.to_runtime(row_id)

    def step(self) -> dict:
        """One forward for every row; returns {row id: [(token, logprobs [V], from_draft), ...]}."""
        if self.pipeline:
            return self._pipelined_step()
        ids = self.batch.ids
        states = [self.rows[r] for r in ids]
        pending = [s.history[-1] for s in states]
        widths = [self._room(s) for s in states]
        qs, last, branch = [None] * len(states), None, False
        gate = self.gate
        t0 = gate.clock() if gate is not None else 0.0
        try:
            if self.draft is None:
                drafts = [s.lookup.draft(w) if s.lookup is not None and w > 0 else [] for s, w in zip(states, widths)]
                if gate is not None:  # a row can draft what it matched; the batch verifies K + 1
                    K = gate.choose([len(d) for d in drafts], [s.estimate for s in states])
                    drafts = [d[:K] for d in drafts]
            else:
                if gate is not None:
                    K = gate.choose(widths, [s.estimate for s in states])
                    widths = [min(w, K) for w in widths]
                drafts, qs, last = self._draft_model(states, pending, widths)
            branch = any(drafts)
            if branch:
                self.batch.fork()
            logits = self.batch.forward([[p] + d for p, d in zip(pending, drafts)])
            logprobs = normalize(logits)  # [B, S, V]
            rows = [logprobs[i, : 1 + len(d)] for i, d in enumerate(drafts)]
            choices = [s.acceptor.choices(lp) for s, lp in zip(states, rows)]
            mx.eval(logprobs, *[c for cs in choices for c in cs])  # one sync for every row
            # every row's acceptance before any row's state moves: a failure leaves all as they were
            accepted = [s.acceptor.accept(lp, d, q, cs) for s, d, q, lp, cs in zip(states, drafts, qs, rows, choices)]
            keep = [1 + n for n, _ in accepted]
            if self.draft is not None:
                self._settle_draft(branch, pending, drafts, keep, last)
        except BaseException:  # a failed speculative step changes nothing (a plain one has fed y_i)
            if self.batch.branch_open:
                self.batch.rollback()
            if self.draft is not None and self.draft.branch_open:
                self.draft.rollback()
            raise
        out = {}
        for rid, s, d, lp, (n, nxt) in zip(ids, states, drafts, rows, accepted):
            out[rid] = [(t, lp[j], True) for j, t in enumerate(d[:n])] + [(nxt, lp[n], False)]
            self._advance(s, d, n, nxt)
        if branch:
            self.batch.commit(keep)
        if gate is not None:
            gate.record(len(states), max(map(len, drafts), default=0), gate.clock() - t0)
        return out

    def _pipelined_step(self) -> dict:
        """A plain step: commit the lookahead (or forward the pending tokens), choose, launch the next."""
        ids = self.batch.ids
        states = [self.rows[r] for r in ids]
        if not states:
            return {}
        try:
            if self._ahead is None:
                logits = self.batch.forward([[s.history[-1]] for s in states])[:, -1]
            else:
                logits, launched = self._ahead
                self._ahead = None
                self.batch.commit([1] * len(states))  # each row's pending token, fed by the lookahead
                logits = logits[:, -1]
                if launched != ids:  # rows left since: their logits rows go too
                    logits = logits[mx.array([launched.index(r) for r in ids], dtype=mx.int32)]
            logprobs = normalize(logits)  # [B, V]
            if all(isinstance(s.acceptor, GreedyMatch) for s in states):  # one argmax for the batch
                chosen = mx.argmax(logprobs, axis=-1)
            else:  # each row's own rule, in row order (a seeded sampler draws as unpipelined)
                chosen = mx.stack([s.acceptor.sample(logprobs[i]) for i, s in enumerate(states)])
            mx.async_eval(chosen, logprobs)
            self.batch.fork()
            ahead = self.batch.forward(chosen.reshape(-1, 1))  # built while the GPU works on `chosen`
            mx.async_eval(ahead)
            self._ahead = (ahead, ids)
            toks = chosen.tolist()
            self.batch.fill([[t] for t in toks])
        except BaseException:  # the lookahead (if launched) never reaches committed state
            self._drop_lookahead()
            raise
        out = {}
        for rid, s, t, i in zip(ids, states, toks, range(len(ids))):
            out[rid] = [(t, logprobs[i], False)]
            self._advance(s, [], 0, t)
        return out

    def _drop_lookahead(self) -> None:
        """Roll the lookahead back (the rows hold history[:-1] again); its forward is wasted."""
        self._ahead = None
        if self.batch.branch_open:
            self.batch.rollback()

    def check(self) -> None:
        """Both batches' invariants; each row holding its history but the pending token (the draft: a
        prefix), and with a lookahead in flight, the pending token fed in a branch of one token per row."""
        self.batch.check()
        if set(self.rows) != set(self.batch.ids):
            raise InvariantError(f"decoder rows {list(self.rows)} but batch rows {self.batch.ids}")
        if (self._ahead is not None) != self.batch.branch_open:
            raise InvariantError(f"lookahead in flight: {self._ahead is not None}, branch open: {self.batch.branch_open}")
        if self._ahead is not None:
            logits, launched = self._ahead
            if not self.pipeline or logits.shape[0] != len(launched) or any(r not in launched for r in self.batch.ids):
                raise InvariantError(f"lookahead built for rows {launched}, batch rows {self.batch.ids}")
            for row in self.batch.rows:
                if row.base is None or row.tokens[: row.base] != self.rows[row.id].history[:-1] \
                        or row.tokens[row.base:] != self.rows[row.id].history[-1:]:
                    raise InvariantError(f"row {row.id!r}: the lookahead branch does not hold exactly its pending token")
        if self.draft is not None:
            self.draft.check()
            if self.draft.ids != self.batch.ids:
                raise InvariantError(f"draft rows {self.draft.ids} but target rows {self.batch.ids}")
        for s in self.rows.values():
            s.estimate.check()
        if self.gate is not None and isinstance(self.gate.cost, MeasuredCost):
            self.gate.cost.check()
        if self.batch.branch_open:
            return
        for row in self.batch.rows:
            if row.tokens != self.rows[row.id].history[:-1]:
                raise InvariantError(f"row {row.id!r} holds {len(row.tokens)} tokens, not its history but the pending token")
        for row in self.draft.rows if self.draft is not None else []:
            if row.tokens != self.rows[row.id].history[: len(row.tokens)] or len(row.tokens) >= len(self.rows[row.id].history):
                raise InvariantError(f"draft row {row.id!r} holds {len(row.tokens)} tokens, not a prefix of its history "
                                     "but the pending token")

    def _room(self, s: RowState) -> int:
        """Drafts row s may propose this round (never past its max_tokens)."""
        if not self.width:
            return 0
        return s.cap if s.remaining < 0 else max(0, min(s.cap, s.remaining - 1))

    def _draft_model(self, states: list, pending: list, widths: list) -> tuple:
        """Every row drafts by one-token forwards of the draft batch, in a fork.

        Returns (drafts per row, q [k_i, V] per row or None, the last forward's
        proposals per row, not fed: the settle feeds them if a row needs them)."""
        J = max(widths)
        drafts = [[] for _ in states]
        if J == 0:
            return drafts, [None] * len(states), None
        self._catch_up(states)
        qs = [[] for _ in states]
        live = [w > 0 for w in widths]
        greedy = all(isinstance(s.acceptor, GreedyMatch) for s in states)
        self.draft.fork()
        step = [[p] for p in pending]
        for j in range(J):
            lp = normalize(self.draft.forward(step)[:, -1])  # [B, V]
            if greedy:  # one argmax for the batch (the common case) instead of one graph per row
                toks = mx.argmax(lp, axis=-1)
                sure = mx.exp(mx.take_along_axis(lp, toks[:, None], axis=-1)[:, 0])
                dists = [None] * len(states)
            else:
                props = [s.acceptor.propose(lp[i]) for i, s in enumerate(states)]
                toks = mx.stack([t for t, _ in props])
                dists = [q for _, q in props]
                sure = mx.stack([q[t] if q is not None else mx.exp(lp[i, t]) for i, (t, q) in enumerate(props)])
            mx.eval(toks, sure, *[q for q in dists if q is not None])  # one sync per draft forward, all rows
            ids, sure = toks.tolist(), sure.tolist()
            for i in range(len(states)):
                if live[i]:
                    drafts[i].append(ids[i])
                    if dists[i] is not None:
                        qs[i].append(dists[i])
                    live[i] = len(drafts[i]) < widths[i] and sure[i] >= self.min_prob
            step = [[t] for t in ids]
            if not any(live):
                break
        return drafts, [mx.stack(q) if q else None for q in qs], step

    def _catch_up(self, states: list) -> None:
        """Feed each draft row the history it lags behind (plain steps skip the draft batch).

        One ragged forward in a branch, each row committing what it lacked: a
        row that lags nothing feeds a token it then drops (rows are never empty).
        """
        lags = [s.history[len(row.tokens) : -1] for s, row in zip(states, self.draft.rows)]
        if not any(lags):
            return
        self.draft.fork()
        self.draft.forward([lag or [0] for lag in lags])
        self.draft.commit([len(lag) for lag in lags])

    def _settle_draft(self, branch: bool, pending: list, drafts: list, keep: list, last) -> None:
        """Bring the draft batch to each row's history but the new pending token."""
        draft = self.draft
        if not draft.branch_open:  # no row drafted: the draft batch lags (caught up when rows draft again)
            return
        fed = draft.rows[0].branch_length  # every row fed as many
        if any(k > fed for k in keep):  # a row accepted all its drafts, the last of which is not fed yet
            draft.forward(last)
        draft.commit(keep)

    def _advance(self, s: RowState, drafts: list, n: int, nxt: int) -> None:
        emitted = drafts[:n] + [nxt]
        s.history.extend(emitted)
        if s.lookup is not None:
            s.lookup.extend(emitted)
        if s.remaining >= 0:
            s.remaining -= len(emitted)
        s.estimate.update(len(drafts), n, self.gate.decay if self.gate is not None else 1.0)
        if drafts:
            s.rounds += 1
            s.drafted += len(drafts)
            s.accepted += n
            s.per_round.append(n)
            # as stream_generate's adaptive width (a gated draft model sizes its own rounds)
            if not self.min_prob and self.gate is None:
                if n == 0:
                    s.cap = max(1, s.cap // 2)
                elif n == len(drafts):
                    s.cap = min(self.width, 2 * s.cap)
