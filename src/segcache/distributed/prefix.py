"""A prefix is a hit only if every rank holds it.

The ranks of a group must feed the same chunks (their collectives pair up
by order and shape), so a prefill resumes where every rank resumes or not at
all. Each rank looks its prompt up in its own store; then

    agree_resume:   every rank's (held, resume, stops) ─┬─ the same everywhere: resume there
                                                        ├─ stops differ: resume, no extra checkpoint
                                                        └─ resumes differ: every rank computes from held
    restore (each rank its own records)
    agree_restored: every rank restored? ── else every rank undoes its restore and computes

Two messages per prefill, before any rank runs a forward of it. A rank
whose store lost records (evicted, deleted) makes the others compute too,
and every rank publishes again, so the group heals.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import RankDivergedError
from .channel import Channel, fingerprint


def agree_resume(channel: Channel, held: int, resume: int, stops: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """What every rank resumes: (tokens, stops) if every rank found the same; else (held, ()).

    Args:
        held: prompt tokens the rank's runtime holds before the prefill.
        resume: the tokens its store can restore (held when it restores nothing).
        stops: positions its prefill would checkpoint on the way (besides the caller's).

    Raises:
        RankDivergedError: the ranks hold different prefixes already (not a store
            matter: the runtimes are out of step).
    """
    rows = channel.gather([held, resume, fingerprint(sorted(stops))])
    if len({r[0] for r in rows}) != 1:
        raise RankDivergedError(
            f"prefill: the ranks' runtimes hold different prefixes ({[r[0] for r in rows]} tokens); "
            "every rank must run the same requests in the same order"
        )
    if len({r[1] for r in rows}) != 1:
        return held, ()  # some rank lacks the prefix: every rank computes
    if len({r[2] for r in rows}) != 1:
        return resume, ()
    return resume, tuple(stops)


def agree_restored(channel: Channel, ok: bool) -> bool:
    """True if every rank restored what was agreed (else each undoes its restore and computes)."""
    return not channel.check(ok).failed
