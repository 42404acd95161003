"""Prompts prefilled together: one forward over every joining row per step.

                forward 1      forward 2      forward 3
    row A   held | c            | c            | a · · · ·     c = max(1, budget // rows), the widest forward
    row B   held | c            | c            | c             n_i = min(w, row i's distance to its next stop),
                                                               w = c or narrower (`width`, below)
    row C   held | s · · · · · ·| c            | c · ·         · pads: shorter rows right-padded to max n_i

Every row feeds its own n_i in one model call (`BatchRuntime.forward_padded`:
per-row masks), outside any branch: nothing to commit or replay, so Gated
DeltaNet rows run the chunked recurrence over all rows at once.

A stop is a position where the caller wants the row's state (a checkpoint for
the prefix store, or the prompt's end): the step that reaches it hands back a
`Runtime` holding the row up to there (arrays shared, nothing copied until
written). A row that reaches its last stop leaves the batch. Rows join and
leave between steps, each from (and back to) a `Runtime`, so the store's
resume and publish see single sequences as always.

Forwards: prompts joining together with r_i tokens left and no stop before
their ends take ceil(max r_i / c) forwards, what mlx-lm's BatchGenerator
takes at that width (it right-pads too), not one more per distinct length,
unless a narrower forward first pays for itself: a forward's width w may be
less than c when that feeds fewer tokens, pads included, counting each
forward as `FORWARD_TOKENS` more (`width`). The rows that end within w leave,
and the next forward pads the rest to their own longest:

    left   116 120 137 161 163 195 196 218      one forward of 218: 8 x 218 = 1,744 fed
    w=120  116 120 120 120 120 120 120 120      8 x 120 = 960; two rows leave
    w=43            17  41  43  43  43  43      6 x 43 = 258; three more leave
    w=55                        32  33  55      3 x 55 = 165: 1,383 fed in three forwards

Padding never reaches a row's state: KV and window rows advance by their
real count (pads lie past the row's end, where no real query looks), and a
recurrent row's state and conv tail pass through its pads unchanged. A
model with a layer kind that cannot mask pads (`BatchRuntime.pads_rows`:
state kinds other than Gated DeltaNet) feeds every row the same count
instead, min(c, every row's distance to its next stop).

A lone prompt (no other row in the batch) is fed on its own `Runtime`, the
one-row path `Runtime.prefill` runs, so a request alone pays no copy into the
batch and out of it; its `Reached` hands back that Runtime itself. A second
prompt joining moves it into the batch first (one copy, as any join).

What it buys on a CPU: one forward's fixed cost (graph, launches, sync) for
B rows, and wider products; on the shipped target a prefill of 256-token
chunks is already compute, so 8 rows cost about what they cost alone (the 8
cold prompts alone took 1.07-1.2x the batch's CPU time) and the pads are the
loss to avoid (docs/batching.md, "Where the cold mix's time goes").
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Hashable

import mlx.core as mx

from ..errors import BranchError, InvariantError
from ..runtime import Runtime
from .runtime import BatchRuntime

log = logging.getLogger("segcache.prefill")

# What one more forward costs, in row-tokens fed: its graph, launches and sync. On the
# shipped target (2 cores, CPU time) a forward of 8 rows cost ~3-8 ms plus ~0.23 ms per
# row-token, so ~32; taken twice that.
FORWARD_TOKENS = 64
# A narrower forward is taken only where its plan feeds at most (1 - MARGIN) of what one
# forward of the widest row feeds: the cost model is rough (attention grows with the keys,
# not the width; the chunked GDN pads to 64), and a plan that saves less gains little (as
# the gate's margin, batch/gate.py).
MARGIN = 0.1


def width(left: list[int], fixed: int = FORWARD_TOKENS, margin: float = MARGIN) -> int:
    """The width of the next forward over rows with `left` tokens each to their next stop: the
    one that starts the plan feeding them all in the fewest row-tokens, pads included, each
    forward counted as `fixed` more, when every forward after it pads the rows still left to
    their longest; the widest row's count unless that plan saves `margin` of its own.

    The best widths are among the rows' own counts (a row that ends in a forward leaves the
    batch); over the rows sorted by count, cost[k] is what the rows from k on need once the
    ones before left (the fed counts then stand at left[k - 1]).
    """
    r = sorted(left)
    n = len(r)
    cost, pick = [0.0] * (n + 1), [n - 1] * (n + 1)
    for k in range(n - 1, -1, -1):
        base, cost[k] = (r[k - 1] if k else 0), float("inf")
        for j in range(k, n):
            if j + 1 < n and r[j + 1] == r[j]:
                continue  # rows of one count leave together
            c = fixed + (n - k) * (r[j] - base) + cost[j + 1]
            if c < cost[k]:
                cost[k], pick[k] = c, j
    return r[pick[0]] if cost[0] <= (1 - margin) * (fixed + n * r[-1]) else r[-1]


@dataclass
class _Prompt:
    """One joining prompt. Invariant: the batch row holds exactly ids[:pos]; stops ascend, all > pos."""

    ids: list
    pos: int
    stops: list = field(default_factory=list)
    logits: bool = True  # its end's logits are computed (and handed back in its last `Reached`)


@dataclass
class Reached:
    """A row reached one of its stops in the last step."""

    row_id: Hashable
    position: int
    runtime: Runtime  # the row up to `position`: a copy (arrays shared), or a lone row's own Runtime
    logits: mx.array | None  # of the position before it, [1, V]; at the row's last stop only, if it wants them
    done: bool  # its last stop: the row has left the batch


class PrefillBatch:
    """Joining prompts fed together (see the module docstring).

    Args:
        model: the target model.
        recurrent_strategy, gdn_prefill: as for `BatchRuntime` ("auto" GDN prefill: chunked off Metal).
    """

    def __init__(self, model, *, recurrent_strategy: str = "auto", gdn_prefill: str = "auto"):
        self.batch = BatchRuntime(model, recurrent_strategy=recurrent_strategy, gdn_prefill=gdn_prefill)
        self.prompts: dict[Hashable, _Prompt] = {}
        # (row id, its Runtime): a lone prompt fed on its own Runtime. Invariant: when not None,
        # it is the only prompt and the batch holds no row.
        self.solo: tuple[Hashable, Runtime] | None = None
        # row id -> tokens it fed in the last step: its rows of that forward's outputs
        # (logits, hidden states) are [:fed], the rest are pads
        self.fed: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def ids(self) -> list:
        """The rows in the order of a forward's outputs."""
        return [self.solo[0]] if self.solo is not None else self.batch.ids

    def add(self, row_id, runtime: Runtime, ids: list[int], stops, *, logits: bool = True) -> None:
        """A row joins holding `runtime`'s state, a strict prefix of `ids`; `stops` are the
        positions to stop at (the last one, len(ids), is added if missing). `logits`: its end's
        logits are computed (False: its last `Reached` holds None, and no forward runs the last
        layer's attention for its queries, as `Prefill(want_logits=False)`).

        Raises:
            ValueError: the runtime does not hold a strict prefix of `ids`, is of another model,
                or the id is taken; nothing changed.
            BranchError: the runtime has an open branch; nothing changed.
        """
        held = runtime.tokens
        if len(held) >= len(ids) or held != ids[: len(held)]:
            raise ValueError(f"add({row_id!r}): the runtime holds {len(held)} tokens, not a strict prefix "
                             f"of the {len(ids)} to prefill")
        if row_id in self.prompts:
            raise ValueError(f"add({row_id!r}): a row with that id is already in the batch")
        if runtime.model is not self.batch.model:  # join's checks, for a row fed alone too
            raise ValueError(f"add({row_id!r}): the runtime is of another model")
        if runtime.depth:
            raise BranchError(f"add({row_id!r}): the runtime has {runtime.depth} open branch(es)")
        stops = sorted({p for p in stops if len(held) < p < len(ids)} | {len(ids)})
        if not self.prompts:
            self.solo = (row_id, runtime)  # alone: fed on its own Runtime until another joins
        else:
            if self.solo is not None:  # it has company now: into the batch first
                self.batch.join(*self.solo)
                self.solo = None
            self.batch.join(row_id, runtime)
        self.prompts[row_id] = _Prompt(list(ids), len(held), stops, logits)

    def runtime_of(self, row_id) -> Runtime:
        """A Runtime holding the row's prompt up to where it is now (a lone row's own Runtime;
        else a copy, arrays shared), e.g. to publish what a cancelled row computed."""
        return self.solo[1] if self.solo is not None and self.solo[0] == row_id else self.batch.to_runtime(row_id)

    def stop_at(self, row_id, position: int) -> bool:
        """Row `row_id` also stops at `position` (its caller wants the state there); False
        (nothing changed) if the row is not in the batch or is at or past it."""
        p = self.prompts.get(row_id)
        if p is None or not p.pos < position <= len(p.ids):
            return False
        if position not in p.stops:
            bisect.insort(p.stops, position)
        return True

    def remove(self, row_id) -> None:
        """The row leaves (e.g. its request was cancelled)."""
        if self.solo is not None and self.solo[0] == row_id:
            self.solo = None
        else:
            self.batch.leave(row_id)
        del self.prompts[row_id]

    def step(self, budget: int) -> list[Reached]:
        """One forward of at most `budget` tokens (pads included) over all rows, at least one per row.

        Returns the rows that reached a stop, each with its state there; `fed` then
        gives what each row of the forward fed (its outputs are valid on [:fed]).
        """
        ids = self.ids
        if not ids:
            return []
        prompts = [self.prompts[r] for r in ids]
        c = max(1, budget // len(ids))
        counts = [min(c, p.stops[0] - p.pos) for p in prompts]
        if not self.batch.pads_rows:
            counts = [min(counts)] * len(counts)
        elif len(counts) > 1:
            w = width(counts)
            counts = [min(n, w) for n in counts]
        if self.solo is not None:  # the one-row path: Runtime.prefill's forward (adapters/head.py)
            rt = self.solo[1]
            (p,), (n,) = prompts, counts
            last = rt.forward(p.ids[p.pos : p.pos + n], last_only=True)[:, -1, :] * 1  # own buffer, as Prefill.feed
            # logits only where the prompt ends: elsewhere they would cost the last layer's attention at
            # every query, which the states never need (Prefill.feed likewise; a lone long prompt, such
            # as a coding agent's first, is fed here)
            wanted = p.logits and p.pos + n == len(p.ids)
            mx.eval(*([last] if wanted else []), [layer.state for layer in rt.cache] + rt.drafters.state)
        else:
            # each row's logits at its last real position only (the head runs on those alone), and
            # evaluated only in a forward where a row that wants them ends: else the layers' states
            # alone, so the last layer's attention runs for no query (each row's share of it grows
            # with its context: most of a short chunk's forward after a long one)
            last = self.batch.forward_padded([p.ids[p.pos : p.pos + n] for p, n in zip(prompts, counts)],
                                             last_only=True)
            wanted = any(p.logits and p.pos + n == len(p.ids) for p, n in zip(prompts, counts))
            mx.eval(last if wanted else [layer.state for layer in self.batch.cache])
        self.fed = dict(zip(ids, counts))
        log.debug("prefill forward: budget %d, %d rows fed %s", budget, len(ids), counts)
        out = []
        for i, (rid, p, n) in enumerate(zip(ids, prompts, counts)):
            p.pos += n
            if p.pos == p.stops[0]:
                p.stops.pop(0)
                rt = self.solo[1] if self.solo is not None else self.batch.to_runtime(rid)
                out.append(Reached(rid, p.pos, rt, last[i : i + 1] if not p.stops and p.logits else None, not p.stops))
        done = [r.row_id for r in out if r.done]
        if done:
            if self.solo is not None:
                self.solo = None
            else:
                self.batch.leave(*done)
            for rid in done:
                del self.prompts[rid]
        return out

    def check(self) -> None:
        """The batch's invariants, and each row holding exactly its prompt up to its position."""
        self.batch.check()
        if self.solo is not None and (len(self.batch) or list(self.prompts) != [self.solo[0]]):
            raise InvariantError(f"prefill row {self.solo[0]!r} is fed alone beside {len(self.prompts) - 1} other(s)")
        if set(self.ids) != set(self.prompts):
            raise InvariantError(f"prefill rows {self.ids} are not the prompts {list(self.prompts)}")
        for rid in self.ids:
            p = self.prompts[rid]
            held = self.solo[1].tokens if self.solo is not None else self.batch.tokens(rid)
            if held != p.ids[: p.pos] or not p.stops or p.stops[0] <= p.pos or p.stops[-1] != len(p.ids):
                raise InvariantError(f"prefill row {rid!r} holds {len(held)} tokens at position {p.pos}, stops {p.stops}")
