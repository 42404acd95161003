"""What the decoder asks of a drafter, and the helpers the decoder and the drafters share.

    drafter.add(row_id, history, runtime, draft_runtime)    a row joins (history ends with its pending token)
    drafter.offer(states, rooms) -> avail                    how many drafts each row can have this step
    drafter.draft(states, widths) -> Draft                   the step's drafts, every row at once
    ... the decoder verifies [pending] + drafts per row in one target forward ...
    drafter.fill(proposals)                                  the drafts as read with the verify
    drafter.close(states, keep, fed)                         the round is over: row i kept keep[i] target tokens
    (a plain step: drafter.capture() right after the forward that fed the pending tokens, and
     close(states, [1] * B, (captured, ids)) once that forward is committed)
    drafter.extend(row_id, tokens) / remove(row_id)

The drafters themselves (prompt lookup, a draft model: drafters.py; the target's MTP head:
mtp/drafter.py) stand above the decoder: `make_drafter` (drafters.py) builds the one the
caller asked for, and the decoder is handed it (`BatchDecoder(model, drafter=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import mlx.core as mx

from ..errors import RowError
from ..processors import normalize
from ..runtime import Runtime


@dataclass
class Draft:
    """One step's drafts for every row.

    Attributes:
        tokens: per row a list of ids, or an unevaluated [B, J] array (a draft
            model's chain, evaluated together with the verify forward).
        widths: drafts row i offers for verification (its first widths[i]; an
            array row may hold more proposals, computed but never kept).
        q: per row the distributions its drafts were drawn from, [w_i, V], or None.
        trees: per row a tree of drafts (tokens, parents) whose first branch is its chain,
            or None (batch/tree.py verifies it where it can, else the chain is verified).
    """

    tokens: list | mx.array
    widths: list[int]
    q: list = field(default_factory=list)
    trees: list | None = None

    @property
    def lazy(self) -> bool:
        return isinstance(self.tokens, mx.array)

    def __bool__(self) -> bool:
        return any(self.widths)

    def verify_input(self, pending: list[int]):
        """The verify forward's input: each row's pending token, then its drafts."""
        if self.lazy:
            head = mx.array(pending, dtype=self.tokens.dtype)[:, None]
            return mx.concatenate([head, self.tokens], axis=1)
        return [[p] + d for p, d in zip(pending, self.tokens)]

    def proposals(self) -> list[list[int]]:
        """Every row's proposals as ids (evaluates a lazy chain)."""
        return self.tokens.tolist() if self.lazy else [list(d) for d in self.tokens]


# Alternatives per position a drafter's tree may take beside its chain (a draft model's, the MTP head's).
TOP = 4


def tree_of_leaves(chain: list[int], tops: list, budget: int) -> tuple[list[int], list[int]]:
    """A tree of the `chain` and, up to `budget` nodes in all, leaves beside its tokens: at position
    j the draft's next likeliest tokens (`tops[j]`: tokens, logprobs), best first by the draft's
    probability of the chain reaching j and then taking the leaf."""
    mx.eval(tops)
    reach, scored = 0.0, []  # reach: the draft's logprob of the chain up to position j
    for j, (order, logp) in enumerate(tops[: len(chain)]):
        ranked = dict(zip(order.tolist(), logp.tolist()))
        scored += [(reach + lp, j, tok) for tok, lp in ranked.items() if tok != chain[j]]
        reach += ranked.get(chain[j], float("-inf"))
    tokens, parents = list(chain), list(range(len(chain)))
    for _, j, tok in sorted(scored, reverse=True)[: max(0, budget - len(chain))]:
        tokens.append(tok)
        parents.append(j)  # node j: the chain's token before position j (0: the pending one)
    return tokens, parents


def path_of(tree: tuple, kept: Sequence[int]) -> list[int]:
    """The node path (0 the pending token) of a tree (tokens, parents) along `kept`, the draft
    tokens a row kept after its pending one (siblings hold distinct tokens)."""
    tokens, parents = tree
    node, path = 0, [0]
    for t in kept:
        node = next(i + 1 for i, (tok, p) in enumerate(zip(tokens, parents)) if p == node and tok == t)
        path.append(node)
    return path


def each_row(states: list, fn) -> list:
    """fn(i, state) for every row, a failure attributed to its row (`RowError`)."""
    out = []
    for i, s in enumerate(states):
        try:
            out.append(fn(i, s))
        except Exception as exc:
            raise RowError(s.row_id, exc) from exc
    return out


def draft_position(raw: mx.array, states: list, widths: list[int], j: int, chain: list, qs: list[list], *,
                   greedy: bool, processed: bool, select=None) -> tuple[mx.array, mx.array]:
    """Every row's draft at position `j` from the drafter's raw logits `raw` [B, V]: (log-probs [B, V]
    after each drafting row's processors, as the verify will apply them, and `select`; tokens [B]
    uint32). `chain`: the tokens drafted before `j`, per position. `select`: None, or (log-probs, j)
    -> the log-probs [B, V] the rows propose from (DFlash2's candidate selector). Greedy rows take one
    argmax for the batch; otherwise each drafting row proposes by its own acceptor and its q is
    appended to `qs[i]` (the others' tokens are never verified)."""
    if processed:
        so_far = mx.stack(chain, axis=1) if chain else None
        lp = mx.concatenate(each_row(states, lambda i, s: normalize(raw[i : i + 1])
                                     if s.processors is None or j >= widths[i]
                                     else s.processors.process_next(
                                         raw[i], s.history, () if so_far is None else so_far[i])))
    else:
        lp = normalize(raw)
    if select is not None:
        lp = select(lp, j)
    if greedy:
        return lp, mx.argmax(lp, axis=-1).astype(mx.uint32)
    props = each_row(states, lambda i, s: s.acceptor.propose(lp[i]) if j < widths[i]
                     else (mx.argmax(lp[i], axis=-1), None))
    for i, (_, q) in enumerate(props):
        if j < widths[i] and q is not None:
            qs[i].append(q)
    return lp, mx.stack([t for t, _ in props]).astype(mx.uint32)


def no_draft(rows: int) -> Draft:
    return Draft([[] for _ in range(rows)], [0] * rows, [None] * rows)


class Drafter(Protocol):
    """Proposes tokens for rows to verify. Per-row state (an n-gram index, a draft
    model's row) lives here, keyed by row id.

    Attributes:
        mode: what a row's `GenerationStats` reports ("lookup", "draft", "mtp").
        min_prob: a row drafts no further after a draft its drafter gives less than
            this (0: every row drafts the width the decoder's policy gives it).
        draft_runtimes: whether a row may bring state of its own to `add` (a draft
            model's `Runtime`, the prefill's MTP `HiddenStates`).
        offers_rooms: whether `offer` gives every row its whole room after a plain step
            (a draft model, the MTP head; not prompt lookup, whose offer is the match of
            the token just emitted), so a gated decoder can choose the next step's width
            before that token is read and pipeline its plain steps.
        blockwise: whether a round of any width is one drafter call (a DFlash block), so a
            wider width costs only more verify positions (the gate's guess, `Gate.blockwise`).
        tree: (optional: the drafters that propose trees) draft nodes per round of a row's
            tree (`Draft.trees`; 0: chains); a gated decoder's tree gate sets it before each
            speculative round (batch/tree_gate.py).

    A drafter may also have `prepare(states)`: bring its rows up to date before a round (a draft
    model's rows that joined holding less than the target), called by the decoder before `draft`
    and not counted in the round's cost, which the gate weighs against later rounds.
    """

    mode: str
    min_prob: float
    draft_runtimes: bool
    offers_rooms: bool
    blockwise: bool

    def add(self, row_id, history: list, runtime: Runtime, draft_runtime) -> None:
        """A row joins holding `history[:-1]` in `runtime`; raises (changing nothing) if it cannot."""

    def remove(self, row_id) -> None:
        """The row leaves."""

    def offer(self, states: list, rooms: list[int]) -> list[int]:
        """How many drafts each row can have this step, at most its room."""

    def draft(self, states: list, widths: list[int]) -> Draft:
        """The step's drafts: up to widths[i] for row i (states[i].history ends with its pending token)."""

    def fill(self, proposals: list[list[int]]) -> None:
        """The round's drafts as read (every row's proposals, kept or not)."""

    def capture(self):
        """What the drafter keeps of the target forward that just ran (the MTP head: its hidden
        states), for a `close` after further forwards; None when it needs nothing."""

    def close(self, states: list, keep: list[int], fed: tuple | None = None) -> None:
        """End the round: row i kept keep[i] target tokens of it (its pending token included).
        With no round open (a plain step), `fed` is (`capture()` of the forward that fed each
        row's pending token, the row ids of that forward in order), or None: the last forward."""

    def rollback(self) -> None:
        """Drop the round (a failed step)."""

    def extend(self, row_id, tokens: Sequence[int]) -> None:
        """Tokens row `row_id` emitted (and kept) after the ones the drafter has seen."""

    def check(self, states: list, settled: bool) -> None:
        """Raise `InvariantError` unless the drafter's rows agree with the decoder's `states` (in
        the target batch's order); `settled`: no round is open."""
