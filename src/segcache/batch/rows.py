"""The rows a decoder steps, and one Runtime as a row.

`BatchDecoder` drives its rows through this small protocol, which
`BatchRuntime` implements for B rows in shared batched layers:

    ids, lengths           the rows in order; tokens each holds (its branch included)
    join(id, rt) / leave   a row joins between steps from a Runtime / leaves (its branch with it)
    forward(tokens)        one model call: a token list per row (ragged only in a branch),
                           or an unread [B, S] array (ids recorded later by `fill`)
    fork / commit(ns) / rollback      one branch level; row i keeps ns[i] of its branch
    forward_trees / keep_paths        a tree of drafts per row in one forward; a path kept per row
                                      (takes_trees says where: batch/tree_rows.py, tree_rounds.py)
    copy_row(id) / to_runtime(id)     a row on its own (its branch with it) / as a Runtime

`OneRow` is the same protocol over one `Runtime`, used in place, so a single
sequence is a batch of one without leaving the Runtime: every layer kind
mlx-lm has (the batched kinds cover fewer), nested branches outside the
decoder's, and forwards outside a branch that run exactly mlx-lm's code path.
Unread tokens may be fed outside a branch (the Runtime's ledger reads them
later), so a plain decode step needs no branch at all (`lookahead_in_branch`).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import mlx.core as mx

from ..errors import BranchError, InvariantError
from ..runtime import Runtime


class OneRow:
    """One Runtime as a batch of at most one row (the Runtime itself, not a copy).

    Invariants: `runtime` is None iff there is no row; `_branch` is the open
    branch the decoder forked (None when none is open), always the runtime's
    innermost one.
    """

    # A plain step's next forward may run outside a branch: a lone row never
    # waits for a join, so its lookahead needs no branch to be dropped.
    lookahead_in_branch = False

    def __init__(self, model):
        self.model = model
        self.runtime: Runtime | None = None
        self.row_id = None
        self._branch = None

    @property
    def ids(self) -> list:
        return [] if self.runtime is None else [self.row_id]

    def __len__(self) -> int:
        return 0 if self.runtime is None else 1

    @property
    def lengths(self) -> list[int]:
        return [] if self.runtime is None else [self.runtime.offset]

    @property
    def branch_open(self) -> bool:
        return self._branch is not None

    def tokens(self, row_id) -> list:
        self._row(row_id)
        return self.runtime.tokens

    def join(self, row_id, runtime: Runtime | None = None) -> None:
        """The row is `runtime` itself (a fresh one if None): fed, forked and committed in place."""
        if self.runtime is not None:
            raise ValueError(f"join({row_id!r}): this decoder holds one row, {self.row_id!r}, already")
        if runtime is None:
            runtime = Runtime(self.model)
        if runtime.model is not self.model:
            raise ValueError("join(): the runtime is of another model")
        self.runtime, self.row_id = runtime, row_id

    def leave(self, *row_ids) -> None:
        """The row leaves; a branch the decoder left open on it is rolled back."""
        for row_id in row_ids:
            self._row(row_id)
        if row_ids:
            if self._branch is not None and self._branch.open:
                self._branch.rollback()
            self._branch = None
            self.runtime = self.row_id = None

    def forward(self, tokens: Sequence[Sequence[int]] | mx.array) -> mx.array:
        if isinstance(tokens, mx.array):
            if tokens.ndim != 2 or tokens.shape[0] != len(self):
                raise ValueError(f"forward(): an array of [{len(self)}, S] tokens, got {tokens.shape}")
            return self.runtime.forward(tokens[0])
        if len(tokens) != len(self):
            raise ValueError(f"forward(): one non-empty token list per row ({len(self)} rows)")
        return self.runtime.forward(list(tokens[0]))

    def fill(self, ids: Sequence[Sequence[int]]) -> None:
        """Nothing to do: the Runtime's ledger reads unread tokens when asked."""

    def fork(self) -> None:
        if self._branch is not None:
            raise BranchError("fork(): a branch is open already (batches keep one level)")
        self._branch = self.runtime.fork()

    def commit(self, ns: Sequence[int]) -> None:
        if self._branch is None:
            raise BranchError("commit() with no open branch: fork() first")
        (n,) = ns
        self._branch.commit(n)
        self._branch = None

    def rollback(self) -> None:
        if self._branch is None:
            raise BranchError("rollback() with no open branch")
        self._branch.rollback()
        self._branch = None

    @property
    def takes_trees(self) -> bool:
        """Whether the row's Runtime verifies trees (tree_rounds.py)."""
        return self.runtime is not None and self.runtime.takes_trees

    def forward_trees(self, tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]) -> mx.array:
        """The row's tree in one forward (`Runtime.forward_tree`), in the decoder's branch: [1, N, V]."""
        if len(tokens) != len(self) or len(parents) != len(self):
            raise ValueError(f"forward_trees(): one tree per row ({len(self)} rows)")
        return self.runtime.forward_tree(tokens[0], parents[0])

    def keep_paths(self, paths: Sequence[Sequence[int]]) -> list[int]:
        """The row's branch becomes the chain of its path (`Runtime.keep_path`) and stays open."""
        (path,) = paths
        return [self.runtime.keep_path(list(path))]

    def copy_row(self, row_id) -> "OneRow":
        """This row as another OneRow over a clone (committed state only: no open branch)."""
        self._row(row_id)
        if self._branch is not None:
            raise BranchError("copy_row() of a lone row with its branch open: settle it first")
        other = OneRow(self.model)
        other.join(row_id, self.runtime.clone())
        return other

    def to_runtime(self, row_id) -> Runtime:
        """The row's Runtime itself (no copy)."""
        self._row(row_id)
        if self._branch is not None:
            raise BranchError("to_runtime() with a branch open: commit or roll it back first")
        return self.runtime

    def check(self) -> None:
        if self.runtime is not None:
            self.runtime.check()
            if self._branch is not None and not self._branch.open:
                raise InvariantError("the decoder's branch on the row was closed behind its back")

    def _row(self, row_id: Hashable) -> None:
        if self.runtime is None or row_id != self.row_id:
            raise KeyError(f"no row {row_id!r} here (rows: {self.ids})")

    def __repr__(self) -> str:
        return f"OneRow({self.row_id!r}: {self.runtime!r}, branch={self.branch_open})"
