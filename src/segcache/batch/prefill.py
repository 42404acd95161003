"""Prompts prefilled together: one forward over every joining row per step.

    row A  [ held ......... | c | c | ... ]     every row feeds the same count c per forward,
    row B  [ held | c | c | c | ... ]          outside any branch: no padding, nothing to commit
                                               or replay, so Gated DeltaNet rows run the chunked
    c = min(budget // rows, each row's         recurrence over all rows at once
            distance to its next stop)

A stop is a position where the caller wants the row's state (a checkpoint for
the prefix store, or the prompt's end): the step that reaches it hands back a
`Runtime` holding the row up to there (arrays shared, nothing copied until
written). A row that reaches its last stop leaves the batch. Rows join and
leave between steps, each from (and back to) a `Runtime`, so the store's
resume and publish see single sequences as always.

Why it pays on a CPU: a forward of a few hundred tokens of a small model is
dominated by per-operation overhead, which one forward over B rows pays once
(measured in bench/serve.py --cold; docs/batching.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import mlx.core as mx

from ..errors import InvariantError
from ..runtime import Runtime
from .runtime import BatchRuntime


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

    def remove(self, row_id) -> None:
        """The row leaves (e.g. its request was cancelled)."""
        self.batch.leave(row_id)
        del self.prompts[row_id]

    def step(self, budget: int) -> list[Reached]:
        """One forward of at most `budget` tokens over all rows (at least one per row).

        Returns the rows that reached a stop, each with its state there.
        """
        ids = self.batch.ids
        if not ids:
            return []
        prompts = [self.prompts[r] for r in ids]
        c = max(1, min(budget // len(ids), min(p.stops[0] - p.pos for p in prompts)))
        logits = self.batch.forward([p.ids[p.pos : p.pos + c] for p in prompts])
        last = logits[:, -1, :] * 1  # own buffer: do not pin the [B, S, vocab] logits
        mx.eval(last)
        out = []
        for i, (rid, p) in enumerate(zip(ids, prompts)):
            p.pos += c
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
