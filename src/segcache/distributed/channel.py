"""Small messages between the ranks of a group: a few words per step, not per token per rank.

Every message is one `all_gather` of a fixed frame of int64 words per rank
(a second one only when some rank's message overflows the frame):

    frame of rank r:  [ seq | n | w_0 .. w_{F-3} ]     seq = the message's number (same on
                                                       every rank), n = the words rank r sends
    result:           one row per rank, every rank gets every row

On that one collective sit the operations a lockstep loop needs: rank 0's
decision broadcast to the others (`broadcast`, `share` for bytes such as an
admitted request), and every rank's status and fingerprint checked together
(`check`), both at once when rank 0 decides a step (`exchange`).

Collectives must run in the same order on every rank: every rank calls the
same methods in the same order (the loop is the same program on every rank;
rank 0 only fills in the decisions). Messages run on the CPU stream, as
mlx-lm's own synchronisation does.

A lost rank: MLX's ring backend raises "[ring] connection to a peer was lost"
in the others, but not always at once: when the peer dies while a collective
is under way it may return zeros for the peer's part, and a later collective
may block. So every frame carries the message's number (a zero or another
number is a lost or out-of-step rank: `RankLostError`), and with `timeout`
a watchdog ends the process, saying why, when a message waits longer than
that (no rank hangs forever on a dead peer).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import mlx.core as mx
import msgpack
import numpy as np

from ..errors import RankDivergedError, RankFailedError, RankLostError
from ..ranks import fingerprint

FRAME_WORDS = 16  # int64 words per rank per collective: 128 bytes
MAX_WORDS = 1 << 24  # one message at most (128 MiB): a longer count read off a frame is garbage
LOST_EXIT = 75  # the exit status of a rank whose watchdog fired (EX_TEMPFAIL: start the group again)
_WORD = 8
_LO, _HI = -(1 << 63), (1 << 63) - 1


@dataclass
class ChannelStats:
    """What this rank's messages cost.

    Attributes:
        collectives: collectives run (one per message, two when a frame overflowed).
        sent_bytes: bytes this rank put on the wire: a ring all_gather forwards every
            other rank's frame once, so (size - 1) frames per collective.
    """

    collectives: int = 0
    sent_bytes: int = 0


@dataclass(frozen=True)
class Verdict:
    """What `check` found: every rank's status and fingerprint.

    Attributes:
        failed: the ranks that reported a failure.
        fingerprints: per rank, the fingerprint it reported.
    """

    failed: tuple[int, ...]
    fingerprints: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return not self.failed and len(set(self.fingerprints)) == 1

    def error(self, what: str, rank: int, cause: BaseException | None = None):
        """The error every rank raises for a verdict that is not ok."""
        if self.failed:
            own = f" (here: {type(cause).__name__}: {cause})" if cause is not None else ""
            return RankFailedError(
                f"{what}: rank(s) {list(self.failed)} failed{own}; the step was undone on every rank, "
                f"which are all as before it (this is rank {rank})"
            )
        return RankDivergedError(
            f"{what}: the ranks disagree about it (fingerprints {[hex(f & _HI) for f in self.fingerprints]}); "
            "start every rank with the same model, settings and inputs. The step was undone on every rank "
            f"(this is rank {rank})"
        )


@dataclass(frozen=True)
class Step:
    """One lockstep message: rank 0's decision and every rank's verdict."""

    decision: list[int]
    verdict: Verdict


@dataclass
class Channel:
    """Messages over a distributed group (`mx.distributed.init()` by default).

    A group of one runs no collective: every method returns what that rank passed.

    Args:
        group: the group (default: `mx.distributed.init()`).
        frame: int64 words per rank in a message's first collective.
        timeout: seconds a message may wait for the other ranks before this
            rank ends itself (`LOST_EXIT`), or None to wait for ever. The wait
            includes the slowest rank's work up to the same message (its longest
            step, a prefill chunk of a large model included): set it well above.
        on_deadline: called with what waited (on the watchdog's thread, while the
            waiting thread is still blocked) just before a deadline ends the process:
            e.g. a server failing its requests in flight, so clients hear why.
    """

    group: mx.distributed.Group | None = None
    frame: int = FRAME_WORDS
    timeout: float | None = None
    stats: ChannelStats = field(default_factory=ChannelStats)
    on_deadline: Optional[Callable[[str], None]] = None

    def __post_init__(self):
        if self.group is None:
            self.group = mx.distributed.init()
        if self.frame < 3:
            raise ValueError(f"a frame holds at least 3 words, got {self.frame}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {self.timeout!r}")
        self._seq = 0  # collectives run; frame k carries k (never 0: a lost peer's part may read 0)
        self._watchdog = _Watchdog(self) if self.timeout is not None else None

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def leader(self) -> bool:
        """True on rank 0, which decides and shares."""
        return self.rank == 0

    # -- the collective ---------------------------------------------------------------

    def _all_gather(self, words: np.ndarray) -> np.ndarray:
        """[seq | words] from every rank, checked: rows without this message's number are lost ranks."""
        self._seq += 1
        frame = np.concatenate([np.array([self._seq], dtype=np.int64), words])
        self.stats.collectives += 1
        self.stats.sent_bytes += (self.size - 1) * frame.nbytes
        what = f"message {self._seq} of rank {self.rank}"
        try:
            with _armed(self._watchdog, self.timeout, what):
                out = np.array(mx.distributed.all_gather(mx.array(frame), group=self.group, stream=mx.cpu))
        except RuntimeError as exc:  # the ring backend: "[ring] connection to a peer was lost"
            raise RankLostError(f"{what}: {exc}; stop every rank and start them again") from exc
        rows = out.reshape(self.size, -1)
        bad = [r for r in range(self.size) if rows[r, 0] != self._seq]
        if bad:
            raise RankLostError(
                f"{what}: rank(s) {bad} sent no frame for it ({[int(rows[r, 0]) for r in bad]}): lost, or out of "
                "step with this rank; stop every rank and start them again"
            )
        return rows[:, 1:]

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        """Every rank's words, on every rank (row r: rank r's).

        Raises:
            ValueError: a word is not an int in the int64 range (nothing was sent).
            RankLostError: some rank did not take part (lost, or out of step).
        """
        words = [int(w) for w in words]
        if any(not _LO <= w <= _HI for w in words) or len(words) > MAX_WORDS:
            raise ValueError(f"a message is at most {MAX_WORDS} int64 words, each within 64 signed bits")
        if self.size == 1:
            return [words]
        P = self.frame - 2  # payload words in the first frame
        head = np.zeros(P + 1, dtype=np.int64)
        head[0] = len(words)
        head[1 : 1 + min(len(words), P)] = words[:P]
        frames = self._all_gather(head)
        counts = [int(n) for n in frames[:, 0]]
        if any(not 0 <= n <= MAX_WORDS for n in counts):
            raise RankLostError(f"message {self._seq}: a rank sent an impossible length {counts}; stop every rank")
        rows = [frames[r, 1 : 1 + min(n, P)].tolist() for r, n in enumerate(counts)]
        spill = max(counts) - P
        if spill > 0:  # every rank knows every count: one more collective, sized to the longest
            tail = np.zeros(spill, dtype=np.int64)
            rest = words[P:]
            tail[: len(rest)] = rest
            more = self._all_gather(tail)
            rows = [row + more[r, : max(0, counts[r] - P)].tolist() for r, row in enumerate(rows)]
        return rows

    def set_timeout(self, seconds: float | None) -> None:
        """Bound every later message by `seconds` (None: wait for ever), e.g. once every rank has
        loaded its shard (loading a large model takes longer than any step should)."""
        if seconds is not None and not seconds > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {seconds!r}")
        self.timeout = seconds
        if seconds is not None and self._watchdog is None:
            self._watchdog = _Watchdog(self)

    def deadline(self, what: str, seconds: float | None = None):
        """A context in which a wait longer than `seconds` (default: the channel's `timeout`)
        ends the process, saying `what` waited: for the model's own collectives (evaluating a
        step) as the channel does for its messages. Without either, no deadline."""
        seconds = self.timeout if seconds is None else seconds
        if seconds is not None and self._watchdog is None:
            self._watchdog = _Watchdog(self)
        return _armed(self._watchdog if seconds is not None else None, seconds, what)

    # -- what a lockstep loop uses ----------------------------------------------------------

    def broadcast(self, words: Sequence[int] | None = None) -> list[int]:
        """Rank 0's words on every rank; the other ranks pass None (what they pass is ignored)."""
        return self.gather(words if self.leader and words is not None else [])[0]

    def share(self, payload: bytes | None = None) -> bytes:
        """Rank 0's bytes on every rank (an admitted request, msgpack-encoded by the caller)."""
        data = bytes(payload or b"") if self.leader else b""
        pad = (-len(data)) % _WORD
        words = np.frombuffer(data + bytes(pad), dtype="<i8").tolist() if data else []
        got = self.broadcast([len(data), *words])
        n = got[0]
        return np.array(got[1:], dtype="<i8").tobytes()[:n]

    def share_data(self, data=None):
        """Rank 0's plain data (dicts, lists, str, bytes, numbers: an admitted request) on every
        rank, as msgpack: never pickle, so no rank runs what another sent."""
        payload = msgpack.packb(data, use_bin_type=True) if self.leader else None
        return msgpack.unpackb(self.share(payload), raw=False, strict_map_key=False)

    def check(self, ok: bool = True, fingerprint: int = 0) -> Verdict:
        """Every rank's status and fingerprint, on every rank (one collective)."""
        rows = self.gather([0 if ok else 1, fingerprint])
        return Verdict(tuple(r for r, row in enumerate(rows) if row[0]), tuple(row[1] for row in rows))

    def exchange(self, decision: Sequence[int] | None, ok: bool = True, fingerprint: int = 0) -> Step:
        """Rank 0's decision for the next step and every rank's verdict on the last, in one collective."""
        own = [0 if ok else 1, fingerprint] + (list(decision or ()) if self.leader else [])
        rows = self.gather(own)
        verdict = Verdict(tuple(r for r, row in enumerate(rows) if row[0]), tuple(row[1] for row in rows))
        return Step(rows[0][2:], verdict)

    def least(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the prefix every rank holds)."""
        return min(row[0] for row in self.gather([value]))

    def agree(self, ok: bool = True, fingerprint: int = 0, *, what: str = "step",
              cause: BaseException | None = None) -> None:
        """`check`, raising on every rank unless every rank is ok with the same fingerprint.

        Raises:
            RankFailedError: some rank reported a failure.
            RankDivergedError: the fingerprints differ.
        """
        verdict = self.check(ok, fingerprint)
        if not verdict.ok:
            raise verdict.error(what, self.rank, cause) from cause


class _Watchdog:
    """One thread per channel that ends the process when an armed wait outlives its deadline.

    A collective blocked on a dead peer cannot be interrupted from Python; the
    only way not to hang is to leave, saying why, with `LOST_EXIT`. Waits nest
    (a step's deadline around the messages inside it): each keeps its own
    deadline until it ends, and the earliest one counts.
    """

    def __init__(self, channel: "Channel"):
        self.channel = channel
        self._cond = threading.Condition()
        self._armed: list[tuple[float, str]] = []  # (deadline, what) of every wait under way, outermost first
        threading.Thread(target=self._watch, name="segcache-channel-watchdog", daemon=True).start()

    def arm(self, seconds: float, what: str) -> None:
        with self._cond:
            self._armed.append((time.monotonic() + seconds, what))
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            if self._armed:
                self._armed.pop()
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                if not self._armed:
                    self._cond.wait()
                    continue
                deadline, what = min(self._armed)
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                hook = self.channel.on_deadline
                if hook is not None:
                    try:
                        hook(what)
                    except Exception:  # nothing may keep this process from ending
                        pass
                sys.stderr.write(
                    f"segcache: {what} waited past its deadline: another rank is gone or stuck. "
                    f"Stopping this rank (exit {LOST_EXIT}); start every rank again to go on.\n"
                )
                sys.stderr.flush()
                os._exit(LOST_EXIT)


class _armed:
    """Arm the watchdog (if any) around one wait."""

    def __init__(self, watchdog: _Watchdog | None, seconds: float | None, what: str):
        self.watchdog, self.seconds, self.what = watchdog, seconds, what

    def __enter__(self):
        if self.watchdog is not None:
            self.watchdog.arm(self.seconds, self.what)

    def __exit__(self, *exc):
        if self.watchdog is not None:
            self.watchdog.disarm()
        return False
