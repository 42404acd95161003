"""The per-token states a recurrent branch keeps within a budget, shared by both recurrent kinds.

With the "states" strategy a branch keeps the state after every token it fed,
so commit(n) is a lookup; those states cost memory per token (about 70 MiB per
token at Qwen3-Next sizes), so a layer keeps them only within its budget. A
forward that would pass it keeps none, and its branch replays from then on
("replaying"): commit(n) then replays the recorded inputs from the last kept
state. Both are exact.

A record (`Steps`, `Call`) has `length` and `states`: None, or one state per
token (an array, or a tuple of slot arrays). A mark has `records`, `kept` (the
states its records keep) and `replaying`.
"""

from __future__ import annotations

from ..errors import InvariantError


class KeptStates:
    """Mixin over `marks`, `strategy` and `states_budget_bytes`: what the open branches keep."""

    def keeps_states(self, steps: int, state_bytes: int) -> bool:
        """Whether a forward of `steps` tokens inside the branch keeps its per-token states.

        True with "states" while the open branches' kept states plus these stay
        within the budget; once a forward does not fit, its branch replays.
        """
        if self.strategy != "states" or self.marks[-1].replaying:
            return False
        return (self.kept_states + steps) * state_bytes <= self.states_budget_bytes

    @property
    def kept_states(self) -> int:
        """Per-token states the open branches keep (their bytes are within the budget)."""
        return sum(m.kept for m in self.marks)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the per-token states the open branches keep."""
        return sum(
            a.nbytes
            for m in self.marks
            for r in m.records
            if r.states
            for s in r.states
            for a in (s if isinstance(s, (list, tuple)) else (s,))
            if a is not None
        )

    def record(self, record) -> None:
        """Add what one forward inside the innermost branch fed the recurrence."""
        self._extend(self.marks[-1], [record])

    def _extend(self, mark, records: list) -> None:
        mark.records.extend(records)
        mark.kept += sum(len(r.states) for r in records if r.states)
        mark.replaying = mark.replaying or any(r.states is None for r in records)

    def _truncate(self, mark, count: int) -> None:
        del mark.records[count:]
        mark.kept = sum(len(r.states) for r in mark.records if r.states)
        mark.replaying = any(r.states is None for r in mark.records)

    def _check_kept(self, where: str) -> None:
        for mark in self.marks:
            if any(r.states is not None and len(r.states) != r.length for r in mark.records):
                raise InvariantError(f"{where}: a record keeps states for only some of its tokens")
            if self.strategy == "replay" and any(r.states is not None for r in mark.records):
                raise InvariantError(f"{where}: a replay branch kept per-token states")
            if mark.kept != sum(len(r.states) for r in mark.records if r.states):
                raise InvariantError(f"{where}: the count of kept states is off")
            if mark.replaying != any(r.states is None for r in mark.records):
                raise InvariantError(f"{where}: the replaying flag disagrees with the records")
        if self.kept_bytes > self.states_budget_bytes:
            raise InvariantError(f"{where}: {self.kept_bytes} B of kept states, budget {self.states_budget_bytes} B")


def first_records(records: list, n: int) -> list:
    """The records cut to their first n tokens in total, keeping record boundaries."""
    out = []
    for r in records:
        if n <= 0:
            break
        take = min(n, r.length)
        out.append(r.first(take))
        n -= take
    return out
