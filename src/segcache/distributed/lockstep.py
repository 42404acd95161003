"""A step that every rank of a group runs, or none does.

MLX is lazy: building a forward runs no collective, evaluating it does. So a
step is built on every rank first, the ranks then agree (one small
collective), and only then is it evaluated:

    rank r:   savepoint ── build the step's graph ── check(ok, fingerprint) ──┬─ all ok: evaluate
                                                                              └─ else: undo, raise on every rank

A rank whose build raised reports it; a rank whose inputs differ from the
others' (the fingerprint: what it is about to feed, at which offsets) is
caught the same way. Then every rank returns to its savepoint, which also
drops the abandoned graph (its collectives included) so that nothing of it
runs later, and raises `RankFailedError` / `RankDivergedError`: the request
fails on every rank and every rank's runtime is as before the step.

What no agreement can cover: a rank that dies or fails while a step is being
evaluated. The ring backend then raises "[ring] connection to a peer was lost"
in the other ranks' next collective (tests/test_distributed.py kills a rank);
the deployment is over and a restart resumes from each rank's store.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from .channel import Channel

T = TypeVar("T")


def lockstep(channel: Channel, build: Callable[[], T], runtimes: Sequence, *, fingerprint: int = 0,
             what: str = "step") -> T:
    """Build a step with `build()` on every rank; return its (unevaluated) result once all agree.

    Args:
        channel: the group's channel.
        build: builds the step's graph (forwards, commits of the last step, ...) and
            returns what the caller evaluates next. It must not evaluate anything
            that holds a collective.
        runtimes: the runtimes the step changes (their `savepoint` / `undo`).
        fingerprint: what this rank is about to run (`channel.fingerprint(...)` of
            the step's inputs and offsets); every rank must pass the same.
        what: names the step in errors.

    Returns:
        What `build()` returned; evaluate it next, in the same order on every rank.

    Raises:
        RankFailedError: some rank's build raised; every rank undid the step.
        RankDivergedError: the fingerprints differ; every rank undid the step.
    """
    points = [rt.savepoint() for rt in runtimes]
    error = None
    try:
        result = build()
    except Exception as exc:  # reported to every rank; KeyboardInterrupt and the like end the process
        result, error = None, exc
    verdict = channel.check(error is None, fingerprint)
    if verdict.ok:
        return result  # the savepoints go now, before anything is evaluated (buffers stay in place)
    for rt, point in zip(runtimes, points):
        rt.undo(point)
    raise verdict.error(what, channel.rank, error) from error
