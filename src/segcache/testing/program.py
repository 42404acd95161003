"""A failing state-machine program as calls a user can paste and run again.

Hypothesis reports a shrunk stateful counterexample as lines such as

    state = RuntimeMachine_qwen3_5_auto_auto()
    Draw 1: [7, 3]
    state.forward(data=data(...), how='list')
    state.consistent()

where the `Draw` lines are what the next step's `data` handed out and the
invariant lines follow every step. `render` folds the draws into the call they
belong to (`data=drawn([7, 3])`) and leaves the invariants to `Stepper`, which
runs them after each call as hypothesis did, so the program is short and runs:

    state = Stepper(MachineClass())
    state.forward(data=drawn([7, 3]), how='list')
    state.teardown()
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Iterator, Sequence

_INVARIANT = "hypothesis_stateful_invariant"  # hypothesis.stateful's marker on @invariant methods
_DRAW = re.compile(r"^Draw \d+(?: \([^)]*\))?: (.*)$")
_DATA = "data=data(...)"


class drawn:  # noqa: N801  (reads as a call in a pasted program: data=drawn([1, 2], 0))
    """Stands in for hypothesis's `data` argument: each `draw` returns the next recorded value."""

    def __init__(self, *values: Any):
        self._values: Iterator[Any] = iter(values)

    def draw(self, strategy=None, label=None) -> Any:
        try:
            return next(self._values)
        except StopIteration:
            raise AssertionError("the program drew more values than it recorded: the code changed since") from None


def invariants(machine: type) -> list[str]:
    """The names of `machine`'s @invariant methods."""
    return [name for name, f in inspect.getmembers(machine) if getattr(f, _INVARIANT, None) is not None]


class Stepper:
    """A state machine whose every call is followed by its invariants, as under hypothesis."""

    def __init__(self, machine):
        self._machine = machine
        self._invariants = invariants(type(machine))
        self._check()

    def _check(self) -> None:
        for name in self._invariants:
            getattr(self._machine, name)()

    def __getattr__(self, name: str):
        step = getattr(self._machine, name)
        if name == "teardown":
            return step

        def call(*args, **kwargs):
            out = step(*args, **kwargs)
            self._check()
            return out

        return call


def render(notes: Sequence[str], machine: type, construct: str) -> tuple[list[str], int]:
    """Hypothesis's notes of a failing stateful run as a program of calls.

    Args:
        notes: the failure's `__notes__` (the lines hypothesis prints).
        machine: the machine class (to know its invariants).
        construct: the line that makes the machine, in place of hypothesis's `state = ...()`.

    Returns:
        (lines, calls): the program, and how many rule calls it makes.
    """
    skip = {f"state.{name}()" for name in invariants(machine)}
    lines: list[str] = []
    draws: list[str] = []
    calls = 0
    started = False
    for note in notes:
        note = note.rstrip()
        if note.startswith("state = "):
            lines.append(construct)
            started = True
            continue
        if not started or note in skip:
            continue
        found = _DRAW.match(note)
        if found:
            draws.append(found.group(1))
            continue
        if note.startswith("state."):
            if _DATA in note:
                note = note.replace(_DATA, f"data=drawn({', '.join(draws)})")
                draws = []
            if note != "state.teardown()":
                calls += 1
            lines.append(note)
    return lines, calls
