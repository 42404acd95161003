"""Generic recurrent-state segment: any `ArraysCache` whose slots a module replaces each forward.

Mamba, Mamba-2 (nemotron_h, granitemoehybrid, falcon_h1, plamo2), Jamba and
the short convolutions of LFM2 all keep their state in `ArraysCache` slots
(conv tail, SSM state) that their module *replaces* (`cache[i] = ...`) and
never writes into. So a branch keeps the pre-branch slots by reference, and
the module itself is the recurrence: a family's hook (adapters/state.py) only
says which module consumes the cache and how it is called.

Inside a branch each forward call leaves a `Call` record:

    slots before the branch ── call 1 (S1 tokens) ── call 2 (S2) ── ...
    commit(n):  slots after n = the kept per-token slots at n ("states"),
                or, from the last kept slots m <= n (the pre-branch ones with
                "replay"), the module run again on the inputs of tokens m+1..n,
                cut at the same call boundaries the branch was fed in

With "replay" the branch forward is mlx-lm's own `__call__` on the block
(same kernel, same bits as mlx-lm); a partial commit re-runs the module on the
accepted prefix of each call (its output is never evaluated: only the graph
to the slots runs). With "states" the module runs one token at a time inside
a branch and keeps every step's slots (within `states_budget_bytes`); commit
is a lookup. Either way the committed slots are what the module computes
from the accepted inputs alone, so they never depend on the rejected tail.

`BatchStateLayer` is the same kind over B rows (layers/rows.py), slots
stacked on axis 0: what `StateLayer.merge` makes for mlx-lm's BatchGenerator.
The model runs mlx-lm's own code on it as on a merged `ArraysCache`; it adds
the count of real tokens per row, so `extract(i)` gives row i back as a
`StateLayer` holding exactly its slots and its count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import BranchError, InvariantError, UnsupportedOperationError
from .compat import BatchingRefused, MlxCompat
from .kept_states import KeptStates, first_records
from .protocol import CHECKPOINT
from .recurrent import STRATEGIES
from .rows import counted, ints
from .snapshots import SnapshotBranches


def default_state_strategy() -> str:
    """"replay" on every device: what `Runtime(recurrent_strategy="auto")` gives a StateLayer.

    With "replay" a branch forward is mlx-lm's own call on the block, so a
    verify costs what a plain forward costs, and only a partial commit pays
    (the accepted prefix re-run). "states" must run the whole module one token
    at a time (projections included, not only the recurrence as for Gated
    DeltaNet), which costs more than it saves: bench/branch.py on an SSM hybrid
    (Mamba-2 mixers) on the CPU measured rounds at 1.08x a plain verify with
    "replay" and 1.44x with "states" (docs/benchmarks.md).
    """
    return "replay"


@dataclass
class Call:
    """One forward call of the module inside a branch.

    Attributes:
        length: tokens the call fed.
        replay: (n, slots) -> the slots after the call's first n tokens, from `slots`.
        states: the slots after each of the `length` tokens, or None where not kept.
    """

    length: int
    replay: Callable[[int, list], list]
    states: list[list] | None = None

    def first(self, n: int) -> "Call":
        if n == self.length:
            return self
        return Call(n, self.replay, None if self.states is None else self.states[:n])


@dataclass
class _StateMark:
    offset: int
    slots: list  # the slots before the branch; immutable arrays shared by reference
    records: list[Call] = field(default_factory=list)  # private to the branch, in call order
    kept: int = 0  # tokens whose slots are kept: sum(len(c.states) for c in records if c.states)
    replaying: bool = False  # a record keeps no states (budget): keep no more in this branch

    @property
    def appended(self) -> int:
        return sum(c.length for c in self.records)


class StateLayer(MlxCompat, BatchingRefused, KeptStates, SnapshotBranches, ArraysCache):
    """mlx-lm's `ArraysCache(size)` plus a token count and a branch stack.

    Args:
        size: the number of slots `model.make_cache()` gave the layer.
        family: the module hook's name (part of the store layout).
        strategy: "replay" or "states" (as for `RecurrentLayer`).
        states_budget_bytes: with "states", the most bytes of kept per-token
            slots over this layer's open branches.
    """

    def __init__(
        self, size: int, family: str, strategy: str = "replay", *, states_budget_bytes: int = 1 << 62,
        growing: dict[int, tuple[int, int]] | None = None,
    ):
        super().__init__(size=size)
        # slot -> (axis, most rows): a slot whose length grows with the first tokens up
        # to a bound (longcat_flash_ngram's token context); the store's spec allows 1..most
        self.growing = dict(growing or {})
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if states_budget_bytes < 0:
            raise ValueError(f"states_budget_bytes must be >= 0, got {states_budget_bytes}")
        self.size = size
        self.family = family
        self.strategy = strategy
        # With "states": bytes of kept per-token slots <= states_budget_bytes.
        self.states_budget_bytes = states_budget_bytes
        # Tokens fed; counted by `advance` (modules that call it) or by the hook.
        self.offset = 0
        # marks[i]: the slots before open branch i and the calls i made.
        self.marks: list[_StateMark] = []

    @property
    def capturing(self) -> bool:
        """True inside a branch: the hook must record each call."""
        return bool(self.marks)

    def advance(self, N):
        super().advance(N)
        self.offset += N

    def count(self, N: int) -> None:
        """Count tokens fed through a module that does not call `advance` (mamba, jamba)."""
        self.offset += N

    # -- what a branch keeps -----------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of one set of slots (what keeping one token's state costs)."""
        return sum(a.nbytes for a in self.cache if a is not None)

    def _snapshot(self) -> _StateMark:
        return _StateMark(self.offset, list(self.cache))

    def _restore(self, mark: _StateMark) -> None:
        self.cache = list(mark.slots)
        self.offset = mark.offset

    def _commit_prefix(self, mark: _StateMark, n: int) -> None:
        if n == 0:
            self._restore(mark)
            return
        kept = first_records(mark.records, n)
        # the last call that kept its slots (cut calls keep the states of their first tokens)
        start, slots = 0, list(mark.slots)
        for i, call in enumerate(kept):
            if call.states:
                start, slots = i + 1, call.states[-1]
        for call in kept[start:]:
            slots = call.replay(call.length, slots)
        self.cache = list(slots)
        self.offset = mark.offset + n
        if self.marks:
            self._extend(self.marks[-1], kept)

    def clone(self) -> "StateLayer":
        """An independent layer holding the committed slots (arrays shared, never written)."""
        other = StateLayer(
            self.size, self.family, self.strategy, states_budget_bytes=self.states_budget_bytes, growing=self.growing
        )
        base = self.marks[0] if self.marks else None
        other.cache = list(base.slots) if base else list(self.cache)
        other.offset = base.offset if base else self.offset
        return other

    # -- the rest of mlx-lm's cache protocol (layers.compat) -------------------------

    @property
    def state(self):
        """(*slots, offset, size, family, strategy, states_budget_bytes, growing) of the committed state.

        Not `ArraysCache`'s slot list: that loses the token count and the layer's
        settings. `growing` travels as text ("slot:axis:most,...") since mlx-lm's
        file keeps only arrays, numbers, strings and None.
        """
        slots = self.marks[0].slots if self.marks else self.cache
        grows = ",".join(f"{i}:{axis}:{most}" for i, (axis, most) in sorted(self.growing.items()))
        return (*slots, self.committed_offset, self.size, self.family, self.strategy, self.states_budget_bytes, grows)

    @state.setter
    def state(self, v) -> None:
        if self.marks:
            raise BranchError("setting state with an open branch: commit or roll it back first")
        *slots, offset, size, self.family, self.strategy, self.states_budget_bytes, grows = v
        if len(slots) != size:
            raise ValueError(f"{len(slots)} slots saved for a layer of {size}")
        self.size = size
        self.growing = {int(i): (int(a), int(m)) for i, a, m in (g.split(":") for g in grows.split(",") if g)}
        self.cache, self.offset = list(slots), offset
        self.lengths = self.left_padding = None

    @classmethod
    def from_state(cls, state) -> "StateLayer":
        """A layer holding `state` (mlx-lm's `load_prompt_cache` calls this)."""
        size, family, strategy, budget = state[-5:-1]
        layer = cls(int(size), family, strategy, states_budget_bytes=int(budget))
        layer.state = state
        return layer._checked()

    @classmethod
    def merge(cls, caches):
        """mlx-lm's `ArraysCache.merge` (BatchGenerator): a `BatchStateLayer`, one row per
        layer; `extract(i)` gives row i back as a `StateLayer` with its token count."""
        return BatchStateLayer.merge(caches)

    # -- persistence protocol (layers.protocol) ------------------------------------

    resumes_from = CHECKPOINT

    def layout(self) -> list:
        grows = [[i, *self.growing[i]] for i in sorted(self.growing)]
        return ["state", self.family, self.size] + ([grows] if grows else [])

    def export_state(self) -> tuple[dict, dict]:
        """The committed slots as new array objects over the same (immutable) data."""
        slots = self.marks[0].slots if self.marks else self.cache
        return {f"s{i}": a[...] for i, a in enumerate(slots) if a is not None}, {}

    def spec(self, probe, tokens: int) -> dict:
        out = dict(probe)  # a summary: the same shapes after any number of tokens, but
        for i, (axis, most) in self.growing.items():  # slots that grow up to a bound
            if f"s{i}" in out:
                dtype, shape = out[f"s{i}"]
                shape = list(shape)
                shape[axis] = range(1, most + 1)
                out[f"s{i}"] = (dtype, tuple(shape))
        return out

    def state_from(self, arrays, meta, tokens: int) -> tuple:
        names = {f"s{i}" for i in range(self.size)}
        if tokens < 0 or set(arrays) - names or (tokens == 0) != (not arrays):
            raise ValueError(f"slots {sorted(arrays)} for {tokens} tokens; this layer has {self.size} slots")
        return tuple(arrays.get(f"s{i}") for i in range(self.size)), tokens

    def load(self, slots: tuple, offset: int) -> None:
        """Replace the slots by an exported set taken after `offset` tokens.

        Raises:
            BranchError: a branch is open.
            ValueError: the slots do not fit this layer.
        """
        if self.marks:
            raise BranchError("load() with an open branch: commit or roll it back first")
        arrays = {f"s{i}": a for i, a in enumerate(slots) if a is not None}
        if len(slots) != self.size:
            raise ValueError(f"{len(slots)} slots for a layer of {self.size}")
        slots, offset = self.state_from(arrays, {}, offset)
        self.cache = list(slots)
        self.offset = int(offset)
        self.lengths = self.left_padding = None

    def check(self) -> None:
        where = f"StateLayer({self.family}, offset={self.offset}, depth={len(self.marks)})"
        if self.lengths is not None or self.left_padding is not None:
            raise InvariantError(f"{where}: batched padding is not supported")
        if len(self.cache) != self.size:
            raise InvariantError(f"{where}: {len(self.cache)} slots, expected {self.size}")
        if self.offset == 0 and any(a is not None for a in self.cache):
            raise InvariantError(f"{where}: slots hold a state but no tokens were seen")
        if self.offset > 0 and all(a is None for a in self.cache):
            raise InvariantError(f"{where}: tokens were seen but the slots are empty")
        self._check_marks(where)
        self._check_kept(where)


class BatchStateLayer(StateLayer):
    """B rows of a `StateLayer`'s slots (mlx-lm's `ArraysCache` protocol for the model)."""

    # row_offsets[i]: real tokens row i holds (pads excluded); len == rows.
    row_offsets: list[int]

    @classmethod
    def merge(cls, caches) -> "BatchStateLayer":
        """One row per `StateLayer` of one family and slot count, in order.

        Raises:
            BranchError: a layer has an open branch; nothing changed.
            UnsupportedOperationError: other kinds or layouts, a layer of several rows,
                or slots whose shapes differ between rows (a context still growing).
        """
        first = caches[0]
        for c in caches:
            if type(c) is not StateLayer or c.layout() != first.layout():
                raise UnsupportedOperationError(
                    f"StateLayer.merge() of a {type(c).__name__} {c.layout()}: merge StateLayers of one layout "
                    f"({first.layout()})"
                )
            if c.marks:
                raise BranchError(
                    f"merge() of a StateLayer with {len(c.marks)} open branch(es): commit or roll them back first"
                )
        slots = []
        for e in range(first.size):
            present = [c.cache[e] for c in caches if c.cache[e] is not None]
            if not present:
                slots.append(None)
                continue
            if len({a.shape for a in present}) != 1 or present[0].shape[0] != 1:
                raise UnsupportedOperationError(
                    f"StateLayer.merge() ({first.family}): slot {e} has shapes {sorted({a.shape for a in present})} "
                    "across rows; merge rows of one shape (one row each)"
                )
            like = present[0]
            slots.append(mx.concatenate([mx.zeros_like(like) if c.cache[e] is None else c.cache[e] for c in caches]))
        layer = cls(first.size, first.family, first.strategy, states_budget_bytes=first.states_budget_bytes,
                    growing=first.growing)
        layer.cache = slots
        layer.row_offsets = [c.offset for c in caches]
        layer.offset = max(layer.row_offsets, default=0)
        return layer

    def extract(self, idx: int) -> StateLayer:
        """Row `idx` as a `StateLayer` (its slots shared: modules replace slots, never write them)."""
        out = StateLayer(self.size, self.family, self.strategy, states_budget_bytes=self.states_budget_bytes,
                         growing=self.growing)
        n = self.row_offsets[idx]
        if n:
            out.cache = [None if a is None else a[idx : idx + 1] for a in self.cache]
            out.offset = n
        return out

    def filter(self, batch_indices) -> None:
        rows = ints(batch_indices)
        ArraysCache.filter(self, mx.array(rows, dtype=mx.int32))
        self.row_offsets = [self.row_offsets[i] for i in rows]

    def extend(self, other: "BatchStateLayer") -> None:
        if type(other) is not BatchStateLayer or other.layout() != self.layout():
            raise UnsupportedOperationError(f"extend() with a {type(other).__name__}: extend with rows of one layout")
        n_self, n_other = len(self.row_offsets), len(other.row_offsets)
        lengths = None
        if self.lengths is not None or other.lengths is not None:
            pick = lambda a, n: mx.zeros((n,), mx.int32) if a is None else a
            lengths = mx.concatenate([pick(self.lengths, n_self), pick(other.lengths, n_other)])
        slots = []
        for a, b in zip(self.cache, other.cache):
            like = a if a is not None else b
            if like is None:
                slots.append(None)
                continue
            a = mx.zeros((n_self, *like.shape[1:]), like.dtype) if a is None else a
            b = mx.zeros((n_other, *like.shape[1:]), like.dtype) if b is None else b
            slots.append(mx.concatenate([a, b]))
        self.cache, self.lengths = slots, lengths
        self.row_offsets = self.row_offsets + other.row_offsets
        self.offset = max(self.row_offsets, default=0)

    def prepare(self, lengths=None, **kwargs) -> None:
        ArraysCache.prepare(self, lengths=lengths)

    def finalize(self) -> None:
        ArraysCache.finalize(self)

    def advance(self, N):
        self._count_rows(N)
        ArraysCache.advance(self, N)
        self.offset += N

    def count(self, N: int) -> None:
        """Tokens fed through a module that does not call `advance` (the hook counts them)."""
        self._count_rows(N)
        self.offset += N

    def _count_rows(self, N: int) -> None:
        self.row_offsets = counted(self.row_offsets, self.lengths, N)

    def fork(self) -> None:
        raise BranchError("a batched StateLayer has no branches (batched speculative rounds need BatchRuntime)")

    def check(self) -> None:
        where = f"BatchStateLayer({self.family}, rows={len(self.row_offsets)})"
        if len(self.cache) != self.size:
            raise InvariantError(f"{where}: {len(self.cache)} slots, expected {self.size}")
        rows = {a.shape[0] for a in self.cache if a is not None}
        if rows - {len(self.row_offsets)}:
            raise InvariantError(f"{where}: slots hold {sorted(rows)} rows")
        if self.marks:
            raise InvariantError(f"{where}: a branch is open")
