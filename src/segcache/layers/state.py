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
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import BranchError, InvariantError, UnsupportedOperationError
from .compat import BatchingRefused, MlxCompat
from .kept_states import KeptStates, first_records
from .protocol import CHECKPOINT
from .recurrent import STRATEGIES
from .rows import StackedRows, take_rows
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
        replay: (n, slots, rows=None) -> the slots after the call's first n tokens, from
            `slots`; on a batched layer, of the batch rows `rows` only (an index array;
            `slots` then holds those rows).
        states: the slots after each of the `length` tokens, or None where not kept.
    """

    length: int
    replay: Callable[..., list]
    states: list[list] | None = None

    def first(self, n: int) -> "Call":
        if n == self.length:
            return self
        return Call(n, self.replay, None if self.states is None else self.states[:n])

    def take(self, idx: mx.array) -> "Call":
        """This call restricted to the batch rows `idx`, in that order."""
        replay = self.replay
        states = None if self.states is None else [[take_rows(a, idx) for a in s] for s in self.states]
        return Call(self.length, lambda n, slots, rows=None: replay(n, slots, idx if rows is None else idx[rows]), states)


def _replayed(slots: list, kept: list[Call], rows: mx.array | None = None) -> list:
    """The slots after the tokens of `kept` (a branch's calls, cut), from `slots` before them:
    the last slots a call kept, then the module run again on the calls after it (on a
    batched layer, of the batch rows `rows` only; `slots` holds those rows)."""
    start = 0
    for i, call in enumerate(kept):
        if call.states:
            start, slots = i + 1, [take_rows(a, rows) for a in call.states[-1]]
    for call in kept[start:]:
        slots = call.replay(call.length, slots, rows)
    return list(slots)


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
        kept = first_records(mark.records, n)  # cut calls keep the states of their first tokens
        self.cache = _replayed(list(mark.slots), kept)
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


class BatchStateLayer(StackedRows, StateLayer):
    """B rows of a `StateLayer`'s slots, stacked on axis 0 (mlx-lm's `ArraysCache` protocol for the model).

    A row that saw nothing holds zeros, what the modules start from when a slot
    is None. Inside a branch the family hook records each call over all rows
    (`Call`), and `commit_rows(ns)` rebuilds each row from exactly its first
    n_i tokens: rows that keep everything they fed keep their live slots; the
    others, grouped by n_i, run the module again on their own tokens from the
    slots before the branch (or take the slots kept after token n_i). So the
    padding of a ragged forward (rows padded on the right) never reaches a
    committed state. One branch level.
    """

    # -- branches --------------------------------------------------------------------

    def fork(self) -> None:
        self.marks.append(_StateMark(0, list(self.cache)))

    def rollback(self) -> None:
        self.cache = list(self.marks.pop().slots)

    def commit(self, n: int) -> None:
        raise BranchError("a batched state layer commits per row: commit_rows(ns)")

    def commit_rows(self, ns: Sequence[int]) -> None:
        """Keep the first ns[i] tokens row i fed in the branch and close it (ns[i] at most
        what row i really fed: `BatchRuntime.commit` checks it)."""
        mark = self.marks.pop()
        fed = mark.appended
        if all(n == fed for n in ns):
            return  # no row was padded (a padded row fed fewer than the branch's length)
        groups = []  # (rows, their slots after n tokens), one per distinct n
        for n in sorted(set(ns)):
            rows = [i for i, m in enumerate(ns) if m == n]
            idx = mx.array(rows, dtype=mx.int32)
            if n == fed:
                slots = [take_rows(a, idx) for a in self.cache]
            else:
                slots = _replayed([take_rows(a, idx) for a in mark.slots], first_records(mark.records, n), idx)
            groups.append((rows, slots))
        self.cache = _gathered(groups, self.size)

    # -- rows -------------------------------------------------------------------------

    def take(self, rows: Sequence[int]) -> None:
        """Keep `rows` (in that order), their branch records included (in new marks: a
        shallow copy of this layer may share the old ones)."""
        rows = list(rows)
        if not rows:
            self.cache = [None] * self.size
            self.marks = [_StateMark(m.offset, [None] * self.size) for m in self.marks]
        else:
            idx = mx.array(rows, dtype=mx.int32)
            self.cache = [take_rows(a, idx) for a in self.cache]
            self.marks = [
                _StateMark(m.offset, [take_rows(a, idx) for a in m.slots], [c.take(idx) for c in m.records],
                           m.kept, m.replaying)
                for m in self.marks
            ]
        self.rows = len(rows)

    def row_from(self, state) -> tuple:
        """The arguments of `add_row` for a row holding a `StateLayer`'s committed `state`
        (None: an empty row). Changes nothing.

        Raises:
            ValueError: the state is of another layout.
        """
        if state is None:
            return (None,)
        *slots, _, size, family, _, _, _ = state
        if (size, family) != (self.size, self.family):
            raise ValueError(f"a row of {size} {family} slots for a batched layer of {self.size} {self.family} slots")
        return (slots,)

    def add_row(self, slots: list | None) -> None:
        """Append a row holding `slots` ([1, ...] arrays or None each) or nothing (zeros); outside a branch."""
        self._append([None] * self.size if slots is None else list(slots), 1)

    def row_load(self, i: int, tokens: int) -> tuple:
        """The arguments of `StateLayer.load` for row i holding `tokens` tokens."""
        return (tuple(self.row_state(i)) if tokens else (None,) * self.size), tokens

    def check(self) -> None:
        where = f"BatchStateLayer({self.family}, rows={self.rows}, depth={len(self.marks)})"
        if len(self.cache) != self.size or any(len(m.slots) != self.size for m in self.marks):
            raise InvariantError(f"{where}: slot lists of other sizes than {self.size}")
        held = [a for slots in (self.cache, *(m.slots for m in self.marks)) for a in slots if a is not None]
        if any(a.shape[0] != self.rows for a in held):
            raise InvariantError(f"{where}: slots hold {sorted({a.shape[0] for a in held})} rows")
        if self.row_offsets is not None and len(self.row_offsets) != self.rows:
            raise InvariantError(f"{where}: {len(self.row_offsets)} token counts")
        if len(self.marks) > 1:
            raise InvariantError(f"{where}: one branch level at most")
        self._check_kept(where)

    # -- mlx-lm's batch-cache protocol (ArraysCache.merge, BatchGenerator) --------------------

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
            if any(a is not None and a.shape[0] != 1 for a in c.cache):
                raise UnsupportedOperationError(f"StateLayer.merge() ({first.family}): merge layers of one row each")
        layer = cls(first.size, first.family, first.strategy, states_budget_bytes=first.states_budget_bytes,
                    growing=first.growing)
        for c in caches:
            layer.add_row(c.cache)
        layer.row_offsets = [c.offset for c in caches]
        layer.offset = max(layer.row_offsets, default=0)
        return layer

    def extract(self, idx: int) -> StateLayer:
        """Row `idx` as a `StateLayer` (its slots shared: modules replace slots, never write them)."""
        self._rows_known("extract")
        out = StateLayer(self.size, self.family, self.strategy, states_budget_bytes=self.states_budget_bytes,
                         growing=self.growing)
        n = self.row_offsets[idx]
        if n:
            out.cache = self.row_state(idx)
            out.offset = n
        return out

    def extend(self, other: "BatchStateLayer") -> None:
        """Append `other`'s rows after this layer's (rows without a state are zeros)."""
        if type(other) is not BatchStateLayer or other.layout() != self.layout():
            raise UnsupportedOperationError(f"extend() with a {type(other).__name__}: extend with rows of one layout")
        self._extend_rows(other)

    def advance(self, N):
        self.count(N)
        ArraysCache.advance(self, N)

    def count(self, N: int) -> None:
        """Tokens fed through a module that does not call `advance` (the hook counts them)."""
        self._count_rows(N)
        self.offset += N


def _gathered(groups: list[tuple[list[int], list]], size: int) -> list:
    """The slots of all rows from groups of rows (rows, their slots), row i back at i."""
    if len(groups) == 1:
        return groups[0][1]
    order = [i for rows, _ in groups for i in rows]
    back = mx.array(sorted(range(len(order)), key=order.__getitem__), dtype=mx.int32)
    out = []
    for e in range(size):
        like = next((slots[e] for _, slots in groups if slots[e] is not None), None)
        if like is None:
            out.append(None)
            continue
        parts = [slots[e] if slots[e] is not None else mx.zeros((len(rows), *like.shape[1:]), like.dtype)
                 for rows, slots in groups]
        out.append(mx.concatenate(parts)[back])
    return out
