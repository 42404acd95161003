"""Drafter segments: state a drafter keeps over the target's positions, carried by a Runtime.

A drafter that keeps a cache over the target's positions (the MTP head's attention
cache, later a DFlash drafter's projected context) keeps it as a segment of the
target's runtime: it forks, commits, rolls back, clones and is checked with the
runtime's layers, and the prefix store saves it with the prompt. The runtime knows
a segment only through this protocol (nothing here imports a drafter):

    seg.name                     its records' name in the store ("mtp")
    seg.offset                   target tokens its state accounts for; None while stale
    seg.forwarded(tokens)        after every forward through the runtime (the ids fed: a list
                                 or an unread [S] array); the segment reads what it needs of
                                 the forward itself (the MTP head: the hidden-state tap)
    seg.fork() / commit(n) / rollback()     with the runtime's branch stack
    seg.clone()                  copy-on-write, its committed state only
    seg.mark() / back(mark)      around one forward (cheap: no buffer reference)
    seg.savepoint() / restore(point)        for `Runtime.undo`
    seg.invalidate()             the runtime's state was replaced (`restore`): stale until loaded
    seg.state                    arrays to evaluate with the layers' (a prefill's chunks)
    seg.check(offset, bases)     its invariants, against the runtime's tokens and branch bases

A stale segment holds nothing and ignores forwards and branches: its drafter
computes what it needs another way (the MTP head: one forward of the prefix, as
before segments existed), and the store publishes nothing of it.

Kinds register a maker by name (`register`), so `Runtime(model, mtp=...)` builds one
without runtime.py importing the drafter's package.
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import InvariantError

# name -> maker(model, value) -> a segment; filled by the drafters' packages when imported
_MAKERS: dict[str, Callable[[Any, Any], Any]] = {}


def register(name: str, maker: Callable[[Any, Any], Any]) -> None:
    """Make `name=` a Runtime argument: `maker(model, value)` builds the segment."""
    _MAKERS[name] = maker


def make(name: str, model, value):
    """The segment `Runtime(model, name=value)` carries (the maker says what `value` may be).

    Raises:
        ValueError: no maker of that name is registered (its package was not imported).
    """
    maker = _MAKERS.get(name)
    if maker is None:
        raise ValueError(f"{name}={value!r:.60}: no drafter segment named {name!r} is registered; "
                         f"import segcache.{name} first, or pass the drafter's object itself")
    return maker(model, value)


class Drafters:
    """A runtime's drafter segments, each by its name; every call goes to all of them.

    With none attached every call is a loop over an empty tuple: nothing on the hot path.
    """

    __slots__ = ("segments",)

    def __init__(self, segments=()):
        self.segments = tuple(segments)
        names = [s.name for s in self.segments]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter segments {names}: one of each name")

    def __bool__(self) -> bool:
        return bool(self.segments)

    def get(self, name: str):
        """The segment of that name, or None."""
        return next((s for s in self.segments if s.name == name), None)

    def attach(self, segment) -> "Drafters":
        """These segments and `segment` (replacing one of the same name)."""
        return Drafters([s for s in self.segments if s.name != segment.name] + [segment])

    def forwarded(self, tokens) -> None:
        for s in self.segments:
            s.forwarded(tokens)

    def fork(self) -> None:
        for s in self.segments:
            s.fork()

    def commit(self, n: int) -> None:
        for s in self.segments:
            s.commit(n)

    def rollback(self) -> None:
        for s in self.segments:
            s.rollback()

    def clone(self) -> "Drafters":
        return Drafters([s.clone() for s in self.segments]) if self.segments else self

    def mark(self) -> tuple:
        return tuple(s.mark() for s in self.segments)

    def back(self, marks: tuple) -> None:
        for s, m in zip(self.segments, marks):
            s.back(m)

    def savepoint(self) -> tuple:
        return tuple(s.savepoint() for s in self.segments)

    def restore(self, points: tuple) -> None:
        for s, p in zip(self.segments, points):
            s.restore(p)

    def invalidate(self) -> None:
        for s in self.segments:
            s.invalidate()

    @property
    def state(self) -> list:
        return [s.state for s in self.segments]

    def check(self, offset: int, bases: list[int]) -> None:
        """Every segment's invariants; a live one accounts for exactly the runtime's `offset` tokens."""
        for s in self.segments:
            try:
                s.check(offset, bases)
            except InvariantError as exc:
                raise InvariantError(f"drafter segment {s.name!r}: {exc}") from None
            if s.offset is not None and s.offset != offset:
                raise InvariantError(f"drafter segment {s.name!r} holds {s.offset} tokens, the runtime {offset}")
