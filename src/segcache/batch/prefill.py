"""Prompts prefilled together: one forward over every joining row per step.

                forward 1      forward 2      forward 3
    row A   held | c            | c            | a · · · ·     c = max(1, budget // rows), a forward's width
    row B   held | c            | c            | c             n_i = min(c, row i's distance to its next stop)
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
takes at that width (it right-pads too), not one more per distinct length.
Padding never reaches a row's state: KV and window rows advance by their
real count (pads lie past the row's end, where no real query looks), and a
recurrent row's state and conv tail pass through its pads unchanged. A
model with a layer kind that cannot mask pads (`BatchRuntime.pads_rows`:
state kinds other than Gated DeltaNet) feeds every row the same count
instead, min(c, every row's distance to its next stop).

Why it pays on a CPU: a forward of a few hundred tokens of a small model is
dominated by per-operation overhead, which one forward over B rows pays once
(measured in bench/serve.py --cold; docs/batching.md).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Hashable

import mlx.core as mx

from ..errors import InvariantError
from ..runtime import Runtime
from .runtime import BatchRuntime

log = logging.getLogger("segcache.prefill")


@dataclass
class _Prompt:
    """One joining prompt. Invariant: the batch row holds exactly ids[:pos]; stops ascend, all > pos."""

    ids: list
    pos: int
    stops: list = field(default_factory=list)


@dataclass
class Reached:
    """A row reached one of its stops in the last step."""

    row_id: Hashable
    position: int
    runtime: Runtime  # the row up to `position`, a copy (arrays shared)
    logits: mx.array  # of the position before it, [1, V]
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
        # row id -> tokens it fed in the last step: its rows of that forward's outputs
        # (logits, hidden states) are [:fed], the rest are pads
        self.fed: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self.prompts)

    def add(self, row_id, runtime: Runtime, ids: list[int], stops) -> None:
        """A row joins holding `runtime`'s state, a strict prefix of `ids`; `stops` are the
        positions to stop at (the last one, len(ids), is added if missing).

        Raises:
            ValueError: the runtime does not hold a strict prefix of `ids`; nothing changed.
        """
        held = runtime.tokens
        if len(held) >= len(ids) or held != ids[: len(held)]:
            raise ValueError(f"add({row_id!r}): the runtime holds {len(held)} tokens, not a strict prefix "
                             f"of the {len(ids)} to prefill")
        stops = sorted({p for p in stops if len(held) < p < len(ids)} | {len(ids)})
        self.batch.join(row_id, runtime)
        self.prompts[row_id] = _Prompt(list(ids), len(held), stops)

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
        self.batch.leave(row_id)
        del self.prompts[row_id]

    def step(self, budget: int) -> list[Reached]:
        """One forward of at most `budget` tokens (pads included) over all rows, at least one per row.

        Returns the rows that reached a stop, each with its state there; `fed` then
        gives what each row of the forward fed (its outputs are valid on [:fed]).
        """
        ids = self.batch.ids
        if not ids:
            return []
        prompts = [self.prompts[r] for r in ids]
        c = max(1, budget // len(ids))
        counts = [min(c, p.stops[0] - p.pos) for p in prompts]
        if not self.batch.pads_rows:
            counts = [min(counts)] * len(counts)
        # each row's logits at its last real position only (the head runs on those alone)
        last = self.batch.forward_padded([p.ids[p.pos : p.pos + n] for p, n in zip(prompts, counts)], last_only=True)
        mx.eval(last)
        self.fed = dict(zip(ids, counts))
        log.debug("prefill forward: budget %d, %d rows fed %s", budget, len(ids), counts)
        out = []
        for i, (rid, p, n) in enumerate(zip(ids, prompts, counts)):
            p.pos += n
            if p.pos == p.stops[0]:
                p.stops.pop(0)
                out.append(Reached(rid, p.pos, self.batch.to_runtime(rid), last[i : i + 1], not p.stops))
        done = [r.row_id for r in out if r.done]
        if done:
            self.batch.leave(*done)
            for rid in done:
                del self.prompts[rid]
        return out

    def check(self) -> None:
        """The batch's invariants, and each row holding exactly its prompt up to its position."""
        self.batch.check()
        for rid in self.batch.ids:
            p = self.prompts[rid]
            held = self.batch.tokens(rid)
            if held != p.ids[: p.pos] or not p.stops or p.stops[0] <= p.pos or p.stops[-1] != len(p.ids):
                raise InvariantError(f"prefill row {rid!r} holds {len(held)} tokens at position {p.pos}, stops {p.stops}")
