"""Run a script on n ranks over loopback, as `mlx.launch --backend ring -n N` does, with bounded waits.

`mlx.launch` writes a hostfile of one `ip:port` per rank and starts every rank
with `MLX_RANK` and `MLX_HOSTFILE`; so does `run`, but with free ports (tests
run in parallel on one machine), a deadline, and every rank stopped by the
caller: a rank that outlives the deadline is killed, and so are the others
once one rank has failed and a grace period has passed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Rank:
    """How one rank ended.

    Attributes:
        rank: its rank.
        returncode: its exit status (negative: killed by that signal).
        stdout, stderr: what it wrote.
        killed: True if `run` killed it (deadline, or another rank failed).
    """

    rank: int
    returncode: int
    stdout: str
    stderr: str
    killed: bool = False

    def lines(self, prefix: str) -> list[str]:
        """The stdout lines starting with `prefix`, without it."""
        return [line[len(prefix):] for line in self.stdout.splitlines() if line.startswith(prefix)]

    def json(self, prefix: str = "RESULT ") -> list:
        """The JSON values printed after `prefix`, in order."""
        return [json.loads(line) for line in self.lines(prefix)]


def free_ports(n: int) -> list[int]:
    """n loopback ports free right now (held together while choosing, so distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def hostfile(n: int, directory) -> Path:
    """An MLX ring hostfile for n ranks on loopback (what `mlx.launch` writes), in `directory`."""
    path = Path(directory) / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def rank_env(rank: int, hosts: Path, env: dict | None = None) -> dict:
    """The environment of one rank: ours, `env`, and MLX's ring settings."""
    out = dict(os.environ, **(env or {}))
    out.pop("MLX_RING_VERBOSE", None)  # any value turns the ring's logging on
    out.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hosts))
    return out


def run(argv: list[str], n: int = 2, *, timeout: float = 120.0, grace: float = 15.0,
        env: dict | None = None, cwd=None) -> list[Rank]:
    """Run `python argv...` on n ranks over loopback and wait for all of them (at most `timeout`).

    Args:
        argv: the script and its arguments (run with this interpreter).
        n: ranks.
        timeout: seconds before every rank still running is killed.
        grace: seconds the others get after a rank exits with an error, then they are killed.
        env: more environment variables for every rank.
        cwd: working directory.

    Returns:
        One `Rank` per rank, in rank order.
    """
    with tempfile.TemporaryDirectory(prefix="segcache-ranks-") as tmp:
        hosts = hostfile(n, tmp)
        outs = [open(Path(tmp) / f"out{r}", "w+") for r in range(n)]
        errs = [open(Path(tmp) / f"err{r}", "w+") for r in range(n)]
        procs = [
            subprocess.Popen([sys.executable, *argv], env=rank_env(r, hosts, env), cwd=cwd,
                             stdout=outs[r], stderr=errs[r], start_new_session=True)
            for r in range(n)
        ]
        killed = [False] * n
        deadline = time.monotonic() + timeout
        failed_at = None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + grace):
                    break
                time.sleep(0.05)
        finally:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    killed[r] = True
                    _kill(p)
        ranks = []
        for r, p in enumerate(procs):
            outs[r].seek(0)
            errs[r].seek(0)
            ranks.append(Rank(r, p.returncode, outs[r].read(), errs[r].read(), killed[r]))
            outs[r].close()
            errs[r].close()
        return ranks


def _kill(p: subprocess.Popen) -> None:
    """Stop one rank we started (its own session: the rank and nothing else of ours)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=10)


def mlx_launch(argv: list[str], n: int = 2, *, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python argv...` under `mlx.launch --backend ring -n n` on free loopback ports.

    mlx.launch listens from `--starting-port` up, one port per rank; the ports
    are chosen free just before. Killed (its whole session) at the deadline.
    """
    start = _consecutive_free(n)
    launcher = Path(sys.executable).with_name("mlx.launch")
    cmd = [str(launcher), "--backend", "ring", "-n", str(n), "--starting-port", str(start),
           "--python", sys.executable, "--", *argv]
    environ = dict(os.environ, **(env or {}))
    environ.pop("MLX_RING_VERBOSE", None)
    p = subprocess.Popen(cmd, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(p)
        out, err = p.communicate()
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _consecutive_free(n: int, tries: int = 50) -> int:
    """A port p such that p .. p+n-1 are free right now."""
    for _ in range(tries):
        start = free_ports(1)[0]
        socks = []
        try:
            for port in range(start, start + n):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free loopback ports found")


class Started:
    """Ranks started by `start` and left running: the caller stops them (`stop`), always.

    Attributes:
        procs: one process per rank, in rank order.
        logs: per rank, the file its stdout and stderr go to.
    """

    def __init__(self, procs: list[subprocess.Popen], logs: list[Path]):
        self.procs, self.logs = procs, logs

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace") if self.logs[rank].exists() else ""

    def wait(self, rank: int, timeout: float) -> int | None:
        """Rank `rank`'s exit status once it exits within `timeout` seconds, else None."""
        try:
            return self.procs[rank].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> list[int]:
        """Send `sig` to every rank still running (rank 0 first) and wait; SIGKILL past `timeout`.
        Returns the exit statuses."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(p)
        return [p.returncode for p in self.procs]


def start(argv: list[str], n: int = 2, *, directory, env: dict | None = None, name: str = "rank") -> Started:
    """Start `python argv...` on n ranks over loopback and return at once (a server's ranks).

    Each rank gets its own session and writes stdout and stderr to
    `directory/<name><r>.log`. The caller must `stop()` them.
    """
    directory = Path(directory)
    hosts = hostfile(n, directory)
    procs, logs = [], []
    for r in range(n):
        logs.append(directory / f"{name}{r}.log")
        with open(logs[-1], "ab") as out:
            procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env(r, hosts, env), stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    return Started(procs, logs)
