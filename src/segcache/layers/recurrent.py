"""Recurrent segment (conv tail + SSM state) with transaction-scoped exact replay.

Outside a branch this is mlx-lm's `ArraysCache(size=2)`: slot 0 the conv tail
(last k-1 conv inputs), slot 1 the recurrent state, both replaced (never
written in place) by every forward. The model runs its own code on it.

Inside a branch the model family's adapter (segcache.adapters) hands over what
the recurrence consumed, one `Steps` per forward call. The branch keeps the
pre-branch tail and state by reference. `commit(n)` then rebuilds:

    conv inputs:  [ tail before branch (k-1) | rows of step 1 .. T ]
                                   tail after n = rows n .. n+k-2
    state after n = replay of steps 1..n from the pre-branch state
                    ("replay"), or the state kept at step n ("states")

Both give the bits a forward of exactly those n tokens gives: the same
per-token recurrence runs on the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import BranchError, InvariantError
from .protocol import CHECKPOINT
from .snapshots import SnapshotBranches

STRATEGIES = ("replay", "states")


@dataclass
class Steps:
    """What one forward call inside a branch fed the recurrence (time is axis 1).

    Attributes:
        conv_rows: the conv inputs this call appended, [B, S, C].
        inputs: recurrence inputs, each [B, S, ...], sliced by time on commit.
        replay: (inputs, state) -> state after those inputs, the same kernel the forward ran.
        states: with the "states" strategy, the state after each of the S steps.
    """

    conv_rows: mx.array
    inputs: dict[str, mx.array | None]
    replay: Callable[[dict, mx.array | None], mx.array]
    states: list[mx.array] | None = None

    @property
    def length(self) -> int:
        return self.conv_rows.shape[1]

    def first(self, n: int) -> "Steps":
        if n == self.length:
            return self
        cut = {k: (None if v is None else v[:, :n]) for k, v in self.inputs.items()}
        states = None if self.states is None else self.states[:n]
        return Steps(self.conv_rows[:, :n], cut, self.replay, states)


@dataclass
class _RecurrentMark:
    offset: int
    conv: mx.array | None  # slot 0 before the branch; immutable, shared by reference
    state: mx.array | None  # slot 1 before the branch; immutable, shared by reference
    records: list[Steps] = field(default_factory=list)  # private to the branch, in call order

    @property
    def appended(self) -> int:
        return sum(s.length for s in self.records)


class RecurrentLayer(SnapshotBranches, ArraysCache):
    """mlx-lm's two-slot `ArraysCache` plus a token count and a branch stack.

    Args:
        conv_tail: k-1, the rows of conv input the layer keeps.
        strategy: "replay" (keep inputs, replay the accepted prefix on commit) or
            "states" (keep the state after every branch token).
    """

    def __init__(self, conv_tail: int, strategy: str = "replay"):
        super().__init__(size=2)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.conv_tail = conv_tail
        self.strategy = strategy
        # ArraysCache has no offset; models call advance(S) after each forward.
        self.offset = 0
        # marks[i]: state before open branch i and the steps i fed the recurrence.
        self.marks: list[_RecurrentMark] = []
        # Blocks of at least this many tokens run the chunked recurrence outside
        # branches (adapters.chunked); None: always mlx-lm's path. Set by Runtime.
        self.chunked_from: int | None = None

    @property
    def capturing(self) -> bool:
        """True inside a branch: the adapter must hand over what the recurrence consumes."""
        return bool(self.marks)

    def advance(self, N):
        super().advance(N)
        self.offset += N

    def record(self, steps: Steps) -> None:
        self.marks[-1].records.append(steps)

    def _snapshot(self) -> _RecurrentMark:
        return _RecurrentMark(self.offset, self.cache[0], self.cache[1])

    def _restore(self, mark: _RecurrentMark) -> None:
        self.cache = [mark.conv, mark.state]
        self.offset = mark.offset

    def _commit_prefix(self, mark: _RecurrentMark, n: int) -> None:
        if n == 0:
            self._restore(mark)
            return
        kept = _first_steps(mark.records, n)
        rows = [s.conv_rows for s in mark.records]
        before = mark.conv
        if before is None:
            first = rows[0]
            before = mx.zeros((first.shape[0], self.conv_tail, first.shape[2]), first.dtype)
        conv_inputs = mx.concatenate([before, *rows], axis=1)
        conv = mx.contiguous(conv_inputs[:, n : n + self.conv_tail, :])
        if self.strategy == "states":
            state = kept[-1].states[-1]
        else:
            state = mark.state
            for steps in kept:
                state = steps.replay(steps.inputs, state)
        self.cache = [conv, state]
        self.offset = mark.offset + n
        if self.marks:
            self.marks[-1].records.extend(kept)

    def clone(self) -> "RecurrentLayer":
        """An independent layer holding the committed state (arrays shared, never written)."""
        other = RecurrentLayer(self.conv_tail, self.strategy)
        other.chunked_from = self.chunked_from
        if self.marks:
            base = self.marks[0]
            other.cache, other.offset = [base.conv, base.state], base.offset
        else:
            other.cache, other.offset = list(self.cache), self.offset
        return other

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
        for mark in self.marks:
            if self.strategy == "states" and any(len(s.states) != s.length for s in mark.records):
                raise InvariantError(f"{where}: a step record lacks its per-token states")


def _first_steps(steps: list[Steps], n: int) -> list[Steps]:
    out = []
    for s in steps:
        if n <= 0:
            break
        take = min(n, s.length)
        out.append(s.first(take))
        n -= take
    return out
