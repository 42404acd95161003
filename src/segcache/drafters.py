"""The drafters of a speculative round, and the factory that makes the one a caller asks for.

Two drafters here: n-gram lookup in each row's prompt + output (`Lookup`), and
a draft model on rows of its own (`DraftModel`: a `BatchRuntime` of the draft,
or the draft's `Runtime` as one row); the third is the target's MTP head
(mtp/drafter.py). Each speaks the decoder's protocol (batch/drafting.py) and
never touches the target. `make_drafter` turns what a caller asked for (a draft
model, an MTP head, prompt lookup) into one of them; the decoder is handed it:

    BatchDecoder(model, drafter=make_drafter(model, draft_model=draft), num_draft_tokens=4)
    make_decoder(model, draft_model=draft, num_draft_tokens=4)       the same, in one call
"""

from __future__ import annotations


import mlx.core as mx

from .acceptors import GreedyMatch
from .batch.decoder import BatchDecoder
from .batch.drafting import TOP, Draft, Drafter, each_row, no_draft, tree_of_leaves
from .batch.rows import OneRow
from .batch.runtime import BatchRuntime
from .errors import InvariantError
from .lookup import PromptLookup
from .dflash.drafter import DFlash
from .dflash.with_lookup import WithLookup
from .mtp.drafter import MTP
from .processors import normalize
from .runtime import Runtime

# A lag (tokens the target holds that the draft has not seen) up to this long
# rides along in the draft's first forward of a round; longer lags are fed
# outside the fork first, so a branch never holds a long prefill.
GAP_IN_FORK = 8


class Lookup:
    """Prompt lookup: each row's drafts copied from the last earlier match of its history's suffix.

    With `tree` > 0 every drafting row also gets a tree of up to `tree` draft nodes, the
    continuations of several earlier matches (`PromptLookup.draft_tree`), as deep as its
    width; its chain is the tree's first branch (docs/tree.md). The decoder's tree gate may
    lower `tree` for a step (0: chains), within the budget it was built with.
    """

    mode = "lookup"
    min_prob = 0.0
    draft_runtimes = False
    offers_rooms = False  # the match of the token just emitted
    blockwise = False

    def __init__(self, tree: int = 0):
        if not isinstance(tree, int) or isinstance(tree, bool) or tree < 0:
            raise ValueError(f"draft_tree must be an int >= 0 (draft nodes per round), got {tree!r}")
        self.tree = tree
        self.index: dict = {}  # row id -> PromptLookup of its history
        self._offered: list = []

    def add(self, row_id, history, runtime, draft_runtime):
        if draft_runtime is not None:
            raise ValueError(f"add({row_id!r}): a draft runtime without a draft model")
        lookup = PromptLookup()
        known = len(history) - history[::-1].index(None) if None in history else 0
        lookup.extend(history[known:])  # ids fed without forward (None) are never matched
        self.index[row_id] = lookup

    def remove(self, row_id):
        self.index.pop(row_id, None)

    def offer(self, states, rooms):
        self._offered = [self.index[s.row_id].draft(w) if w > 0 else [] for s, w in zip(states, rooms)]
        return [len(d) for d in self._offered]

    def draft(self, states, widths):
        trees = None
        if self.tree and any(widths):
            trees = [self.index[s.row_id].draft_tree(w, self.tree) if w else None for s, w in zip(states, widths)]
        return Draft([d[:w] for d, w in zip(self._offered, widths)], list(widths), [None] * len(states), trees)

    def fill(self, proposals):
        pass

    def capture(self):
        return None

    def close(self, states, keep, fed=None):
        pass

    def rollback(self):
        pass

    def extend(self, row_id, tokens):
        self.index[row_id].extend(tokens)

    def check(self, states, settled):
        if set(self.index) != {s.row_id for s in states}:
            raise InvariantError(f"lookup rows {list(self.index)} but target rows {[s.row_id for s in states]}")


class DraftModel:
    """A draft model on rows of its own, forked for each round:

        draft rows:   fork ─ [lag_i + [y_i]] ─ [d1_i] ... ─ [d(J-1)_i] ─┐      commit [lag_i + kept_i]
        target rows:                                          fork ─ [y_i, d1_i..dJ_i] ─ commit [1 + n_i]

    Every draft forward is one token per row past the first, one read per draft
    forward for all rows while some row may stop early (`min_prob`), none
    without (the chain stays lazy and is evaluated with the verify). Row i
    keeps its first widths[i] proposals, or up to and including the first its
    draft model gives less than `min_prob`. The last proposals are never fed:
    a row that accepts all of them lags by one, caught up next round.

    Catching up: a joining row's draft runtime holds a prefix of its tokens
    (none, or what the prefix store restored) and is fed the rest only when the
    row first drafts, so a batch the gate keeps on plain steps never pays a
    draft prefill. Rows that lag the target by the same few tokens (a lone row
    after a round) feed them in the round's first forward; longer lags are fed
    outside the fork first, rows of different lags right-padded in one forward
    per `prefill_step` tokens (`forward_padded`), or, where some row lags
    nothing, in a ragged forward in a branch, each committing what it lacked.

    With `tree` > 0 greedy rows also get a tree each (docs/tree.md): its chain, and
    up to `tree` nodes in all, the draft's next most likely tokens at its uncertain
    positions as leaves beside the chain's (best first by the draft's probability of
    reaching them), at no extra draft forward. A round whose accepted path leaves the
    chain commits the draft rows only as far as they agree with it.

    Args:
        rows: the draft model's rows (a `BatchRuntime`, or a `OneRow`).
        min_prob: see above (0: every row drafts its full width).
        prefill_step: tokens per row per forward when lagging draft rows are brought up
            to the target's tokens.
        tree: draft nodes per round of a greedy row's tree (0: chains; the decoder's tree gate
            may lower it for a step).
    """

    mode = "draft"
    draft_runtimes = True
    offers_rooms = True
    blockwise = False  # one draft forward per width

    def __init__(self, rows, *, min_prob: float = 0.0, prefill_step: int = 2048, tree: int = 0):
        self.rows = rows
        self.min_prob = min_prob
        self.prefill_step = prefill_step
        self.tree = tree
        self._proposals: list | None = None  # the open round's proposals as read (fill)
        # The open round: per row the lag fed before its pending token, and the draft
        # forwards run (row i's branch holds lag_i + forwards tokens). None: no round.
        self._round: tuple[list[int], int] | None = None

    @property
    def model(self):
        return self.rows.model

    def add(self, row_id, history, runtime, draft_runtime):
        drt = draft_runtime if draft_runtime is not None else Runtime(self.rows.model)
        if drt.model is not self.rows.model:
            raise ValueError(f"add({row_id!r}): the draft runtime is not of the draft model")
        held, want = drt.tokens, history[:-1]
        # ids fed without forward (None, e.g. both loaded from one prompt cache file) may be held
        # by both; only those the draft must still be fed need be known
        if len(held) > len(want) or held != want[: len(held)] or None in want[len(held):]:
            raise ValueError(
                f"add({row_id!r}): the draft runtime holds {len(held)} tokens that are not a prefix of "
                f"the target runtime's {len(want)} tokens, or the target holds tokens fed without "
                "Runtime.forward (ids unknown) that the draft runtime has not seen"
            )
        # the rest is fed when the row first drafts (`_catch_up`), with every other row that lags
        # in one forward, or never where the gate keeps plain steps (on a CPU, where a draft
        # seldom pays, a joining prompt's draft prefill was a cost of every request)
        self.rows.join(row_id, drt)

    def remove(self, row_id):
        self.rows.leave(row_id)

    def offer(self, states, rooms):
        return list(rooms)

    def prepare(self, states) -> None:
        """Feed the draft rows the lags that do not ride along in a round's first forward (a row that
        joined holding a prefix: its draft prefill, paid once and never in a round's timing)."""
        self._catch_up(states)

    def draft(self, states, widths):
        J = max(widths, default=0)
        if J == 0:
            return no_draft(len(states))
        lags = self._catch_up(states)
        self.rows.fork()
        pending = [s.history[-1] for s in states]
        greedy = all(isinstance(s.acceptor, GreedyMatch) for s in states)
        gated = self.min_prob > 0
        step = [lag + [p] for lag, p in zip(lags, pending)]
        live = [w > 0 for w in widths]
        kept = [0] * len(states)
        chain, qs, tops = [], [[] for _ in states], []
        branching = self.tree > 0 and greedy
        processed = any(s.processors is not None for s in states)
        for j in range(J):
            raw = self.rows.forward(step)[:, -1]  # [B, V]
            if processed:  # a row's processors shape its drafts as they will shape the verify
                so_far = mx.stack(chain, axis=1) if chain else None
                lp = mx.concatenate(each_row(states, lambda i, s: normalize(raw[i : i + 1]) if s.processors is None
                                             else s.processors.process_next(raw[i], s.history,
                                                                            () if so_far is None else so_far[i])))
            else:
                lp = normalize(raw)
            if greedy:  # one argmax for the batch instead of one graph per row
                toks = mx.argmax(lp, axis=-1)
                dists = None
            else:
                props = each_row(states, lambda i, s: s.acceptor.propose(lp[i]))
                toks = mx.stack([t for t, _ in props])
                dists = [q for _, q in props]
            chain.append(toks)
            if branching:  # the draft's TOP most likely tokens here and their logprobs, read with the chain
                order = mx.argsort(-lp, axis=-1)[:, :TOP]
                tops.append((order, mx.take_along_axis(lp, order, axis=-1)))
            for i in range(len(states)):
                if live[i]:
                    kept[i] += 1
                    if dists is not None and dists[i] is not None:
                        qs[i].append(dists[i])
                    live[i] = kept[i] < widths[i]
            if gated and j + 1 < J and any(live):
                # how sure the draft is of each row's token: under the distribution it was
                # drawn from (a Sampler's), else the model's own; one read for every row
                if dists is None:
                    sure = mx.exp(mx.take_along_axis(lp, toks[:, None], axis=-1)[:, 0])
                else:
                    sure = mx.stack([mx.exp(lp[i, t]) if q is None else q[t] for i, (q, t) in enumerate(zip(dists, toks))])
                for i, p in enumerate(sure.tolist()):
                    live[i] = live[i] and p >= self.min_prob
            if not any(live):
                break
            step = toks[:, None]
        self._round = ([len(lag) for lag in lags], len(chain))
        tokens = mx.stack(chain, axis=1)  # [B, J']
        if branching:
            mx.eval(tokens, tops)
            trees = [tree_of_leaves(tokens[i, : kept[i]].tolist(), [(o[i], lp[i]) for o, lp in tops], self.tree)
                     if kept[i] else None for i in range(len(states))]
            return Draft(tokens, kept, [None] * len(states), trees)
        mx.async_eval(tokens)  # start on the drafts not read yet while the verify graph is built
        return Draft(tokens, kept, [mx.stack(q) if q else None for q in qs])

    def fill(self, proposals):
        self._proposals = proposals
        forwards = self._round[1]
        if forwards > 1:  # the proposals fed as arrays (all but the last forward's) get their ids
            self.rows.fill([p[: forwards - 1] for p in proposals])

    def capture(self):
        return None

    def close(self, states, keep, fed=None):
        if self._round is None:  # nothing was drafted: the draft rows lag (caught up when they draft again)
            return
        (lags, forwards), self._round = self._round, None
        proposals, self._proposals = self._proposals, None
        if proposals is not None:  # a tree's path may leave the chain: keep only what agrees with it
            keep = [min(k, 1 + _agree(s.history[len(s.history) - k : -1], p))
                    for s, k, p in zip(states, keep, proposals)]
        self.rows.commit([lag + min(forwards, k) for lag, k in zip(lags, keep)])

    def rollback(self):
        if self.rows.branch_open:
            self.rows.rollback()
        self._round = self._proposals = None

    def extend(self, row_id, tokens):
        pass  # the next round's catch-up feeds them

    def check(self, states, settled):
        """The draft rows: the target's, in its order, each (between rounds) holding a prefix of its
        history but the pending token."""
        self.rows.check()
        ids = [s.row_id for s in states]
        if self.rows.ids != ids:
            raise InvariantError(f"draft rows {self.rows.ids} but target rows {ids}")
        for s in states if settled else ():
            held = self.rows.tokens(s.row_id)
            if held != s.history[: len(held)] or len(held) >= len(s.history):
                raise InvariantError(f"draft row {s.row_id!r} holds {len(held)} tokens, not a prefix of its "
                                     "history but the pending token")

    def _catch_up(self, states) -> list[list[int]]:
        """Feed the draft rows what they lack but what rides along in the first forward.

        Rows lagging by one short count ride along; otherwise the lags are fed first, in
        forwards of at most `prefill_step` tokens per row: outside any branch while every row
        still lags (rows of different lengths right-padded, `forward_padded`), else in a
        branch where each row commits what it lacked (a row that lags nothing feeds a token
        it then drops: rows are never empty)."""
        rows = self.rows
        lags = [s.history[n:-1] for s, n in zip(states, rows.lengths)]
        if len({len(lag) for lag in lags}) == 1 and len(lags[0]) <= GAP_IN_FORK:
            return lags
        step = self.prefill_step
        while any(lags):
            pieces = [lag[:step] for lag in lags]
            one_length = len({len(p) for p in pieces}) == 1
            if all(pieces) and (one_length or rows.pads_rows):
                mx.eval(rows.forward(pieces) if one_length else rows.forward_padded(pieces))
            else:
                rows.fork()
                rows.forward([p or [0] for p in pieces])
                rows.commit([len(p) for p in pieces])
            lags = [lag[len(p):] for lag, p in zip(lags, pieces)]
        return [[] for _ in lags]


def _agree(kept: list, proposals: list) -> int:
    """How many of `kept` (the target's tokens after the pending one) equal the proposals'."""
    n = 0
    while n < min(len(kept), len(proposals)) and kept[n] == proposals[n]:
        n += 1
    return n


def make_drafter(model, *, draft_model=None, mtp=None, prompt_lookup: bool = False, draft_min_prob: float = 0.0,
                 prefill_step: int = 2048, one_row: bool = False, recurrent_strategy: str = "auto",
                 draft_tree: int = 0, dflash=None, block_size: int | None = None) -> Drafter | None:
    """The drafter for what the caller asked: a draft model, the target's MTP head, prompt lookup, or none.

    Args:
        model: the target model (the MTP head must be bound to it).
        draft_model: a draft model sharing the target's vocabulary (dense or hybrid), on
            rows of its own: the draft's Runtime itself with `one_row`, else a `BatchRuntime`
            (`recurrent_strategy` as for `Runtime`).
        mtp: the target's `MTPHead`.
        dflash: a DFlash drafter bound to the target (`segcache.dflash.load_dflash`); `block_size`
            overrides its config's positions per block (block_size - 1 drafts at most).
        prompt_lookup: n-gram lookup in each row's prompt and output; with `dflash` too, each row
            verifies per round the proposal it expects more of (`WithLookup`, dflash/with_lookup.py).
        draft_min_prob: with a draft model, a row drafts no further after a draft the draft
            model gives less than this (that draft is still verified).
        prefill_step: tokens per forward when a joining row's draft state is brought up to
            the target's tokens.
        draft_tree: with prompt lookup, a draft model or the MTP head, draft nodes per round of each row's
            tree (docs/tree.md); 0: chains only.

    Raises:
        ValueError: two drafters asked for (prompt lookup goes with a DFlash drafter only), a
            `draft_min_prob` outside [0, 1], a head of another model, or `draft_tree` without a drafter.
    """
    if sum(d is not None for d in (draft_model, mtp, dflash)) > 1:
        raise ValueError("choose one drafter: a draft model, the MTP head or a DFlash drafter")
    if prompt_lookup and (draft_model is not None or mtp is not None):
        raise ValueError("prompt lookup goes beside a DFlash drafter only, not a draft model or the MTP head")
    if dflash is not None:
        if draft_tree:
            raise ValueError(f"draft_tree={draft_tree}: a DFlash drafter proposes one block (a chain); use draft_tree=0")
        if dflash.model is not model:
            raise ValueError("the DFlash drafter is bound to another model than this decoder's target")
        blocks = DFlash(dflash, block_size=block_size, prefill_step=prefill_step)
        return WithLookup(Lookup(), blocks) if prompt_lookup else blocks
    if draft_tree and not (prompt_lookup or draft_model is not None or mtp is not None):
        raise ValueError(f"draft_tree={draft_tree} without a drafter: a tree is of prompt lookup's drafts")
    if not 0.0 <= draft_min_prob <= 1.0:
        raise ValueError(f"draft_min_prob must be a probability in [0, 1], got {draft_min_prob}")
    if draft_model is not None:
        rows = OneRow(draft_model) if one_row else BatchRuntime(draft_model, recurrent_strategy=recurrent_strategy)
        return DraftModel(rows, min_prob=draft_min_prob, prefill_step=prefill_step, tree=draft_tree)
    if mtp is not None:
        if mtp.model is not model:
            raise ValueError("the MTP head is bound to another model than this decoder's target")
        return MTP(mtp, prefill_step=prefill_step, tree=draft_tree)
    return Lookup(tree=draft_tree) if prompt_lookup else None


def make_decoder(model, *, num_draft_tokens: int = 0, draft_model=None, mtp=None, draft_min_prob: float = 0.0,
                 prefill_step: int = 2048, recurrent_strategy: str = "auto", one_row: bool = False,
                 draft_tree: int = 0, dflash=None, prompt_lookup: bool = False, **options) -> BatchDecoder:
    """A `BatchDecoder` with the drafter `make_drafter` makes: `num_draft_tokens` drafts per row per
    round by `draft_model`, else by `mtp`, else by `dflash` (0: its block size - 1; with
    `prompt_lookup` too, per row the better of lookup's match and the block), else by prompt
    lookup (0: plain decoding); `draft_tree`: each row's tree budget (docs/tree.md). `options`: the
    decoder's own (`gate`, `pipeline`, `adaptive`).

    Raises:
        ValueError: a draft model or head with `num_draft_tokens` < 1, or as `make_drafter`.
    """
    if (draft_model is not None or mtp is not None) and num_draft_tokens < 1:
        raise ValueError(f"a draft model or MTP head needs num_draft_tokens >= 1, got {num_draft_tokens}")
    alone = draft_model is None and mtp is None and dflash is None  # lookup is the drafter of num_draft_tokens
    if dflash is not None:  # a block of num_draft_tokens + 1 positions (0: the drafter's own block size)
        num_draft_tokens = num_draft_tokens or dflash.cfg.block_size - 1
    drafter = make_drafter(model, draft_model=draft_model, mtp=mtp,
                           prompt_lookup=prompt_lookup or (alone and num_draft_tokens > 0),
                           dflash=dflash, block_size=num_draft_tokens + 1 if dflash is not None else None,
                           draft_min_prob=draft_min_prob, prefill_step=prefill_step, one_row=one_row,
                           recurrent_strategy=recurrent_strategy, draft_tree=draft_tree)
    return BatchDecoder(model, drafter=drafter, num_draft_tokens=num_draft_tokens,
                        recurrent_strategy=recurrent_strategy, one_row=one_row, **options)
