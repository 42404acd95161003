"""The decoder: one forward per step for every row, speculative or plain, for one row or many.

    step():  settle the last round ─ every row drafts (its own widths: DraftPolicy)
             no row drafted -> forward [[y_i]]                          (no branch)
             else           -> fork, forward [[y_i] + drafts_i], accept per row  (the round stays open)
             each row emits drafts_i[:n_i] + [t_i]; t_i becomes its pending y_i
    settle(): the round's branch commits [1 + n_i] (or fewer for a row that took fewer tokens)

This is the only speculative round in segcache. A single sequence is a batch
of one: `stream_generate` and the server at `--decode-concurrency 1` run it
on `OneRow` (the Runtime itself, every layer kind, forwards outside branches
exactly mlx-lm's), the server's batches on a `BatchRuntime` (batch/rows.py).
Drafters propose for all rows at once (the protocol: drafting.py; prompt
lookup and a draft model on rows of its own: drafters.py; the MTP head:
mtp/drafter.py), and the decoder is handed the one the caller asked for
(`make_drafter`, drafters.py); acceptors decide per row (acceptors.py); how
far each row drafts is decided in one place (`DraftPolicy`, gate.py).

A row's runtime holds its history but the last emitted token (`pending`, fed
by the next step). The round stays open after a step until the next step,
an `add`, or the row's `release`, so a caller that delivers fewer tokens than
a row emitted (a stop string, a client gone: `settle({row: k})`) keeps
exactly those: a row holds prompt + what was delivered, never a draft past it.

Plain decoding (no drafter) pipelines one step ahead, as mlx-lm's generate_step:

    step t:   [commit 1 | forward [[y_i]]] ─ y'_i = choose(logits) lazily ─ fork ─
              forward [[y'_i]] (the lookahead) ─ async_eval ─ read y'_i ─ return them

so the next step's graph is built and queued before this step's tokens are
read. On a BatchRuntime the lookahead runs in a branch of one token per row
(a join rolls it back, one forward wasted; a leaving row takes it along); a
lone row feeds it outside any branch (nothing can join), as mlx-lm does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import mlx.core as mx

from ..acceptors import Acceptor, GreedyMatch
from ..errors import InvariantError, RowError
from ..processors import Processors, normalize
from ..runtime import Runtime
from ..stats import GenerationStats
from .drafting import Drafter, each_row, no_draft
from .gate import Acceptance, DraftPolicy, Gate
from .rows import OneRow
from .runtime import BatchRuntime
from .tree import takes_tree, verify_tree
from .tree_gate import TreeGate

# Plain steps whose captured forwards (an MTP head's hidden states) the drafter is given at once.
BACKLOG = 64


@dataclass
class RowState:
    """One row's generation state.

    Invariant (between steps, the round settled): the row holds exactly `history[:-1]`
    committed; history[-1] is `pending`, which a plain decoder's lookahead (when in flight)
    holds fed (in an open branch of one token on a batch, outside any on a lone row).
    With a draft model, the draft row holds a prefix of `history[:-1]`.
    """

    row_id: Hashable
    acceptor: Acceptor
    history: list
    cap: int = 0  # this row's current draft width (DraftPolicy.update)
    remaining: int = -1  # tokens it may still emit (-1: no limit)
    stats: GenerationStats = field(default_factory=GenerationStats)
    estimate: Acceptance = field(default_factory=Acceptance)  # the gate's view of this row
    processors: Processors | None = None  # its logits processors (penalties, a grammar), if any
    stops: frozenset = frozenset()  # tokens that end it (EOS): nothing is emitted past one
    # It emitted a stop token or its last token, or took fewer tokens than its last step
    # emitted: it must leave (release or remove) before the next step.
    finished: bool = False
    # Its first token, chosen from the logits it joined with (`add(logits=)`), in history as its
    # pending token: the next step emits it with no forward. None once emitted.
    first: list | None = None

    @property
    def drafted(self) -> int:
        return self.stats.drafted

    @property
    def accepted(self) -> int:
        return self.stats.accepted

    @property
    def per_round(self) -> list:
        """Drafts accepted in each round in which this row drafted."""
        return [a for d, a in zip(self.stats.drafted_per_round, self.stats.accepted_per_round) if d]


def _logprobs(states: list, logits: mx.array, draft) -> list:
    """Each row's logprobs over the positions it verifies, [1 + w_i, V]: its processors'
    output where it has some (position j as plain decoding after history + drafts[:j]),
    else the model's, normalized once for the batch."""
    plain = None
    out = []
    for i, (s, w) in enumerate(zip(states, draft.widths)):
        if s.processors is None:
            if plain is None:
                plain = normalize(logits)  # [B, S, V]
            out.append(plain[i, : 1 + w])
        else:
            drafts = draft.tokens[i, :w] if draft.lazy else draft.tokens[i]
            try:
                out.append(s.processors.process(logits[i, : 1 + w], s.history, drafts))
            except Exception as exc:
                raise RowError(s.row_id, exc) from exc
    return out


@dataclass
class _Round:
    """A verify round left open by `step`: the target's branch (and the draft's), and per row
    how many of the branch's tokens it keeps when settled ([y, d1..dn] = 1 + n unless it took
    fewer). Invariant: open iff the target's branch is open and no lookahead is in flight."""

    keep: dict  # row id -> tokens of its branch it keeps
    emitted: dict  # row id -> tokens it emitted in the round


class BatchDecoder:
    """Rows of one model generating together; one row on its own with `one_row`.

    Args:
        model: the target model.
        drafter: what proposes the drafts (`make_drafter`, drafters.py: prompt lookup,
            a draft model on rows of its own, the MTP head), or None: plain decoding.
        num_draft_tokens: drafts per row per round (0 without a drafter).
        recurrent_strategy: as for `Runtime` (the batch's; a lone row's runtime has its own).
        gate: True: each step's draft width is chosen by a `Gate` on step
            costs measured online (0 when speculation does not pay); a `Gate`:
            that one (e.g. on a fixed cost table); False: every row drafts its
            own width every step (ungated).
        pipeline: plain decoding only (no drafter): build and queue the next
            step's forward before reading this step's tokens (see the module
            docstring). False: one forward per step, synced before the next is built.
        one_row: hold at most one row, as the Runtime given to `add` itself (any
            layer kind; forks, commits and plain forwards in place). False: rows in
            a `BatchRuntime` (full attention, sliding window, Gated DeltaNet). A draft
            model's rows must be of the same kind (`make_drafter(one_row=)`).
        adaptive: without a gate or the drafter's `min_prob`, halve a row's width after
            a round that accepted nothing and double it after one that accepted all.
    """

    def __init__(self, model, *, drafter: Drafter | None = None, num_draft_tokens: int = 0,
                 recurrent_strategy: str = "auto", gate: bool | Gate = True, pipeline: bool = True,
                 one_row: bool = False, adaptive: bool = True):
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        if (drafter is not None) != (num_draft_tokens > 0):
            raise ValueError(f"a drafter needs num_draft_tokens >= 1 and num_draft_tokens needs a drafter; got "
                             f"{num_draft_tokens} and {'a' if drafter is not None else 'no'} drafter")
        self.model = model
        self.one_row = one_row
        self.batch = OneRow(model) if one_row else BatchRuntime(model, recurrent_strategy=recurrent_strategy)
        self.drafter = drafter
        self.mode = drafter.mode if drafter is not None else "plain"
        self.gate = None if not num_draft_tokens or gate is False else Gate() if gate is True else gate
        if self.gate is not None:
            self.gate.blockwise = self.gate.blockwise or drafter.blockwise
        self.policy = DraftPolicy(num_draft_tokens, gate=self.gate,
                                  min_prob=drafter.min_prob if drafter is not None else 0.0, adaptive=adaptive)
        self.width = num_draft_tokens
        # A gated decoder whose drafter proposes trees measures trees against chains (tree_gate.py:
        # the model's gate for this drafter and shape, kept for the process) and sets the drafter's
        # budget each speculative round; (budget, tokens emitted) of the last such round, recorded
        # with its cost.
        budget = getattr(drafter, "tree", 0)  # the drafters that propose trees take a budget
        self.trees = TreeGate.of(model, (drafter.mode, one_row), budget) if self.gate is not None and budget else None
        self._tree_round: tuple | None = None
        self.rows: dict[Hashable, RowState] = {}
        self.pipeline = pipeline and not num_draft_tokens
        # A gated drafter's plain steps pipeline too: the gate decides the next step's width
        # before this step's lookahead is launched (`_plan`), so a lookahead only runs ahead of a
        # step that is plain anyway and none is ever wasted on a switch to speculation. Only
        # where the drafter's offer is each row's room (not prompt lookup's match, which needs
        # the token the step emits).
        self._gated_pipeline = pipeline and self.gate is not None and drafter.offers_rooms
        # The lookahead in flight: (its logits [B, 1, V], the row ids it was built for, in order,
        # whether it was fed in a branch, what the drafter kept of its forward or None), or None.
        # Invariant: on a batch, not None iff the batch's branch is open and no round is; then
        # every row (a subset of those ids) has fed exactly its pending token in that branch.
        # With a drafter, the drafter has not seen that token's forward yet (it is handed the kept
        # part when the lookahead is committed).
        self._ahead: tuple | None = None
        self._round: _Round | None = None
        # The width the gate chose for the next step while planning this one's lookahead (None:
        # the next step asks the gate itself). Reset by a join (the rows change).
        self._planned: int | None = None
        # What the drafter captured from plain steps' forwards (an MTP head's hidden states, [B, n, H]
        # each, n steps), not handed to it yet, oldest first, every entry for the batch's rows in their
        # order (handed over before a row joins, before a step drafts, and at BACKLOG steps; cut to
        # the rows that stay when one leaves), so a run of plain steps touches the drafter once per
        # BACKLOG steps, not once per step.
        self._backlog: list = []
        self.last_width = 0  # the width the last step verified (0: a plain step)
        # Rows whose `first` token a step has not emitted yet (an upper bound: one that left
        # before it stays counted until the next step), so a step checks one int, not every row.
        self._firsts = 0
        # The last step's (rows, width, seconds by the gate's clock), not yet recorded: its
        # cost is recorded when the next step has settled its round. None: nothing pending.
        self._unrecorded: tuple | None = None

    def __len__(self) -> int:
        return len(self.rows)

    # -- rows come and go -------------------------------------------------------------

    def add(self, row_id, runtime: Runtime, pending: int | None, *, acceptor: Acceptor | None = None,
            max_tokens: int = -1, draft_runtime: Runtime | None = None,
            stats: GenerationStats | None = None, processors: Processors | None = None,
            stop_tokens=(), logits: mx.array | None = None) -> None:
        """Add a row whose `runtime` holds its prompt but the last token `pending`.

        With `logits` (and `pending` None) the runtime holds the whole prompt and `logits`
        [1, V] are its last position's (e.g. restored with it from the prefix store): the
        row's first token is chosen from them now, as a plain step would, and the next step
        emits it with no forward (a step with such rows emits only theirs).

        With a draft model, `draft_runtime` (of the draft model) holds a prefix
        of those tokens, e.g. resumed from the prefix store; the rest is fed to
        it when the row first drafts. None: a fresh draft runtime. `stats`: where the
        row's figures are counted (a new `GenerationStats` if None). `processors`:
        the row's logits processors, applied at every verified position as plain
        decoding would (the acceptor decides on their output). `stop_tokens`: a
        step emits nothing past one of them (the row is then finished).

        Raises:
            ValueError: the id is taken, a lone row's decoder holds one already, the
                runtime is of another model, or the draft runtime holds tokens that are
                not a prefix of the target's or is of another model; nothing changed.
        """
        if row_id in self.rows:
            raise ValueError(f"add({row_id!r}): a row with that id is already in the batch")
        if self.one_row and self.rows:
            raise ValueError(f"add({row_id!r}): this decoder holds one row, {next(iter(self.rows))!r}, already")
        if runtime.model is not self.model:
            raise ValueError(f"add({row_id!r}): the runtime is of another model")
        if draft_runtime is not None and not (self.drafter is not None and self.drafter.draft_runtimes):
            raise ValueError(f"add({row_id!r}): a draft runtime without a draft model")
        if (logits is None) == (pending is None):
            raise ValueError(f"add({row_id!r}): give the pending token or the last position's logits, one of them")
        acceptor = acceptor or GreedyMatch()
        processors = processors or None
        first = None
        if logits is not None:  # the first token, chosen before anything changes
            first = self._first(row_id, runtime.tokens, logits, acceptor, processors)
            pending = first[0]
        history = runtime.tokens + [pending]
        self._close()  # a row joins settled rows
        self._hand_over()
        self._drop_lookahead()  # ... that hold history[:-1] again (unless fed ahead outside a branch)
        self._planned = None
        if self.drafter is not None:
            self.drafter.add(row_id, history, runtime, draft_runtime)
        try:
            self.batch.join(row_id, runtime)
        except BaseException:
            if self.drafter is not None:
                self.drafter.remove(row_id)
            raise
        if stats is None:
            stats = GenerationStats(mode=self.mode)
        state = RowState(row_id, acceptor, history, self.width, max_tokens, stats, self.policy.new_estimate(),
                         processors=processors, stops=frozenset(stop_tokens))
        self.rows[row_id] = state
        if first is not None:  # emitted by the next step: counted as a plain step's token
            state.first = [first]
            self._firsts += 1
            if processors is not None:
                processors.advance([pending])
            if state.remaining >= 0:
                state.remaining -= 1
            stats.rounds += 1
            if self.drafter is not None:
                stats.drafted_per_round.append(0)
                stats.accepted_per_round.append(0)
            state.finished = pending in state.stops or state.remaining == 0
        if self._ahead is not None:
            self._feed_joiner(row_id, pending)

    @staticmethod
    def _first(row_id, prompt: list, logits: mx.array, acceptor: Acceptor, processors) -> tuple:
        """(token, logprobs [V], False): a row's first token from its prompt's last logits, as a plain
        step chooses it (its processors, then its acceptor's `sample`)."""
        logits = logits.reshape(1, -1)
        try:
            logprobs = normalize(logits) if processors is None else processors.process(logits, prompt)
            token = int(acceptor.sample(logprobs[0]).item())
        except Exception as exc:
            raise RowError(row_id, exc) from exc
        return token, logprobs[0], False

    def _feed_joiner(self, row_id, pending: int) -> None:
        """The other rows fed their pending tokens outside a branch (after a failed step): feed the
        joining row's alone (the others feed a token they drop) and add its logits to the lookahead's."""
        logits, built_for, _, kept = self._ahead
        ids = self.batch.ids
        self.batch.fork()
        try:
            out = self.batch.forward([[0]] * (len(ids) - 1) + [[pending]])
            mine = self.drafter.capture() if kept is not None else None
            self.batch.commit([0] * (len(ids) - 1) + [1])
        except BaseException:
            if self.batch.branch_open:
                self.batch.rollback()
            self.remove(row_id)
            raise
        index = mx.array([built_for.index(r) for r in ids[:-1]], dtype=mx.int32)
        if kept is not None:  # the drafter's part of the joiner's forward goes with the others'
            kept = mx.concatenate([kept[index], mine[-1:, -1:]], axis=0)
        self._ahead = (mx.concatenate([logits[index], out[-1:, -1:]], axis=0), ids, False, kept)

    def remove(self, row_id) -> None:
        """The row leaves (cancelled), its state dropped; the others keep theirs (and the round)."""
        if row_id not in self.rows:
            raise KeyError(f"no row {row_id!r} in the decoder (rows: {list(self.rows)})")
        self._cut_backlog(row_id)
        self.batch.leave(row_id)  # with an open round or lookahead, its branch goes with it
        if self.drafter is not None:
            self.drafter.remove(row_id)
        del self.rows[row_id]
        self._forget_if_empty()

    def release(self, row_id, *, pending: bool = True) -> Runtime:
        """The row leaves and comes back as a Runtime holding its history (what it took), all fed;
        with `pending=False`, without the pending token where no step fed it yet (e.g. to publish
        a row that ended on its end-of-sequence token; a lone row's plain step fed it already).

        On a lone row that is the Runtime given to `add` itself (with a draft model,
        the draft runtime given is left committed to a prefix of it); on a batch, a copy.
        """
        rt = self._settled(row_id, pending)
        self.remove(row_id)
        return rt

    def runtime(self, row_id) -> Runtime:
        """A copy of the row as a single-sequence Runtime holding its history, all fed (e.g. to publish it)."""
        return self._settled(row_id, True, copy=True)

    def held(self, row_id) -> Runtime:
        """A copy of the row as a single-sequence Runtime holding its history but the pending token
        (what the steps committed), e.g. to publish a finished row without its end-of-sequence token.

        Raises:
            ValueError: the row fed its pending token ahead outside a branch (a lone row, or a
                batch after a failed step), so its state without it is gone.
        """
        rt = self._settled(row_id, False, copy=True)
        if rt.offset == len(self.rows[row_id].history):
            raise ValueError(f"held({row_id!r}): the row fed its pending token ahead, outside a branch")
        return rt

    def _settled(self, row_id, pending: bool, copy: bool = False) -> Runtime:
        """The row's settled state as a Runtime (the decoder's rows unchanged unless a lone
        row's open round is settled in place); fed its pending token if `pending`."""
        history = self.rows[row_id].history
        keep = None  # a round left open: the tokens of its branch the row keeps
        if self.one_row:
            if self._round is not None:
                self._close()
            rt = self.batch.copy_row(row_id).to_runtime(row_id) if copy else self.batch.to_runtime(row_id)
        else:
            one = self.batch.copy_row(row_id)
            if self._round is not None:
                keep = self._round.keep[row_id]
                one.commit([keep])
            elif self._ahead is not None and self._ahead[2]:  # the pending token fed in a branch
                one.commit([1]) if pending else one.rollback()
            rt = one.to_runtime(row_id)
        # Released (not a copy): a drafter that keeps state over the target's positions (the MTP
        # head) hands the row's back to its runtime, so it is published and a next turn resumes it.
        # An optional hook: a drafter without one keeps nothing past the row.
        hand_back = None if copy or self.drafter is None else getattr(self.drafter, "hand_back", None)
        if hand_back is not None:
            self._hand_over()  # the plain steps' states it has not been given yet (none with a round open)
            hand_back(row_id, rt, history, keep, self._fed_ahead(row_id, rt, history))
        if pending and rt.offset < len(history):
            rt.forward(history[rt.offset:])  # the pending token, never fed by a step
        return rt

    def _fed_ahead(self, row_id, rt: Runtime, history: list):
        """What the drafter captured of a lookahead that fed `rt` the row's pending token ([1, 1, ...]),
        None when none did (or the drafter captured nothing)."""
        if self._ahead is None or self._ahead[3] is None or rt.offset != len(history):
            return None
        built_for, kept = self._ahead[1], self._ahead[3]
        i = built_for.index(row_id)
        return kept[i : i + 1, -1:]

    def _forget_if_empty(self) -> None:
        if not self.rows:
            self._drop_lookahead()
            self._ahead = None
            self._backlog = []
            if self._round is not None:
                self._round = None
                if self.batch.branch_open:
                    self.batch.rollback()
                if self.drafter is not None:
                    self.drafter.rollback()

    # -- steps ------------------------------------------------------------------------

    def settle(self, taken: dict) -> None:
        """Say how many of the last step's tokens some rows took (rows not named took all).

        A row that took fewer than it emitted (a stop string, a client gone) keeps
        exactly those; it is finished and must leave (`release` or `remove`) before the
        next step. A plain step's token was fed ahead, so it is always taken.

        Raises:
            ValueError: an unknown row, or a count outside 0..what the row emitted; nothing changed.
        """
        for rid, k in taken.items():
            if rid not in self.rows:
                raise ValueError(f"settle(): no row {rid!r}")
            emitted = self._round.emitted.get(rid, 1) if self._round is not None else 1
            low = 0 if self._round is not None and rid in self._round.emitted else 1
            if not isinstance(k, int) or not low <= k <= emitted:
                raise ValueError(f"settle(): row {rid!r} took {k!r} tokens; it emitted {emitted} "
                                 f"(a count in {low}..{emitted})")
        for rid, k in taken.items():
            emitted = self._round.emitted[rid] if self._round is not None else 1
            if k < emitted:
                state = self.rows[rid]
                del state.history[len(state.history) - emitted + k :]
                if state.processors is not None:
                    state.processors.rollback(emitted - k)
                self._round.keep[rid] = k
                state.finished = True

    def step(self) -> dict:
        """One forward for every row; returns {row id: [(token, logprobs [V], from_draft), ...]}.

        Raises:
            ValueError: a finished row (one that took fewer tokens than it was given) is still here.
        """
        if self._firsts:  # first tokens chosen from the logits their rows joined with: no forward
            ready = {rid: s.first for rid, s in self.rows.items() if s.first is not None}
            for rid in ready:
                self.rows[rid].first = None
            self._firsts = 0
            return ready
        finished = [rid for rid, s in self.rows.items() if s.finished]
        if finished:
            raise ValueError(f"step(): rows {finished} are finished (a stop token, their last token, or fewer "
                             "tokens taken than emitted): release or remove them first")
        gate, drafter = self.gate, self.drafter
        c0 = gate.clock() if gate is not None else 0.0  # the gate's own clock (wall time by default)
        tic = time.perf_counter()
        self._close()
        commit_time = time.perf_counter() - tic
        g0 = c0
        if gate is not None:
            # the last step's cost includes settling its round (the commit, the drafter's close)
            last, self._unrecorded = self._unrecorded, None
            g0 = gate.clock()
            if last is not None:
                gate.record(last[0], last[1], last[2] + g0 - c0)
            spec, self._tree_round = self._tree_round, None
            if spec is not None and last is not None:
                self.trees.record(*spec, last[2] + g0 - c0)
        planned, self._planned = self._planned, None
        if self.pipeline or (self._gated_pipeline and (planned == 0 or self._ahead is not None)):
            return self._pipelined_step(g0)
        ids = self.batch.ids
        states = [self.rows[r] for r in ids]
        if not states:
            return {}
        pending = [s.history[-1] for s in states]
        t0 = time.perf_counter()
        draft, branch = no_draft(len(states)), False
        widths = None
        if drafter is not None:
            self._hand_over()  # the drafter sees every token before it offers
            rooms = [self.policy.room(s.cap, s.remaining) for s in states]
            avail = drafter.offer(states, rooms) if any(rooms) else rooms
            if planned is not None:  # chosen while planning the last step
                widths = [min(a, planned) for a in avail]
            else:
                widths = self.policy.choose(avail, [s.estimate for s in states])
            if self._gated_pipeline and not any(widths):  # a plain step: pipelined
                return self._pipelined_step(g0)
        try:
            if widths is not None and any(widths):
                budget = self.trees.choose() if self.trees is not None else None
                if budget is not None:
                    drafter.tree = budget
                prepare = getattr(drafter, "prepare", None)
                if prepare is not None:  # rows brought up to date (a draft prefill): not the round's cost
                    p0 = gate.clock() if gate is not None else 0.0
                    prepare(states)
                    if gate is not None:
                        g0 += gate.clock() - p0
                draft = drafter.draft(states, widths)
            t1 = time.perf_counter()
            branch = bool(draft)
            if branch:
                self.batch.fork()
            tree_round = branch and takes_tree(self.batch, states, draft)
            if tree_round:  # a tree round, kept as its paths (batch/tree.py)
                rows, proposals, drafts, accepted = verify_tree(self.batch, states, pending, draft)
            else:
                logits = self.batch.forward(draft.verify_input(pending))  # raw: processors need the model's own
                rows = _logprobs(states, logits, draft)
                choices = each_row(states, lambda i, s: s.acceptor.choices(rows[i]))
                mx.eval(draft.tokens if draft.lazy else (), rows, *[c for cs in choices for c in cs])  # one sync
                proposals = draft.proposals()
                drafts = [p[:w] for p, w in zip(proposals, draft.widths)]
                # every row's acceptance before any row's state moves: a failure leaves all as they were
                accepted = each_row(states, lambda i, s: s.acceptor.accept(rows[i], drafts[i], draft.q[i],
                                                                         choices[i]))
                if branch and draft.lazy:  # the verify input was an unread array: its ids, now read
                    self.batch.fill([[p] + d for p, d in zip(pending, proposals)])
        except BaseException:  # a failed speculative step changes nothing (a plain one has fed y_i)
            if self.batch.branch_open:
                self.batch.rollback()
            if drafter is not None:
                drafter.rollback()
            raise
        t2 = time.perf_counter()
        out, keep = {}, {}
        for rid, s, d, lp, (n, nxt) in zip(ids, states, drafts, rows, accepted):
            emitted = self._advance(s, d, n, nxt, branch)
            out[rid] = [(t, lp[j], j < n) for j, t in enumerate(emitted)]
            keep[rid] = len(emitted)
            st = s.stats
            st.draft_time += t1 - t0
            st.verify_time += t2 - t1
            st.commit_time += commit_time
        if branch and self.trees is not None:
            self._tree_round = (self.trees.budget if tree_round else 0, sum(keep.values()))
        if branch:
            self._round = _Round(keep=keep, emitted=dict(keep))
            if drafter is not None:
                drafter.fill(proposals)
        elif drafter is not None:
            drafter.close(states, [keep[r] for r in ids])
        self.last_width = max(draft.widths, default=0)
        self._measured(len(states), g0)
        return out

    def _measured(self, rows: int, g0: float) -> None:
        """The step that began at g0 (the gate's clock) ends: recorded for the gate at the next
        step, once its round is settled (the settling is part of its cost)."""
        if self.gate is not None:
            self._unrecorded = (rows, self.last_width, self.gate.clock() - g0)

    def _close(self) -> None:
        """Settle the open round: each row keeps what it took (every token unless `settle` said fewer)."""
        if self._round is not None:
            ids = self.batch.ids
            keep = [self._round.keep[r] for r in ids]
            self._round = None
            self.batch.commit(keep)
            if self.drafter is not None:
                self.drafter.close([self.rows[r] for r in ids], keep)

    def _plan(self, states: list) -> int:
        """The next step's width, chosen now (before this step's lookahead is launched): what the
        gate gives rows that may draft their whole room after this step's token."""
        rooms = [self.policy.room(s.cap, s.remaining - 1 if s.remaining > 0 else s.remaining) for s in states]
        if not any(rooms):
            return 0
        return self.gate.choose(rooms, [s.estimate for s in states])

    def _pipelined_step(self, g0: float = 0.0) -> dict:
        """A plain step: take the lookahead's logits (or forward the pending tokens), choose, launch the
        next (with a gated drafter, only when the gate plans a plain step next)."""
        ids = self.batch.ids
        states = [self.rows[r] for r in ids]
        if not states:
            return {}
        drafter = None if self.pipeline else self.drafter
        old = self._ahead
        launched = False
        try:
            if old is None:
                logits = self.batch.forward([[s.history[-1]] for s in states])[:, -1]
                if drafter is not None:  # it sees the forward that fed the pending tokens
                    self._keep_for_drafter(drafter.capture(), ids)
            else:
                logits, built_for, in_branch, kept = old
                if in_branch:  # each row's pending token, fed by the lookahead: committed now
                    self.batch.commit([1] * len(states))
                if kept is not None:
                    self._keep_for_drafter(kept, built_for)
                self._ahead = old = (logits, built_for, False, None)
                logits = logits[:, -1]
                if built_for != ids:  # rows left since: their logits rows go too
                    logits = logits[mx.array([built_for.index(r) for r in ids], dtype=mx.int32)]
            if any(s.processors is not None for s in states):
                logprobs = mx.concatenate(each_row(states, lambda i, s: normalize(logits[i : i + 1])
                                                   if s.processors is None
                                                   else s.processors.process(logits[i : i + 1], s.history)))
            else:
                logprobs = normalize(logits)  # [B, V]
            if all(isinstance(s.acceptor, GreedyMatch) for s in states):  # one argmax for the batch
                chosen = mx.argmax(logprobs, axis=-1)
            else:  # each row's own rule, in row order (a seeded sampler draws as unpipelined)
                chosen = mx.stack(each_row(states, lambda i, s: s.acceptor.sample(logprobs[i])))
            mx.async_eval(chosen, logprobs)
            in_branch = self.batch.lookahead_in_branch
            ahead = kept = None
            plan = self._plan(states) if drafter is not None else 0
            # queue the next forward now, unless every row ends here and it could not be dropped,
            # or the next step drafts (its verify feeds the pending tokens)
            if plan == 0 and (in_branch or any(s.remaining != 1 for s in states)):
                if in_branch:
                    self.batch.fork()
                launched = True
                ahead = self.batch.forward(chosen.reshape(-1, 1))  # built while the device works on `chosen`
                if drafter is not None:
                    kept = drafter.capture()
                mx.async_eval(ahead)
            toks = chosen.tolist()
            if ahead is not None and in_branch:
                self.batch.fill([[t] for t in toks])
        except BaseException:
            # The new lookahead never reaches committed state; the old one's logits stay valid
            # for the pending tokens its forward fed (committed by now, or fed outside a branch).
            if launched and self.batch.branch_open:
                self.batch.rollback()
            self._ahead = old
            raise
        self._ahead = None if ahead is None else (ahead, ids, in_branch, kept)
        if drafter is not None:
            self._planned = plan
        out = {}
        for rid, s, t, i in zip(ids, states, toks, range(len(ids))):
            out[rid] = [(t, logprobs[i], False)]
            self._advance(s, [], 0, t, False)
        self.last_width = 0
        if old is None or launched:  # one that only read its lookahead and launched none timed 0.2x a plain step
            self._measured(len(states), g0)
        return out

    def _keep_for_drafter(self, captured, built_for: list) -> None:
        """A plain forward fed every row its pending token: what the drafter captured of it (None:
        nothing) joins the backlog, cut to the batch's rows (rows that left since dropped)."""
        if captured is None:
            return
        ids = self.batch.ids
        if built_for != ids:
            captured = captured[mx.array([built_for.index(r) for r in ids], dtype=mx.int32)]
        self._backlog.append(captured)
        if sum(kept.shape[1] for kept in self._backlog) >= BACKLOG:
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the drafter the backlog of plain steps in one call (each row kept one token per step)."""
        if not self._backlog:
            return
        kept, self._backlog = self._backlog, []
        ids = self.batch.ids
        fed = kept[0] if len(kept) == 1 else mx.concatenate(kept, axis=1)
        self.drafter.close([self.rows[r] for r in ids], [fed.shape[1]] * len(ids), (fed, ids))

    def _cut_backlog(self, row_id) -> None:
        """Before `row_id` leaves: the backlog without its row (the others' states stay unfed; handing
        them over here made every leaving row pay a head call for the rows that stay)."""
        if not self._backlog:
            return
        ids = self.batch.ids
        others = [i for i, r in enumerate(ids) if r != row_id]
        fed = self._backlog[0] if len(self._backlog) == 1 else mx.concatenate(self._backlog, axis=1)
        self._backlog = [fed[mx.array(others, dtype=mx.int32)]] if others else []

    def _drop_lookahead(self) -> None:
        """Before a join: roll a lookahead in a branch back (the rows hold history[:-1] again; its
        forward is wasted). One fed outside a branch (a lone row, or a batch after a failed step
        committed it) stays: its rows hold their pending tokens and its logits stay valid."""
        if self._ahead is not None and self._ahead[2]:
            self._ahead = None
            self.batch.rollback()

    def _advance(self, s: RowState, drafts: list, n: int, nxt: int, branch: bool) -> list:
        """Move a row past the step: what it emitted (cut after a stop token), its stats, cap
        and processors; returns the tokens it emitted."""
        emitted = drafts[:n] + [nxt]
        stop = next((j for j, t in enumerate(emitted) if t in s.stops), None)
        if stop is not None:
            emitted = emitted[: stop + 1]
        s.history.extend(emitted)
        if s.processors is not None:
            s.processors.advance(emitted)
        if self.drafter is not None:
            self.drafter.extend(s.row_id, emitted)
        if s.remaining >= 0:
            s.remaining -= len(emitted)
        st = s.stats
        st.rounds += 1
        if self.drafter is not None:
            st.drafted += len(drafts)
            st.accepted += n
            st.drafted_per_round.append(len(drafts))
            st.accepted_per_round.append(n)
            s.cap = self.policy.update(s.cap, s.estimate, len(drafts), n)
        if stop is not None or s.remaining == 0:
            s.finished = True
        return emitted

    # -- invariants -------------------------------------------------------------------

    def check(self) -> None:
        """Both batches' invariants; each row holding its history but the pending token (the draft: a
        prefix), and with a lookahead in flight, the pending token fed (on a batch in a branch of one
        token per row). An open round: each row's branch holds its pending token and drafts."""
        self.batch.check()
        self._hand_over()  # the drafter's invariants count every token it was given
        if set(self.rows) != set(self.batch.ids):
            raise InvariantError(f"decoder rows {list(self.rows)} but batch rows {self.batch.ids}")
        if self._ahead is not None and self._round is not None:
            raise InvariantError("a lookahead and a verify round in flight at once")
        ahead_open = self._ahead is not None and self._ahead[2]
        if (self._round is not None or ahead_open) != self.batch.branch_open:
            raise InvariantError(f"round open: {self._round is not None}, lookahead in a branch: {ahead_open}, "
                                 f"branch open: {self.batch.branch_open}")
        if self._ahead is not None:
            logits, launched = self._ahead[:2]
            if (not (self.pipeline or self._gated_pipeline) or logits.shape[0] != len(launched)
                    or any(r not in launched for r in self.batch.ids)):
                raise InvariantError(f"lookahead built for rows {launched}, batch rows {self.batch.ids}")
        if self.drafter is not None:
            self.drafter.check([self.rows[r] for r in self.batch.ids], settled=self._round is None)
        for s in self.rows.values():
            s.estimate.check()
        if self.trees is not None:
            self.trees.check()
        if self.gate is not None:
            self.gate.check()
        for rid in self.batch.ids:
            s = self.rows[rid]
            held = self.batch.tokens(rid)
            if self._round is not None:
                keep, emitted = self._round.keep[rid], self._round.emitted[rid]
                base = len(s.history) - keep - 1  # tokens committed before the round
                if held[:base] != s.history[:base] or held[base : base + keep] != s.history[base : base + keep]:
                    raise InvariantError(f"row {rid!r}: its round's branch does not begin with its history")
                if keep > emitted or (not s.finished and keep != emitted):
                    raise InvariantError(f"row {rid!r} keeps {keep} of the {emitted} tokens it emitted")
                continue
            want = s.history if self._ahead is not None else s.history[:-1]
            if held != want:
                raise InvariantError(f"row {rid!r} holds {len(held)} tokens, not its history"
                                     + (" (its pending token fed ahead)" if self._ahead is not None else
                                        " but the pending token"))
