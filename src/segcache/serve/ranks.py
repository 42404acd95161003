"""`segcache serve` under `mlx.launch`: rank 0 answers HTTP, every rank runs the same engine steps.

    rank 0:  HTTP ── submit ──> waiting ──┐ admit, cancel (a snapshot)
                                          v
    every rank, each scheduler step:  one message [verdict of the last step | rank 0's decision]
                                          │ decision: the requests admitted (whole, msgpack), the
                                          │ requests cancelled, stop; verdict: each rank's status
                                          v and a fingerprint of the events its last step made
             the same Scheduler step on every rank: the engine's prefill chunks and decoder
             step on the rank's shard (the model's own collectives inside), events delivered
             (rank 0: to the HTTP side; the others: dropped)

Each rank runs the one request engine (`serve/engine.py`) with the same
requests in the same order, so it takes the same steps: the ranks' logits are
bitwise identical (an `all_sum` or `all_gather` hands every rank the same
result), so every rank's acceptor takes the same decision and the batched
decoder emits the same tokens. What is not a function of the requests and the
logits comes from rank 0 in the step's message: admissions, cancellations
(read once per step from the HTTP side's flags), a seed for a request without
one (each rank would draw its own), stop. The cost gate is off (it times each
rank's own steps); the prefix store agrees every resume (Runtime(group=...)).

The verdict checks the claim instead of trusting it: each rank sends a 64-bit
fingerprint of the events its last step made (texts, finish reasons, token
counts). Ranks that differ end the deployment on every rank with
`RankDivergedError` (their runtimes are out of step: nothing can resume them).

A step in the steady state is one collective of 128 bytes per rank; a step
that admits a request carries it once (a second collective sized to it).
When rank 0 has no work it still sends an idle message every `heartbeat`
seconds, so the other ranks' deadline (`Channel(timeout=...)`) tells a quiet
rank 0 from a dead one. A rank that dies: the others get `RankLostError` at
their next message (the ring backend: "connection to a peer was lost") or
their deadline ends them (exit 75); rank 0 fails every request in flight
with that message and stops the server. Restart every rank: each resumes
from its own store (`<store>/rank-<r>-of-<n>`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import msgpack
import numpy as np

from ..controls import Controls
from ..distributed.channel import LOST_EXIT, Channel, Verdict, fingerprint
from ..distributed.shard import load as load_shard
from ..distributed.store import open_rank_store
from ..errors import DistributedError, RankDivergedError, StoreError
from ..store import model_identity
from .engine import Chunk, Engine, Failure, Finish, GenRequest
from .paths import default_cache_dir, private_dirs, shown
from .worker import Job, Scheduler, release_streams

log = logging.getLogger("segcache.serve")

HEARTBEAT = 0.5  # seconds: rank 0 sends an idle message at least this often (mlx_lm.server polls every 0.1 s)


# -- a request on the wire ------------------------------------------------------------------


def encode_request(req: GenRequest) -> dict:
    """A GenRequest as plain data (msgpack): every field but `arrival` (each rank's own clock)."""
    out = {}
    for f in dataclasses.fields(req):
        if f.name == "arrival":
            continue
        value = getattr(req, f.name)
        if isinstance(value, Controls):
            value = {c.name: getattr(value, c.name) for c in dataclasses.fields(value)}
        out[f.name] = value
    return out


def decode_request(data: dict) -> GenRequest:
    """The GenRequest `encode_request` made (its arrival: now)."""
    data = dict(data)
    if data.get("controls") is not None:
        data["controls"] = Controls(**data["controls"])
    return GenRequest(**data)


def seeded(req: GenRequest) -> GenRequest:
    """The request with a seed of its own: each rank would draw a different secret one
    (`sampling.Keys(None)`), so rank 0 draws it once and shares it with the request.
    The request is changed in place (it is rank 0's own) and returned."""
    if req.settings().seed is None:
        seed = secrets.randbits(63)
        req.seed = seed
        if req.controls is not None:
            req.controls = dataclasses.replace(req.controls, seed=seed)
    return req


def _summary(event) -> tuple:
    """What the ranks must agree on in an event (not logprob floats, not rank-local messages)."""
    if isinstance(event, Chunk):
        return ("c", event.index, event.text)
    if isinstance(event, Finish):
        return ("f", event.index, event.reason, event.usage.completion_tokens, event.stop or "", event.last)
    if isinstance(event, Failure):
        return ("x",)
    return ("?", type(event).__name__)


# -- the scheduler of one rank ----------------------------------------------------------------


class GroupScheduler(Scheduler):
    """The scheduler of one rank of a group: rank 0 decides admissions and cancellations, and
    every rank runs the same steps (module docstring).

    On rank 0 the HTTP side submits jobs as to a `Scheduler`; the running jobs are this
    scheduler's own copies of them (their `cancelled` is set from a per-step snapshot of the
    HTTP side's flag, so every rank cancels at the same step). On the other ranks nothing
    is submitted: the jobs come in the step messages and their events go nowhere.

    Args:
        engine: this rank's Engine, built with `group=channel`.
        channel: the group's channel (its `timeout` bounds every wait, a step included).
        max_queue, max_running: as for `Scheduler` (rank 0's admission uses them).
        heartbeat: seconds between rank 0's idle messages.
        on_lost: called once (on the model thread) when the group cannot go on, after every
            request in flight got a `Failure`; e.g. rank 0 stops its HTTP server.

    Attributes:
        lost: the error that ended the group, or None.
        steps: scheduler steps run (every rank runs the same count).
    """

    def __init__(self, engine: Engine, channel: Channel, *, max_queue: int = 64, max_running: int = 1,
                 heartbeat: float = HEARTBEAT, on_lost: Callable[[BaseException], None] = lambda exc: None):
        super().__init__(engine, max_queue=max_queue, max_running=max_running, begin_step=engine.begin_step)
        self.channel = channel
        self.heartbeat = heartbeat
        self.on_lost = on_lost
        self.lost: Optional[BaseException] = None
        self.steps = 0
        self._events: list = []  # (request id, summary) of this step's events, for the verdict
        self._verdict = (True, fingerprint([]))  # this rank's verdict on its last step
        self._ended = False  # a stop decision was run

    # -- one step ---------------------------------------------------------------------------

    def _decide(self) -> tuple[list, list, bool, list]:
        """Rank 0: the jobs to admit (popped from waiting), the running requests the HTTP side
        cancelled, and whether to stop. Returns (admitted jobs, cancelled ids, stop, payload)."""
        with self._cond:
            rows = sum(job.request.n for job in self.running)
            admitted = []
            while self.waiting and (not (self.running or admitted)
                                    or rows + self.waiting[0].request.n <= self.max_running):
                job = self.waiting.popleft()
                if not job.cancelled:  # a client gone while waiting costs nothing, on any rank
                    admitted.append(job)
                    rows += job.request.n
            stop = self._stopping and not self.waiting and not self.running and not admitted
        cancelled = [job.request.id for job in self.running if job.origin.cancelled and not job.cancelled]
        sent, wire = [], []
        for job in admitted:
            try:
                data = encode_request(seeded(job.request))
                _pack(data)  # a field msgpack cannot carry fails this request, not the group
            except (TypeError, ValueError, OverflowError) as exc:
                log.error("%s cannot be sent to the other ranks: %s", job.request.id, exc)
                job.deliver(Failure(f"the request cannot be sent to the other ranks: {exc}"))
                continue
            sent.append(job)
            wire.append(data)
        return sent, cancelled, stop, [wire, cancelled, stop]

    def _message(self, payload) -> tuple[list, Verdict]:
        """One collective: every rank's verdict on its last step, rank 0's decision for this one."""
        ok, fp = self._verdict
        own = [0 if ok else 1, fp]
        if self.channel.leader:
            data = _pack(payload)
            own += [len(data), *np.frombuffer(data + bytes(-len(data) % 8), dtype="<i8").tolist()]
        rows = self.channel.gather(own)
        verdict = Verdict(tuple(r for r, row in enumerate(rows) if row[0]), tuple(row[1] for row in rows))
        n = rows[0][2]
        data = np.array(rows[0][3:], dtype="<i8").tobytes()[:n]
        return _unpack(data), verdict

    def step(self) -> bool:
        """One scheduler step on every rank (rank 0 decides what it admits and cancels).

        Returns:
            True while the group serves (False once a stop decision ran).

        Raises:
            RankLostError: another rank is gone (this step's message found it).
            RankDivergedError: the ranks' last steps made different events.
        """
        admitted, payload = [], None
        if self.channel.leader:
            admitted, _, _, payload = self._decide()
        (requests, cancelled, stop), verdict = self._message(payload)
        if not verdict.ok:
            raise RankDivergedError(
                f"scheduler step {self.steps}: the ranks' last steps made different events "
                f"(ranks {list(verdict.failed)} failed; fingerprints "
                f"{[hex(f & ((1 << 63) - 1)) for f in verdict.fingerprints]}); their runtimes are out of step. "
                "Stop every rank and start them again (each resumes from its own store)"
            )
        if stop:
            self._ended = True
            return False
        origins = admitted if self.channel.leader else [None] * len(requests)
        for data, origin in zip(requests, origins):
            req = origin.request if origin is not None else decode_request(data)
            self.running.append(self._job(req, origin))
        for job in self.running:
            if job.request.id in cancelled:
                job.cancelled = True
        self.steps += 1
        self._events = []
        with self.channel.deadline(f"scheduler step {self.steps} of rank {self.channel.rank}"):
            self.begin_step()
            for job in list(self.running):
                if job.steps is None:
                    job.steps = self.engine.generate(job.request)
                self._advance(job)
        # A request that failed on every rank alike (its own sampling rule, say) is that request's
        # matter; a rank whose events differ from the others' is out of step with them.
        self._verdict = (True, fingerprint([[rid, list(s)] for rid, s in self._events]))
        return True

    def _job(self, req: GenRequest, origin: Optional[Job]) -> Job:
        """This scheduler's job for a request: its events are recorded for the verdict, then
        delivered to the HTTP side's job (rank 0) or dropped."""

        def deliver(event, rid=req.id, to=origin.deliver if origin is not None else None):
            self._events.append((rid, _summary(event)))
            if to is not None:
                to(event)

        job = Job(req, deliver)
        job.origin = origin if origin is not None else job
        return job

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until a stop decision runs (rank 0: after `stop()` and the queued jobs), or the
        group is lost (then every job in flight gets a `Failure`, and `on_lost` is called)."""
        try:
            self.engine.warm_up()  # every rank: the same forwards, the model's collectives paired
            last = time.monotonic()
            while not self._ended:
                if self.channel.leader:
                    with self._cond:
                        idle = not self.waiting and not self.running and not self._stopping
                        if idle:
                            self._cond.wait(max(0.0, self.heartbeat - (time.monotonic() - last)))
                last = time.monotonic()
                self.step()
        except (DistributedError, RuntimeError) as exc:  # RuntimeError: the ring backend's own
            self._lose(exc)
        finally:
            self.engine.flush()
            stats = self.channel.stats  # what the protocol cost (the model's own collectives aside)
            log.info("rank %d of %d: %d scheduler steps, %d messages, %d bytes sent (%.0f per step)",
                     self.channel.rank, self.channel.size, self.steps, stats.collectives, stats.sent_bytes,
                     stats.sent_bytes / max(1, self.steps))

    def abandon(self, why: str) -> None:
        """Fail every request in flight with `why`, from another thread while the model thread is
        blocked for good (a collective with a dead peer, before the deadline ends the process)."""
        with self._cond:
            self._stopping = True
            jobs = [job.origin for job in self.running] + list(self.waiting)
            self.waiting.clear()
        for job in jobs:
            try:
                job.deliver(Failure(why))
            except Exception:
                log.exception("%s: delivering its failure failed", job.request.id)

    def _lose(self, exc: BaseException) -> None:
        self.lost = exc
        log.error("rank %d of %d: the group cannot go on: %s: %s", self.channel.rank, self.channel.size,
                  type(exc).__name__, exc)
        self.abandon(f"the distributed deployment lost a rank or fell out of step ({type(exc).__name__}: {exc}); "
                     "the server is stopping")
        # The running jobs' generators stay open (referenced): closing one would release its row and
        # publish, which may evaluate a graph holding the model's collectives, on a group that is gone.
        self.on_lost(exc)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# -- one rank of a deployment, as `segcache serve` runs it ------------------------------------------


def settings_fingerprint(args) -> int:
    """What every rank's command line must agree on (what shapes the steps every rank runs)."""
    try:
        config = json.loads((Path(args.model) / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    return fingerprint(json.dumps(config, sort_keys=True), bool(args.draft_model), bool(args.prompt_lookup),
                       args.num_draft_tokens, args.decode_concurrency, args.prompt_concurrency,
                       args.prefill_step_size, args.checkpoint_interval, bool(args.pipeline),
                       bool(args.prompt_cache_dir))


class Group:
    """One rank of a `segcache serve` deployment under mlx.launch: what `serve/cli.py` asks of it.

    Startup, every rank: `load` its shard (and a draft model whole), `loaded` (every rank
    loaded, with the same settings), `open_store` (its own `<store>/rank-<r>-of-<n>`, or none
    on any rank if one cannot open it). Then rank 0 serves HTTP on a `scheduler`, the others
    `follow`. Startup messages wait for ever (loading a large model takes long); every message
    after waits at most `--rank-timeout`.
    """

    def __init__(self, channel: Optional[Channel] = None):
        self.channel = channel or Channel()
        self.shard = None
        self.lost: Optional[BaseException] = None

    @property
    def leader(self) -> bool:
        return self.channel.leader

    @property
    def size(self) -> int:
        return self.channel.size

    @property
    def parallel(self) -> str:
        return self.shard.parallel if self.shard is not None else "-"

    def load(self, path, pipeline: bool):
        """The model sharded over the group (tensor parallel, or pipeline with `pipeline`)."""
        model, tokenizer, self.shard = load_shard(path, pipeline=pipeline, group=self.channel.group)
        return model, tokenizer

    def loaded(self, failure: Optional[str], args) -> Optional[str]:
        """Every rank's load and settings, checked together: None if every rank loaded with the
        same settings, else what to print before stopping (every rank stops)."""
        verdict = self.channel.check(failure is None, settings_fingerprint(args))
        me = f"rank {self.channel.rank} of {self.size}"
        if verdict.failed:
            return failure or (f"segcache serve ({me}): rank(s) {list(verdict.failed)} could not load the model; "
                               "every rank stops (see that rank's message)")
        if not verdict.ok:
            return (f"segcache serve ({me}): the ranks were started with different models or settings "
                    "(--draft-model, --prompt-lookup, --num-draft-tokens, --decode-concurrency, "
                    "--prompt-concurrency, --prefill-step-size, --checkpoint-interval, --pipeline, "
                    "--prompt-cache-dir given or not); start every rank with the same command")
        return None

    def open_store(self, args, model):
        """This rank's prefix store under the deployment's directory, and that directory; the
        store is None on every rank if some rank cannot open its own (a prefix is a hit only
        where every rank holds it)."""
        if args.prompt_cache_dir:
            path = Path(args.prompt_cache_dir).expanduser()
        else:  # one directory for the deployment, named by rank 0's identity, on every rank
            path = default_cache_dir(self.channel.share(model_identity(model) if self.leader else None))
        store, error = None, None
        try:
            try:
                private_dirs(path)
            except FileExistsError:  # another rank on this machine made it first: fine
                pass
            store = open_rank_store(path, self.shard, ram_bytes=args.ram_bytes, disk_bytes=args.disk_bytes,
                                    remote=args.prompt_cache_remote)
        except (StoreError, OSError) as exc:
            error = exc
        verdict = self.channel.check(store is not None)
        if verdict.failed:
            if store is not None:
                store.close()
            why = f"this rank cannot open {path}: {error}" if error else f"rank(s) {list(verdict.failed)} cannot"
            warnings.warn(f"segcache serve: no prefix store on any rank ({why}); serving without it")
            return None, path
        return store, path

    def scheduler(self, engine: Engine, args) -> GroupScheduler:
        """Rank 0's scheduler (the HTTP side submits to it)."""
        self.channel.set_timeout(args.rank_timeout)
        scheduler = GroupScheduler(engine, self.channel, max_queue=args.max_queue,
                                   max_running=args.decode_concurrency, on_lost=self._stop_serving)

        def last_words(what: str) -> None:  # the clients hear why before the deadline ends this rank
            scheduler.abandon(f"{what} waited past --rank-timeout ({args.rank_timeout:g} s): another rank is "
                              "gone or stuck; the server is stopping")
            time.sleep(1.0)  # the HTTP side sends the failures

        self.channel.on_deadline = last_words
        return scheduler

    def _stop_serving(self, exc: BaseException) -> None:
        """Rank 0 lost the group: stop the HTTP server as SIGTERM would (the requests in flight got
        their Failure); `exit` then ends the process. A shutdown that hangs ends it anyway."""
        self.lost = exc
        timer = threading.Timer(30.0, self.exit)
        timer.daemon = True
        timer.start()
        os.kill(os.getpid(), signal.SIGTERM)

    def exit(self) -> None:
        """End this process after the group was lost, saying why (exit status 75: start every rank again)."""
        sys.stderr.write(
            f"segcache serve: rank {self.channel.rank} of {self.size} stops: {type(self.lost).__name__}: {self.lost}\n"
            f"segcache serve: another rank is gone or out of step; start every rank again "
            f"(each resumes from its own prefix store). Exit {LOST_EXIT}.\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(LOST_EXIT)

    def follow(self, engine: Engine, args, store, path) -> int:
        """A rank other than 0: run rank 0's steps until it stops (exit 0) or the group is lost
        (exit 75, saying why). Returns the exit status."""
        self.channel.set_timeout(args.rank_timeout)
        scheduler = GroupScheduler(engine, self.channel, max_queue=0, max_running=args.decode_concurrency)
        log.info("rank %d of %d (%s parallel, layers %s): running rank 0's steps; prefix store: %s",
                 self.channel.rank, self.size, self.parallel, list(self.shard.layers) if self.shard else "-",
                 shown(path) if store is not None else "none")
        try:
            scheduler.run()
        finally:
            if store is not None and not store.closed:
                store.close()
            release_streams()
        if scheduler.lost is not None:
            self.lost = scheduler.lost
            self.exit()
        log.info("rank %d of %d: rank 0 stopped; so does this rank", self.channel.rank, self.size)
        return 0
