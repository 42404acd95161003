"""The branch stack of layers whose state is snapshotted, not offset (window, recurrent).

A mark is the layer's state before the branch (taken by `_snapshot`, put back
by `_restore`) plus `records`: what the branch appended, in order, in the form
the layer needs to rebuild any prefix of it (`_commit_prefix`). A nested
branch that commits everything hands its records to the enclosing one.
"""

from __future__ import annotations

from ..errors import InvariantError


class SnapshotBranches:
    """Mixin: `fork` / `commit` / `rollback` / savepoints over snapshot marks.

    The layer provides `offset`, `marks` (a list), and
    `_snapshot() -> mark` (a mark has `offset`, `records` and `appended`),
    `_restore(mark)` and `_commit_prefix(mark, n)` for 0 <= n < mark.appended.
    """

    @property
    def committed_offset(self) -> int:
        """Tokens outside every open branch."""
        return self.marks[0].offset if self.marks else self.offset

    def branch_offsets(self) -> list[int]:
        return [m.offset for m in self.marks]

    def fork(self) -> None:
        self.marks.append(self._snapshot())

    def rollback(self) -> None:
        self._restore(self.marks.pop())

    def commit(self, n: int) -> None:
        mark = self.marks.pop()
        if n == mark.appended:
            if self.marks:
                self._extend(self.marks[-1], mark.records)
            return
        self._commit_prefix(mark, n)

    def _extend(self, mark, records: list) -> None:
        """Append `records` to `mark` (a layer that counts what records hold overrides this)."""
        mark.records.extend(records)

    def _truncate(self, mark, count: int) -> None:
        """Keep the first `count` records of `mark`."""
        del mark.records[count:]

    def savepoint(self):
        """Cheap: array references (dropped before anything is evaluated on success)."""
        return self._snapshot(), len(self.marks[-1].records) if self.marks else 0

    def restore(self, point) -> None:
        """Undo a forward that failed half-way."""
        mark, count = point
        self._restore(mark)
        if self.marks:
            self._truncate(self.marks[-1], count)

    def _check_marks(self, where: str) -> None:
        ends = [m.offset for m in self.marks[1:]] + [self.offset]
        for mark, end in zip(self.marks, ends):
            if mark.offset + mark.appended != end:
                raise InvariantError(
                    f"{where}: a branch from {mark.offset} recorded {mark.appended} tokens "
                    f"but the next level begins at {end}"
                )
