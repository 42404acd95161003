"""The scheduler and the one model thread that runs it.

    HTTP handlers ── submit(job) ──> waiting (FIFO, at most max_queue) ──> running (max_running)
                                                                             │ step(): one token each
    client stream <── loop.call_soon_threadsafe(deliver, event) <────────────┘

With `max_running` 1 (the default) a request runs alone from its first step
to its last, and the next waits in arrival order. With --decode-concurrency N
it admits N, and the engine (engine.py) runs one decoder step over the
running rows per scheduler step (`begin_step` marks the step). Cancellation
(a client gone) is a flag read at the next step: the job's generator is
closed there, which publishes what the client received and frees its row. A
job cancelled while it waits leaves the queue at once; the queue's limit and
`pending` count only jobs whose client is still there.

A `Flusher` thread writes the prefix store's new records (published when each
prompt's prefill ends) to disk every --flush-interval seconds, 1 MB per hold of
the store's lock and 10 ms apart, so a crash loses at most that long of work and
decoding steps neither wait for the disk (decoding does not touch the store) nor
for the GIL for long.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import mlx.core as mx

from .engine import Early, Engine, Failure, Finish, GenRequest

log = logging.getLogger("segcache.serve")

FLUSH_EVERY = 10.0  # seconds (--flush-interval): under sustained load, write published records at least this often
# A flush is spread out: writing holds the GIL (copies out of MLX, b"".join) in stretches
# that the model thread's decode steps wait on. bench/flush.py, two loaded cores, decode step
# median while writing / without: 4 MB chunks 1 ms apart 2.02x, 1 MB chunks 10 ms apart 1.03x.
FLUSH_CHUNK = 1 << 20  # bytes of records written per hold of the store's lock
FLUSH_PAUSE = 0.01  # seconds between two chunks: 40 MB take about a second


class QueueFull(Exception):
    """The waiting queue holds max_queue jobs already."""


class Job:
    """One request in the scheduler. `deliver` is called on the worker thread with each event."""

    def __init__(self, request: GenRequest, deliver: Callable[[object], None]):
        self.request = request
        self.deliver = deliver
        self.cancelled = False  # set by the HTTP side, read by the worker at each step
        self.steps = None  # the engine's generator once admitted
        self.delivered = False  # an event went to the client (its row decoded: the engine logs its line)
        self.scheduler: "Scheduler | None" = None  # set by submit: a cancelled waiting job leaves it at once
        self.queued = time.monotonic()

    def cancel(self) -> None:
        """The client is gone (or the answer ended): stop at the next step, or leave the queue now."""
        if self.cancelled:
            return
        self.cancelled = True
        if self.scheduler is not None:
            self.scheduler.withdraw(self)


class Scheduler:
    """A bounded FIFO of jobs and the step loop that serves them.

    Invariants: the live jobs (`_live`: waiting, and running but not cancelled) <= max_queue +
    max_running; no waiting job is cancelled (`withdraw` takes it out); the running jobs' rows
    (a job of n choices: n) <= max_running, or one job runs; a job is in at most one of them;
    every running job has its generator.
    """

    def __init__(self, engine: Engine, max_queue: int = 64, max_running: int = 1,
                 begin_step: Callable[[], None] = lambda: None):
        self.engine = engine
        self.max_queue = max_queue
        self.max_running = max_running  # the engine's decode_concurrency
        self.begin_step = begin_step  # called before each step advances the running jobs
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self._cond = threading.Condition()
        self._stopping = False

    def submit(self, job: Job) -> None:
        """Queue a job.

        Raises:
            QueueFull: max_queue jobs are waiting; nothing was queued.
        """
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            # a free running slot counts too: a job always passes through `waiting`
            if self._live() >= self.max_queue + self.max_running:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (--max-queue {self.max_queue})")
            job.scheduler = self
            self.waiting.append(job)
            self._cond.notify()

    def _live(self) -> int:
        """Jobs waiting or running whose client is still there (the caller holds the lock)."""
        return len(self.waiting) + sum(1 for job in self.running if not job.cancelled)

    def withdraw(self, job: Job) -> None:
        """A cancelled job leaves the queue now if it still waits (any thread; a running one
        stops at its next step, and counts no more meanwhile)."""
        with self._cond:
            try:
                self.waiting.remove(job)
            except ValueError:
                return  # running (or done): the worker drops it at its next step
        log.info("%s: client gone after %.3f s in the queue; nothing computed", job.request.id,
                 time.monotonic() - job.queued)

    def pending(self) -> int:
        """Jobs waiting or running, not counting those whose client is gone."""
        with self._cond:
            return self._live()

    def step(self) -> bool:
        """Admit waiting jobs up to max_running and advance each running job by one token.

        Returns:
            True if any job was advanced.
        """
        with self._cond:
            # rows: a request of n choices decodes n rows (always admitted when nothing runs)
            rows = sum(job.request.n for job in self.running)
            while self.waiting and (not self.running or rows + self.waiting[0].request.n <= self.max_running):
                job = self.waiting.popleft()
                if not job.cancelled:  # a client gone while waiting costs nothing
                    self.running.append(job)
                    rows += job.request.n
        self.begin_step()
        for job in list(self.running):
            if job.steps is None:
                job.steps = self.engine.generate(job.request)
            self._advance(job)
        return bool(self.running) or bool(self.waiting)

    def _advance(self, job: Job) -> None:
        if job.cancelled:
            if not job.delivered:  # gone while prefilling: the engine logs rows that decoded
                log.info("%s: client gone during its prefill (%.3f s after it queued)", job.request.id,
                         time.monotonic() - job.queued)
            self._drop(job)
            return
        while True:
            try:
                event = next(job.steps)
            except StopIteration:
                self._drop(job)
                return
            except Exception as exc:  # an error in one request must not stop the others
                log.exception("%s failed", job.request.id)
                self._drop(job)
                job.deliver(Failure(f"generation failed: {type(exc).__name__}: {exc}"))
                return
            if event is None:  # no token for this job in this step (it waits to join the batch)
                return
            events = event if isinstance(event, list) else [event]
            if any(isinstance(e, Finish) and e.last for e in events):
                self._drop(job)
                self._maybe_flush()  # before the answer ends: a finished request is on disk
            job.delivered = True
            for e in events:
                job.deliver(e)
            if not isinstance(event, Early):  # an Early list: the generator goes on now, in this step
                return

    def _drop(self, job: Job) -> None:
        try:
            job.steps.close()  # settles and publishes a cancelled job's runtime
        except Exception:
            log.exception("%s: closing its generation failed", job.request.id)
        with self._cond:
            self.running.remove(job)

    def _maybe_flush(self) -> None:
        """Flush on the model thread when nothing else waits (the timer covers sustained load)."""
        with self._cond:
            idle = not self.running and not self.waiting
        if idle:
            self.engine.flush()

    def run(self) -> None:
        """Serve until `stop()`; jobs queued before it are served first."""
        self.engine.warm_up()
        while True:
            with self._cond:
                while not self.waiting and not self.running and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self.waiting and not self.running:
                    break
            self.step()
        self.engine.flush()

    def stop(self) -> None:
        """Refuse new jobs; `run` returns once the queued ones are served."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


class Flusher:
    """Writes the prefix store's records not yet on disk every `interval` seconds, on its own thread.

    Each hold of the store's lock writes at most `chunk` bytes, so the model thread's
    lookups and publishes wait at most one chunk; decoding steps never touch the store.
    """

    def __init__(self, store, interval: float = FLUSH_EVERY, chunk: int = FLUSH_CHUNK, pause: float = FLUSH_PAUSE):
        self.store = store
        self.interval = float(interval)
        self.chunk = int(chunk)
        self.pause = float(pause)
        self.flushes = 0  # timer rounds that wrote something
        self.records = 0  # records written by the timer
        self._halt = threading.Event()
        self.thread = threading.Thread(target=self._main, name="segcache-flush", daemon=True)

    def start(self) -> None:
        if self.store is not None and self.interval > 0:
            self.thread.start()

    def _main(self) -> None:
        deadline = time.monotonic() + self.interval
        while not self._halt.wait(max(0.0, deadline - time.monotonic())):
            deadline = time.monotonic() + self.interval  # from the start of this round: at least this often
            self.flush()

    def flush(self) -> int:
        """Write every record not yet on disk, a chunk per lock hold; returns how many."""
        written = 0
        while not self._halt.is_set() and not self.store.closed:
            try:
                n, left = self.store.flush_some(self.chunk)
            except Exception as exc:  # closed meanwhile, or the disk failed: a cache, not worth a crash
                if not self.store.closed:
                    log.warning("prefix store flush failed: %s", exc)
                break
            written += n
            if not left or not n:  # done, or the disk takes nothing now (warned): the next round retries
                break
            time.sleep(self.pause)  # the lock and the GIL to the model thread between chunks
        if written:
            self.flushes += 1
            self.records += written
        return written

    def stop(self) -> None:
        self._halt.set()
        if self.thread.is_alive():
            self.thread.join()


class Worker:
    """The model thread: runs `scheduler.run()` until `stop()`; with a store, a `Flusher` beside it."""

    def __init__(self, scheduler: Scheduler, flush_interval: float = FLUSH_EVERY):
        self.scheduler = scheduler
        self.thread = threading.Thread(target=self._main, name="segcache-model", daemon=True)
        self.error: BaseException | None = None
        self.flusher = Flusher(getattr(scheduler.engine, "store", None), flush_interval)

    def _main(self) -> None:
        try:
            self.scheduler.run()
        except BaseException as exc:  # /health turns 503
            self.error = exc
            log.exception("the model worker died")
        finally:
            release_streams()

    def start(self) -> None:
        self.thread.start()
        self.flusher.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        self.scheduler.stop()
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.flusher.stop()  # before the store closes; the model thread flushed on its way out


def release_streams() -> None:
    """Destroy the MLX streams this thread made, before the thread ends.

    MLX no longer cleans a thread's streams up by itself in time: a process
    whose worker thread ran MLX could abort at exit ("terminate called without
    an active exception", ml-explore/mlx#3126; mlx-vlm#1945). MLX versions
    without `clear_streams` clean up on their own.
    """
    clear = getattr(mx, "clear_streams", None)
    if clear is not None:
        clear()
