"""Recurrent segment (conv tail + SSM state) with transaction-scoped exact replay.

Outside a branch this is mlx-lm's `ArraysCache(size=2)`: slot 0 the conv tail
(last k-1 conv inputs), slot 1 the recurrent state, both replaced (never
written in place) by every forward. The model runs its own code on it.

Inside a branch the model family's adapter (segcache.adapters) hands over what
the recurrence consumed, one `Steps` per forward call. The branch keeps the
pre-branch tail and state by reference. `commit(n)` then rebuilds:

    conv inputs:  [ tail before branch (k-1) | rows of step 1 .. T ]
                                   tail after n = rows n .. n+k-2
    state after n = the state kept at the last step m <= n that kept one
                    (none with "replay": m = 0, the pre-branch state),
                    then a replay of steps m+1..n from it

All give the bits a forward of exactly those n tokens gives: the same
per-token recurrence runs on the same inputs.

With "states", kept states cost B*Hv*Dv*Dk floats per token, so the layer
keeps at most `states_budget_bytes` of them over its open branches. A branch
whose next forward would pass the budget keeps no more states from then on
(its inputs are recorded as always), and its commit replays from the last
kept state: bounded memory, same bits.

`BatchRecurrentLayer` is the same kind over B rows (layers/rows.py), [B, ...]
conv tails and states: what `BatchRuntime` builds for a Gated DeltaNet layer
(registry.py) and what `RecurrentLayer.merge` makes for mlx-lm's
BatchGenerator. It is a `RecurrentLayer`, so the adapter records a branch
forward's `Steps` over all rows, and `commit_rows(ns)` rebuilds each row from
exactly its first n_i tokens as above: the padding of a ragged forward (rows
padded on the right) never reaches a committed state. An empty row holds
zeros, what mlx-lm's module starts from when its cache holds None.
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
from .rows import StackedRows, take_rows
from .snapshots import SnapshotBranches

STRATEGIES = ("replay", "states")


@dataclass
class Steps:
    """What one forward call inside a branch fed the recurrence (time is axis 1).

    Attributes:
        conv_rows: the conv inputs this call appended, [B, S, C].
        inputs: recurrence inputs, each [B, S, ...], sliced by time on commit.
        replay: (inputs, state) -> state after those inputs, the same kernel the forward ran.
        states: the state after each of the S steps, or None where they were not
            kept ("replay", or past the "states" budget).
    """

    conv_rows: mx.array
    inputs: dict[str, mx.array | None]
    replay: Callable[[dict, mx.array | None], mx.array]
    states: list[mx.array] | None = None
    # A tree forward's record (layers/tree.py): per row, node i's recurrence started from
    # its parent's state (parents[row][i], -1: the state before); its `states` are per node
    # a list of the rows' [1, ...] states. None: a chain, step t from t-1.
    parents: tuple | None = None

    @property
    def length(self) -> int:
        return self.conv_rows.shape[1]

    def along(self, path: list[int], row: int = 0) -> "Steps":
        """A tree record's nodes of row `row`'s root `path` as the one-row chain record of those tokens."""
        idx = mx.array(path, dtype=mx.int32)
        sl = slice(row, row + 1)
        cut = {k: (None if v is None else v[sl][:, idx]) for k, v in self.inputs.items()}
        states = None if self.states is None else [self.states[i][row] for i in path]
        return Steps(self.conv_rows[sl][:, idx], cut, self.replay, states)

    def first(self, n: int) -> "Steps":
        if n == self.length:
            return self
        if self.parents is not None:
            raise BranchError("a tree's record is cut along a path (take_path), not to its first tokens")
        cut = {k: (None if v is None else v[:, :n]) for k, v in self.inputs.items()}
        states = None if self.states is None else self.states[:n]
        return Steps(self.conv_rows[:, :n], cut, self.replay, states)


@dataclass
class _RecurrentMark:
    offset: int
    conv: mx.array | None  # slot 0 before the branch; immutable, shared by reference
    state: mx.array | None  # slot 1 before the branch; immutable, shared by reference
    records: list[Steps] = field(default_factory=list)  # private to the branch, in call order
    kept: int = 0  # states kept in records: sum(len(s.states) for s in records if s.states)
    # some record keeps no states (a forward passed the budget): keep no more in this branch
    replaying: bool = False

    @property
    def appended(self) -> int:
        return sum(s.length for s in self.records)


def _rebuild(conv, state, records: list[Steps], kept: list[Steps], n: int, conv_tail: int) -> list:
    """[conv tail, state] after the first n > 0 tokens of `records` (`kept`: those tokens'
    records, `first_records(records, n)`), from the conv tail and state before them.

    The tail is a slice of the conv inputs already computed; the state is the last
    kept per-token state, or the one before, with the recurrence replayed from it.
    """
    rows = [s.conv_rows for s in records]
    if conv is None:
        conv = mx.zeros((rows[0].shape[0], conv_tail, rows[0].shape[2]), rows[0].dtype)
    conv_inputs = mx.concatenate([conv, *rows], axis=1)
    tail = mx.contiguous(conv_inputs[:, n : n + conv_tail, :])
    start = 0
    for i, steps in enumerate(kept):
        if steps.states:
            start, state = i + 1, steps.states[-1]
    for steps in kept[start:]:
        state = steps.replay(steps.inputs, state)
    return [tail, state]


class RecurrentLayer(MlxCompat, BatchingRefused, KeptStates, SnapshotBranches, ArraysCache):
    """mlx-lm's two-slot `ArraysCache` plus a token count and a branch stack.

    Args:
        conv_tail: k-1, the rows of conv input the layer keeps.
        strategy: "replay" (keep inputs, replay the accepted prefix on commit) or
            "states" (keep the state after every branch token, within the budget).
        states_budget_bytes: with "states", the most bytes of per-token states
            this layer's open branches keep (unbounded by default here;
            `Runtime` passes its `branch_state_bytes` share).
    """

    def __init__(self, conv_tail: int, strategy: str = "replay", *, states_budget_bytes: int = 1 << 62):
        super().__init__(size=2)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if states_budget_bytes < 0:
            raise ValueError(f"states_budget_bytes must be >= 0, got {states_budget_bytes}")
        self.conv_tail = conv_tail
        self.strategy = strategy
        # With "states": bytes of kept per-token states <= states_budget_bytes.
        self.states_budget_bytes = states_budget_bytes
        # ArraysCache has no offset; models call advance(S) after each forward.
        self.offset = 0
        # marks[i]: state before open branch i and the steps i fed the recurrence.
        self.marks: list[_RecurrentMark] = []
        # Blocks of at least this many tokens run the chunked recurrence outside
        # branches (adapters.chunked); None: always mlx-lm's path. Set by Runtime.
        self.chunked_from: int | None = None
        # Positions inside the next forward (tokens from its start, ascending, each in (0, S)) where
        # the chunked forward keeps the conv tail and state (`captures`), and what it kept there by
        # position: a prefill's boundary checkpoints taken from one forward (prefill.py). Outside
        # branches only; the caller sets and clears both around that one forward.
        self.cuts: tuple[int, ...] = ()
        self.cut_states: dict[int, tuple] = {}

    def captures(self, tokens: int) -> bool:
        """True where a forward of `tokens` runs chunked (adapters/chunked.py) on one row outside
        branches: its recurrence restarts at each of `cuts` and keeps the state there."""
        return not self.marks and self.lengths is None and self.chunked_from is not None \
            and tokens >= self.chunked_from

    def export_cut(self, cut: int) -> tuple[dict, dict]:
        """`export_state` as it stood `cut` tokens into the last forward (kept there: `cuts`).

        Raises:
            KeyError: that forward kept no state there (it did not run chunked).
        """
        conv, state = self.cut_states[cut]
        return {"conv": conv, "state": state}, {}

    # -- tree verify (layers/tree.py) ----------------------------------------------

    takes_trees = True
    tree = None  # the tree being verified, during its forward only (the adapter reads it)

    def tree_begin(self, tree) -> None:
        self.tree = tree

    def tree_end(self) -> None:
        self.tree = None

    def take_path(self, path: list[int]) -> None:
        """The innermost branch, which holds a tree (one record), becomes the chain of `path`:
        the path's recorded inputs (and kept states) as one chain record, the state after its
        last node, the conv tail from the path's rows."""
        mark = self.marks[-1]
        (record,) = mark.records
        self._truncate(mark, 0)
        if not path:
            self._restore(mark)
            return
        chain = record.along(path)
        self._extend(mark, [chain])
        self.cache = _rebuild(mark.conv, mark.state, [chain], [chain], len(path), self.conv_tail)
        self.offset = mark.offset + len(path)

    @property
    def capturing(self) -> bool:
        """True inside a branch: the adapter must hand over what the recurrence consumes."""
        return bool(self.marks)

    def advance(self, N):
        super().advance(N)
        self.offset += N

    def _snapshot(self) -> _RecurrentMark:
        return _RecurrentMark(self.offset, self.cache[0], self.cache[1])

    def _restore(self, mark: _RecurrentMark) -> None:
        self.cache = [mark.conv, mark.state]
        self.offset = mark.offset

    def _commit_prefix(self, mark: _RecurrentMark, n: int) -> None:
        if n == 0:
            self._restore(mark)
            return
        kept = first_records(mark.records, n)
        self.cache = _rebuild(mark.conv, mark.state, mark.records, kept, n, self.conv_tail)
        self.offset = mark.offset + n
        if self.marks:
            self._extend(self.marks[-1], kept)

    def clone(self) -> "RecurrentLayer":
        """An independent layer holding the committed state (arrays shared, never written)."""
        other = RecurrentLayer(self.conv_tail, self.strategy, states_budget_bytes=self.states_budget_bytes)
        other.chunked_from = self.chunked_from
        if self.marks:
            base = self.marks[0]
            other.cache, other.offset = [base.conv, base.state], base.offset
        else:
            other.cache, other.offset = list(self.cache), self.offset
        return other

    # -- the rest of mlx-lm's cache protocol (layers.compat) -------------------------

    @property
    def state(self):
        """(conv tail, state, offset, conv_tail, strategy, states_budget_bytes) of the committed state.

        Not `ArraysCache`'s (cache, left_padding, lengths): that loses the token
        count and the layer's settings, and this layer never holds padding.
        """
        conv, state = (self.marks[0].conv, self.marks[0].state) if self.marks else self.cache
        return conv, state, self.committed_offset, self.conv_tail, self.strategy, self.states_budget_bytes

    @state.setter
    def state(self, v) -> None:
        if self.marks:
            raise BranchError("setting state with an open branch: commit or roll it back first")
        conv, state, offset, self.conv_tail, self.strategy, self.states_budget_bytes = v
        self.cache, self.offset = [conv, state], offset
        self.lengths = self.left_padding = None

    @classmethod
    def from_state(cls, state) -> "RecurrentLayer":
        """A layer holding `state` (mlx-lm's `load_prompt_cache` calls this)."""
        conv_tail, strategy, budget = state[3:]
        layer = cls(conv_tail, strategy, states_budget_bytes=budget)
        layer.state = state
        return layer._checked()

    @classmethod
    def merge(cls, caches):
        """mlx-lm's `ArraysCache.merge` (BatchGenerator): a `BatchRecurrentLayer`, one row per
        layer, with this conv tail; `extract(i)` gives row i back as a `RecurrentLayer`."""
        return BatchRecurrentLayer.merge(caches)

    # -- persistence protocol (layers.protocol) ------------------------------------

    resumes_from = CHECKPOINT

    def layout(self) -> list:
        return ["recurrent", self.conv_tail]

    def export_state(self) -> tuple[dict, dict]:
        """The committed conv tail and state.

        The arrays are new objects over immutable data: forwards replace the
        slots, never write into them, so sharing the data is safe and free.
        """
        conv, state = (self.marks[0].conv, self.marks[0].state) if self.marks else self.cache
        if conv is None:
            return {}, {}
        return {"conv": conv[...], "state": state[...]}, {}

    def spec(self, probe, tokens: int) -> dict:
        return dict(probe)  # a summary: the same shapes after any number of tokens

    def state_from(self, arrays, meta, tokens: int) -> tuple:
        conv, state = arrays.get("conv"), arrays.get("state")
        if tokens < 0 or (conv is None) != (tokens == 0) or (state is None) != (tokens == 0):
            raise ValueError(f"conv tail and state must be given iff tokens > 0 ({tokens} tokens)")
        if conv is not None and (conv.ndim != 3 or conv.shape[1] != self.conv_tail):
            raise ValueError(f"conv tail of shape {conv.shape}; this layer keeps {self.conv_tail} rows")
        return conv, state, tokens

    def load(self, conv: mx.array | None, state: mx.array | None, offset: int) -> None:
        """Replace the tail and state by an exported pair taken after `offset` tokens.

        Raises:
            BranchError: a branch is open.
            ValueError: the pair is inconsistent (what `check()` would reject).
        """
        if self.marks:
            raise BranchError("load() with an open branch: commit or roll it back first")
        arrays = {} if conv is None else {"conv": conv, "state": state}
        conv, state, offset = self.state_from(arrays, {}, offset)
        self.cache = [conv, state]
        self.offset = int(offset)
        self.lengths = self.left_padding = None

    def check(self) -> None:
        where = f"RecurrentLayer(offset={self.offset}, depth={len(self.marks)})"
        conv, state = self.cache
        if self.lengths is not None or self.left_padding is not None:
            raise InvariantError(f"{where}: batched padding is not supported")
        if (conv is None) != (self.offset == 0) or (state is None) != (self.offset == 0):
            raise InvariantError(f"{where}: conv tail / state present iff tokens were seen")
        if conv is not None and conv.shape[1] != self.conv_tail:
            raise InvariantError(f"{where}: conv tail has {conv.shape[1]} rows, expected {self.conv_tail}")
        self._check_marks(where)
        self._check_kept(where)


class BatchRecurrentLayer(StackedRows, RecurrentLayer):
    """A Gated DeltaNet cache over B rows: conv tails [B, k-1, C], states [B, ...].

    It is a `RecurrentLayer`, so the family adapter records each branch
    forward's inputs here (`Steps` over all B rows), and `commit_rows` cuts
    them per row.

    Outside a branch a right-padded forward (`prepare(lengths=...)`, then
    `finalize()`) sets `lengths`: the model's mask (`make_mask`) then holds
    each row's state through its pads (mlx-lm's recurrence and the chunked
    one both keep the state at a masked step) and zeroes their conv inputs,
    and the conv tail is taken after each row's last real token, so a row's
    tail and state are those of its real tokens only.
    """

    pads_rows = True

    def captures(self, tokens: int) -> bool:
        return False  # rows fed together (PrefillBatch) stop at their stops

    # -- branches --------------------------------------------------------------------

    def fork(self) -> None:
        self.marks.append(_RecurrentMark(0, self.cache[0], self.cache[1]))

    def rollback(self) -> None:
        mark = self.marks.pop()
        self.cache = [mark.conv, mark.state]

    def commit(self, n: int) -> None:
        raise BranchError("a batched recurrent layer commits per row: commit_rows(ns)")

    def commit_rows(self, ns: Sequence[int]) -> None:
        """Keep the first ns[i] recorded tokens of row i and close the branch."""
        mark = self.marks.pop()
        if all(n == mark.appended for n in ns):
            # every row keeps all it fed (none was padded, or it could not commit that many):
            # the live conv tails and states are those rows' exactly, no slicing nor replay
            return
        convs, states = [], []
        for i, n in enumerate(ns):
            conv, state = self._row_prefix(mark, i, n)
            convs.append(conv)
            states.append(state)
        self.cache = _stacked(convs, states)

    # -- tree verify (layers/tree.py): a tree per row ---------------------------------

    takes_row_trees = True

    def take_paths(self, paths: list[list[int]]) -> None:
        """The open branch, holding one tree record (a tree per row), becomes row i's chain of
        `paths[i]`: one chain record whose row i begins with its path's recorded inputs (and
        kept states; past the path, its last node again, never committed), and the live slots
        each row's after its path (the state replayed or kept, the tail from the path's rows)."""
        mark = self.marks[-1]
        (record,) = mark.records
        self._truncate(mark, 0)
        convs, states = [], []
        for i, path in enumerate(paths):
            conv0 = None if mark.conv is None else mark.conv[i : i + 1]
            state0 = None if mark.state is None else mark.state[i : i + 1]
            if path:
                chain = record.along(path, i)
                conv0, state0 = _rebuild(conv0, state0, [chain], [chain], len(path), self.conv_tail)
            convs.append(conv0)
            states.append(state0)
        L = max(len(p) for p in paths)
        if not L:
            self.cache = [mark.conv, mark.state]
            return
        rows = [p + [p[-1]] * (L - len(p)) if p else [0] * L for p in paths]
        at = mx.arange(len(paths))[:, None], mx.array(rows, dtype=mx.int32)
        inputs = {k: (None if v is None else v[at]) for k, v in record.inputs.items()}
        kept = None if record.states is None else [
            mx.concatenate([record.states[r[j]][i] for i, r in enumerate(rows)]) for j in range(L)]
        self._extend(mark, [Steps(record.conv_rows[at], inputs, record.replay, kept)])
        self.cache = _stacked(convs, states)

    def _row_prefix(self, mark: _RecurrentMark, i: int, n: int) -> tuple:
        """Row i's (conv tail, state) after its first n branch tokens, [1, ...] each."""
        conv0 = None if mark.conv is None else mark.conv[i : i + 1]
        state = None if mark.state is None else mark.state[i : i + 1]
        if n == 0:
            return conv0, state
        records = [_row_steps(s, i) for s in mark.records]
        return tuple(_rebuild(conv0, state, records, first_records(records, n), n, self.conv_tail))

    # -- rows -------------------------------------------------------------------------

    def take(self, rows: Sequence[int]) -> None:
        """Keep `rows` (in that order), their branch records included (in new marks: a
        shallow copy of this layer may share the old ones)."""
        rows = list(rows)
        if not rows:
            self.cache = [None, None]
            self.marks = [_RecurrentMark(0, None, None) for _ in self.marks]
        else:
            idx = mx.array(rows, dtype=mx.int32)
            self.cache = [take_rows(a, idx) for a in self.cache]
            self.marks = [
                _RecurrentMark(m.offset, take_rows(m.conv, idx), take_rows(m.state, idx),
                               [_take_steps(s, idx) for s in m.records], m.kept, m.replaying)
                for m in self.marks
            ]
        self.rows = len(rows)

    def row_from(self, state) -> tuple:
        """The arguments of `add_row` for a row holding a `RecurrentLayer`'s committed `state`
        (None: an empty row). Changes nothing."""
        return (None, None) if state is None else tuple(state[:2])

    def add_row(self, conv, state) -> None:
        """Append a row holding (conv, state), [1, ...] each, or nothing (zeros); outside a branch."""
        self._append([conv, state], 1)

    def row_load(self, i: int, tokens: int) -> tuple:
        """The arguments of `RecurrentLayer.load` for row i holding `tokens` tokens."""
        return (*self.row_state(i), tokens)

    def check(self) -> None:
        conv, state = self.cache
        where = f"BatchRecurrentLayer(rows={self.rows}, depth={len(self.marks)})"
        if (conv is None) != (state is None):
            raise InvariantError(f"{where}: conv tail and state present together")
        if conv is not None and (conv.shape[1] != self.conv_tail or not conv.shape[0] == state.shape[0] == self.rows):
            raise InvariantError(f"{where}: conv {conv.shape} / state {state.shape} do not line up")
        if len(self.marks) > 1:
            raise InvariantError(f"{where}: one branch level at most")
        if self.lengths is not None and self.row_offsets is None:
            # a BatchRuntime's layer: a padded forward's mask ends with it (finalize)
            raise InvariantError(f"{where}: padding lengths left set after a forward")

    # -- mlx-lm's batch-cache protocol (ArraysCache.merge, BatchGenerator) --------------------

    @classmethod
    def merge(cls, caches) -> "BatchRecurrentLayer":
        """One row per `RecurrentLayer`, in order; an empty one is a row of zeros (what
        mlx-lm's module starts from), as mlx-lm's `ArraysCache.merge` makes it.

        Raises:
            BranchError: a layer has an open branch; nothing changed.
            UnsupportedOperationError: not all `RecurrentLayer`s of one conv tail, or a
                layer holds more than one row.
        """
        for c in caches:
            if type(c) is not RecurrentLayer:
                raise UnsupportedOperationError(
                    f"RecurrentLayer.merge() of a {type(c).__name__}: merge RecurrentLayers only"
                )
            if c.marks:
                raise BranchError(
                    f"merge() of a RecurrentLayer with {len(c.marks)} open branch(es): "
                    "commit or roll them back first; nothing changed"
                )
            if c.cache[0] is not None and c.cache[0].shape[0] != 1:
                raise UnsupportedOperationError(f"merge() of a layer of {c.cache[0].shape[0]} rows: merge one-row layers")
        tails = {c.conv_tail for c in caches}
        if len(tails) != 1:
            raise UnsupportedOperationError(f"merge() of RecurrentLayers with conv tails {sorted(tails)}: one model's layers")
        first = caches[0]
        layer = cls(first.conv_tail, first.strategy, states_budget_bytes=first.states_budget_bytes)
        for c in caches:
            layer.add_row(*c.cache)
        layer.row_offsets = [c.offset for c in caches]
        layer.offset = max(layer.row_offsets, default=0)
        return layer

    def extract(self, idx: int) -> RecurrentLayer:
        """Row `idx` as a `RecurrentLayer` (its conv tail and state, shared: slots are never written)."""
        self._rows_known("extract")
        out = RecurrentLayer(self.conv_tail, self.strategy, states_budget_bytes=self.states_budget_bytes)
        n = self.row_offsets[idx]
        if n:
            out.cache, out.offset = self.row_state(idx), n
        return out

    def extend(self, other: "BatchRecurrentLayer") -> None:
        """Append `other`'s rows after this layer's (rows without a state are zeros)."""
        if other.conv_tail != self.conv_tail:
            raise UnsupportedOperationError(f"extend(): conv tails {self.conv_tail} and {other.conv_tail}")
        self._extend_rows(other)

    def advance(self, N):
        self._count_rows(N)
        super().advance(N)


def _stacked(convs: list, states: list) -> list:
    """[conv tails, states] of the rows stacked ([1, ...] each; None: a row of zeros)."""
    if all(c is None for c in convs):
        return [None, None]
    like = next(c for c in convs if c is not None), next(s for s in states if s is not None)
    fill = lambda a, ref: mx.zeros((1, *ref.shape[1:]), ref.dtype) if a is None else a
    return [mx.concatenate([fill(c, like[0]) for c in convs]), mx.concatenate([fill(s, like[1]) for s in states])]


def _row_steps(s: Steps, i: int) -> Steps:
    sl = slice(i, i + 1)
    inputs = {k: (None if v is None else v[sl]) for k, v in s.inputs.items()}
    states = None if s.states is None else [a[sl] for a in s.states]
    return Steps(s.conv_rows[sl], inputs, s.replay, states)


def _take_steps(s: Steps, idx: mx.array) -> Steps:
    inputs = {k: take_rows(v, idx) for k, v in s.inputs.items()}
    states = None if s.states is None else [a[idx] for a in s.states]
    return Steps(s.conv_rows[idx], inputs, s.replay, states)
