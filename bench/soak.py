"""Soak and abuse `segcache serve` as issue 24's probe did; exits 1 if a healthy figure fails.

    python bench/soak.py                          # the four phases, the soak 8 minutes (~11 min)
    python bench/soak.py --minutes 1              # a shorter soak
    python bench/soak.py --only streams,kill      # some of: streams, disconnects, kill, soak, pressure
    python bench/soak.py --serve-args "--decode-concurrency 8"
    python bench/soak.py --only pressure --model src/segcache/models/draft   # the dense llama

  streams      64 streamed completions at once: each one ends (a finish_reason, then [DONE]), no 5xx,
               no connection reset
  disconnects  20 streams dropped after 3 chunks and 5 whole requests dropped after 1 s: none runs to
               its end (each one cancelled while generating, or dropped while queued) and the queue empties
  kill         8 prompts answered one by one; 8 clients then stream other prompts and the server gets
               SIGKILL under that load; restarted on the same store: `segcache store verify` passes,
               and the 8 prompts are answered as before (same text), resumed from the store
  soak         --minutes of 4 clients sending a mix (streamed and whole, completions and chat, new and
               repeated prompts over a 95 KB text, some dropped mid-stream) with store budgets small
               enough that both tiers evict: 0 errors, and the server's resident memory after the
               first minute stays within 15% of its value then (its range and slope printed)
  pressure     --pressure-prompts distinct ~3,000-character prompts (60) one after another through
               --prompt-cache-bytes 20000000 --disk-bytes 60M, past both budgets; a clean stop,
               `segcache store stats` and `store verify`; a restart and the --replay newest (10) asked
               again: the share of their prompt tokens resumed (>= 80% passes), unresumable bytes on
               disk (0 passes), evictions, and RAM entries and RSS over time (printed as a curve)

Servers run the shipped hybrid target (or --model) on 127.0.0.1, each on a fresh store in a
temporary directory. The machine should be otherwise quiet for figures that go into docs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "src" / "segcache" / "models"
TEXT = (MODELS / "heldout_stdlib.txt").read_text()
PHASES = ("streams", "disconnects", "kill", "soak", "pressure")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`segcache serve` as a subprocess on a free port; its log in the run's directory."""

    def __init__(self, model: Path, store: Path, log: Path, args: list[str]):
        self.model, self.store, self.log, self.args = model, store, log, args
        self.port = _port()
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Serve":
        cmd = [sys.executable, "-m", "segcache.cli", "serve", "--model", str(self.model), "--port",
               str(self.port), "--prompt-cache-dir", str(self.store), *self.args]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                         os.environ.get("PYTHONPATH")])))
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"segcache serve exited: see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"segcache serve did not start in 300 s: see {self.log}")

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss_mb(self) -> float:
        """The server's resident memory in MB (Linux /proc, else ps)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(self.proc.pid)], capture_output=True, text=True)
        return int(out.stdout.strip() or 0) / 1024

    def lines(self, suffix: str) -> int:
        return sum(1 for line in self.log.read_text(errors="replace").splitlines() if line.endswith(suffix))

    def idle(self, timeout: float = 120) -> float:
        """Seconds until /stats shows no request pending."""
        tic = time.monotonic()
        while time.monotonic() - tic < timeout:
            if httpx.get(self.url + "/stats", timeout=30).json()["pending"] == 0:
                return time.monotonic() - tic
            time.sleep(0.1)
        return float("inf")


def window(rng: random.Random, lo: int = 300, hi: int = 1500) -> str:
    start = rng.randrange(0, len(TEXT) - hi)
    return TEXT[start : start + rng.randrange(lo, hi)]


def stream(url: str, path: str, body: dict, drop_after: int = 0) -> dict:
    """One streamed request: {"status", "finish", "done", "text", "error"}; `drop_after` chunks, then close."""
    out = {"status": None, "finish": None, "done": False, "text": "", "error": None, "chunks": 0}
    try:
        with httpx.stream("POST", url + path, json=dict(body, stream=True), timeout=600) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                out["error"] = f"{r.status_code}: {r.text[:200]}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = f"error event: {event['error']}"
                    continue
                for c in event.get("choices", []):
                    out["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    out["finish"] = c.get("finish_reason") or out["finish"]
                out["chunks"] += 1
                if drop_after and out["chunks"] >= drop_after:
                    break  # the connection closes here, mid-stream
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def whole(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=600)
    return {"status": r.status_code, "body": r.json() if r.headers.get("content-type", "").startswith(
        "application/json") else r.text}


def drop_whole(port: int, body: dict, after: float) -> None:
    """A non-streaming request whose client leaves after `after` seconds, mid-generation."""
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
        time.sleep(after)


def run_threads(fn, args_list) -> list:
    out = [None] * len(args_list)

    def one(i):
        out[i] = fn(*args_list[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# -- phases ---------------------------------------------------------------------------------


def phase_streams(make, rng) -> list[tuple[str, bool]]:
    srv = make("streams", ["--max-queue", "64"]).start()
    try:
        bodies = [{"prompt": window(rng), "max_tokens": 48} for _ in range(64)]
        tic = time.monotonic()
        res = run_threads(stream, [(srv.url, "/v1/completions", b) for b in bodies])
        wall = time.monotonic() - tic
    finally:
        srv.stop()
    ended = sum(1 for r in res if r["done"] and r["finish"] and not r["error"])
    fivexx = sum(1 for r in res if (r["status"] or 0) >= 500 or (r["error"] or "").startswith("error event"))
    resets = sum(1 for r in res if r["status"] is None)
    print(f"streams: {ended}/64 ended, {fivexx} 5xx, {resets} resets, wall {wall:.1f} s", flush=True)
    for r in res:
        if r["error"]:
            print(f"  {r['error']}")
    return [("64 concurrent streams all end", ended == 64), ("no 5xx, no reset", fivexx == resets == 0)]


def phase_disconnects(make, rng) -> list[tuple[str, bool]]:
    srv = make("disconnects", ["--max-queue", "64"]).start()
    try:
        rss0 = srv.rss_mb()
        bodies = [{"prompt": window(rng), "max_tokens": 400} for _ in range(20)]
        res = run_threads(stream, [(srv.url, "/v1/completions", b, 3) for b in bodies])
        run_threads(drop_whole, [(srv.port, {"prompt": window(rng), "max_tokens": 2000}, 1.0) for _ in range(5)])
        freed = srv.idle()
        # a job dropped while still queued never runs (and logs nothing): count those that ran to the end
        cancelled, finished = srv.lines(", cancelled"), srv.lines(", length") + srv.lines(", stop")
        ok = stream(srv.url, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 8})
        rss1 = srv.rss_mb()
    finally:
        srv.stop()
    dropped = sum(1 for r in res if r["chunks"] == 3)
    print(f"disconnects: {dropped}/20 streams dropped after 3 chunks + 5 whole; {cancelled} cancelled while "
          f"generating, the rest while queued, {finished} ran to their end; queue empty after {freed:.1f} s; "
          f"RSS {rss0:.0f} -> {rss1:.0f} MB; next request {'served' if ok['done'] else ok['error']}", flush=True)
    return [("every dropped request cancelled and freed", finished == 0 and freed < float("inf")),
            ("the next request is served", ok["done"] and not ok["error"])]


def phase_kill(make, rng, store: Path) -> list[tuple[str, bool]]:
    srv = make("kill", ["--max-queue", "64"], store=store).start()
    prompts = [window(rng, 1200, 2000) for _ in range(8)]
    before = []
    stop = threading.Event()
    try:
        for p in prompts:
            before.append(whole(srv.url, "/v1/completions", {"prompt": p, "max_tokens": 24})["body"])

        def load():
            r = random.Random(rng.random())
            while not stop.is_set():
                stream(srv.url, "/v1/completions", {"prompt": window(r), "max_tokens": 64})

        clients = [threading.Thread(target=load) for _ in range(8)]
        for t in clients:
            t.start()
        time.sleep(3.0)
        pending = httpx.get(srv.url + "/stats", timeout=30).json()["pending"]
        srv.stop(signal.SIGKILL)
        stop.set()
        for t in clients:
            t.join()
    finally:
        stop.set()
        srv.stop(signal.SIGKILL)
    verify = subprocess.run([sys.executable, "-m", "segcache.cli", "store", "verify", str(store)],
                            capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))))
    srv = make("kill-restart", ["--max-queue", "64"], store=store).start()
    try:
        after = [whole(srv.url, "/v1/completions", {"prompt": p, "max_tokens": 24})["body"] for p in prompts]
    finally:
        srv.stop()
    same = sum(a["choices"][0]["text"] == b["choices"][0]["text"] for a, b in zip(after, before))
    resumed = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in after)
    print(f"kill: SIGKILL with {pending} requests in flight; store verify exit {verify.returncode}; "
          f"{same}/8 identical answers after the restart, {resumed}/8 resumed", flush=True)
    if verify.returncode:
        print("  " + (verify.stdout + verify.stderr).strip().replace("\n", "\n  "))
    return [("the store verifies after SIGKILL", verify.returncode == 0),
            ("answers identical and resumed after the restart", same == resumed == 8)]


def phase_soak(make, rng, minutes: float) -> list[tuple[str, bool]]:
    srv = make("soak", ["--ram-bytes", "4M", "--disk-bytes", "24M", "--max-queue", "64"]).start()
    stop = threading.Event()
    counts = {"requests": 0, "errors": 0, "dropped": 0}
    errors: list[str] = []
    lock = threading.Lock()
    samples: list[tuple[float, float]] = []
    recent: list[str] = []
    tic = time.monotonic()

    def client(seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            op = r.random()
            with lock:
                again = r.choice(recent) if recent and op < 0.3 else None
            prompt = again or window(r)
            n = r.randrange(8, 40)
            if op < 0.45:
                res = stream(srv.url, "/v1/completions", {"prompt": prompt, "max_tokens": n})
                bad = res["error"] or not res["done"]
            elif op < 0.65:
                res = whole(srv.url, "/v1/completions", {"prompt": prompt, "max_tokens": n})
                bad = res["status"] != 200 and f"{res['status']}: {str(res['body'])[:200]}"
            elif op < 0.9:
                msgs = [{"role": "system", "content": prompt}, {"role": "user", "content": window(r, 40, 120)}]
                res = stream(srv.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": n})
                bad = res["error"] or not res["done"]
            else:
                res = stream(srv.url, "/v1/completions", {"prompt": prompt, "max_tokens": 200}, drop_after=2)
                bad = res["error"] or res["chunks"] < 2
            with lock:
                counts["requests"] += 1
                counts["dropped"] += op >= 0.9
                if bad:
                    counts["errors"] += 1
                    errors.append(str(bad))
                if not again:
                    recent.append(prompt)
                    del recent[:-50]

    def sample() -> None:
        while not stop.wait(5.0):
            samples.append((time.monotonic() - tic, srv.rss_mb()))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)] + [threading.Thread(target=sample)]
    try:
        for t in threads:
            t.start()
        while time.monotonic() - tic < minutes * 60:
            time.sleep(1.0)
            if srv.proc.poll() is not None:
                break
        stop.set()
        for t in threads:
            t.join()
        store = httpx.get(srv.url + "/stats", timeout=30).json()["store"] or {}
    finally:
        stop.set()
        srv.stop()
    settle = 60.0 if minutes >= 2 else minutes * 15  # the first minute (or quarter) warms caches up
    after = [m for t, m in samples if t >= settle]
    base = after[0] if after else float("nan")
    slope = 0.0
    if len(after) > 2:
        ts = [t / 60 for t, _ in samples if t >= settle]
        mt, mm = sum(ts) / len(ts), sum(after) / len(after)
        slope = sum((t - mt) * (m - mm) for t, m in zip(ts, after)) / sum((t - mt) ** 2 for t in ts)
    flat = bool(after) and max(after) <= 1.15 * base
    print(f"soak: {minutes:g} min, {counts['requests']} requests ({counts['dropped']} dropped mid-stream on "
          f"purpose), {counts['errors']} errors; store evictions ram {store.get('ram_evictions')} disk "
          f"{store.get('disk_evictions')}; RSS after {settle:.0f} s: {min(after, default=0):.0f}-"
          f"{max(after, default=0):.0f} MB (at {settle:.0f} s {base:.0f} MB, slope {slope:+.1f} MB/min)",
          flush=True)
    for e in errors[:10]:
        print(f"  {e}")
    evicted = (store.get("ram_evictions") or 0) > 0 and (store.get("disk_evictions") or 0) > 0
    return [("soak: 0 errors", counts["errors"] == 0 and counts["requests"] > 0),
            ("soak: flat RSS (within 15% after the first minute)", flat),
            ("soak: both store tiers evicted", evicted)]


def _segcache(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "segcache.cli", *args], capture_output=True, text=True, env=env)


def phase_pressure(make, rng, store: Path, count: int, replay: int, ram: str, disk: str,
                   chars: int = 3000) -> list[tuple[str, bool]]:
    """Distinct prompts past both budgets, a clean restart, the newest asked again."""
    flags = ["--prompt-cache-bytes", ram, "--disk-bytes", disk, "--max-queue", "64"]
    prompts = []
    for i in range(count):  # distinct from their first characters: no shared prefix, no branch point
        start = rng.randrange(0, len(TEXT) - chars)
        prompts.append(f"# prompt {i}\n" + TEXT[start : start + chars])
    srv = make("pressure", flags, store=store).start()
    curve = []  # (seconds, prompts sent, RAM entries, RSS MB, disk entries, evictions, unresumable bytes)
    tic = time.monotonic()
    try:
        for i, p in enumerate(prompts):
            r = whole(srv.url, "/v1/completions", {"prompt": p, "max_tokens": 4})
            if r["status"] != 200:
                print(f"  prompt {i}: {r['status']} {str(r['body'])[:200]}")
            if i % max(1, count // 30) == 0 or i == count - 1:
                st = httpx.get(srv.url + "/stats", timeout=60).json()["store"] or {}
                curve.append((time.monotonic() - tic, i + 1, st.get("ram_entries"), srv.rss_mb(), st.get("disk_entries"),
                              st.get("evictions"), st.get("disk_unresumable_bytes")))
    finally:
        srv.stop()
    stats = _segcache("store", "stats", str(store))
    verify = _segcache("store", "verify", str(store))
    srv = make("pressure-restart", flags, store=store).start()
    shares = []
    try:
        for p in prompts[-replay:]:
            usage = whole(srv.url, "/v1/completions", {"prompt": p, "max_tokens": 1})["body"]["usage"]
            shares.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
    finally:
        srv.stop()
    print(f"pressure: {count} distinct prompts of ~{chars} characters through --prompt-cache-bytes {ram} "
          f"--disk-bytes {disk}", flush=True)
    print(f"  {'s':>6} {'prompts':>7} {'ram entries':>11} {'RSS MB':>7} {'disk entries':>12} {'evictions':>9} "
          f"{'unresumable B':>13}")
    for t, n, ram_n, rss, disk_n, ev, useless in curve:
        print(f"  {t:6.1f} {n:7d} {ram_n!s:>11} {rss:7.0f} {disk_n!s:>12} {ev!s:>9} {useless!s:>13}")
    print("  " + stats.stdout.strip().replace("\n", "\n  "))
    print(f"  store verify exit {verify.returncode}: {verify.stdout.strip().splitlines()[0] if verify.stdout else verify.stderr}")
    mean = sum(shares) / len(shares) if shares else 0.0
    print(f"  restart, the {replay} newest again: resumed {mean:.0%} of their prompt tokens "
          f"(each: {', '.join(f'{x:.0%}' for x in shares)})", flush=True)
    found = re.search(r"unresumable (\d+) bytes", stats.stdout)
    useless = int(found.group(1)) if found else None
    after = [row for row in curve if row[0] >= 60]
    judged = len(after) >= 3  # a run shorter than a minute is all warm-up: its growth says nothing
    after = after if judged else curve[len(curve) // 2 :]
    third = max(1, len(after) // 3)  # flat: the last third's mean within 5% of the first third's (no growth)

    def flat(col: int) -> bool:
        first, last = [r[col] or 0 for r in after[:third]], [r[col] or 0 for r in after[-third:]]
        return sum(last) / len(last) <= 1.05 * sum(first) / len(first)

    ram_flat, rss_flat = flat(2), flat(3)
    avg = lambda rows, col: sum(r[col] or 0 for r in rows) / len(rows)  # noqa: E731
    print(f"  {'after the first minute' if judged else 'the second half (the run is shorter than a minute: not judged)'}: RAM entries {min(r[2] for r in after)}-{max(r[2] for r in after)} (first third's "
          f"mean {avg(after[:third], 2):.0f}, last third's {avg(after[-third:], 2):.0f}), RSS "
          f"{min(r[3] for r in after):.0f}-{max(r[3] for r in after):.0f} MB ({avg(after[:third], 3):.0f}, "
          f"{avg(after[-third:], 3):.0f})", flush=True)
    checks = [("pressure: the newest prompts resume >= 80% after a restart", mean >= 0.8),
              ("pressure: no unresumable bytes on disk", useless == 0),
              ("pressure: store verify passes", verify.returncode == 0)]
    if judged:  # e.g. --pressure-prompts 360; 60 prompts run for ~20 s here
        checks.append(("pressure: RAM entries and RSS flat after the first minute (last third within 5% of the first)",
                       ram_flat and rss_flat))
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="length of the soak (default 8)")
    parser.add_argument("--only", default=",".join(PHASES), help=f"phases to run, of {','.join(PHASES)}")
    parser.add_argument("--model", type=Path, default=MODELS / "target", help="model directory")
    parser.add_argument("--serve-args", default="", help="more flags for every server, e.g. '--decode-concurrency 8'")
    parser.add_argument("--seed", type=int, default=0, help="prompt choice")
    parser.add_argument("--keep", action="store_true", help="keep the stores and logs (the directory is printed)")
    parser.add_argument("--pressure-prompts", type=int, default=60, help="distinct prompts of the pressure phase")
    parser.add_argument("--replay", type=int, default=10, help="newest prompts asked again after the restart")
    parser.add_argument("--pressure-ram", default="20000000", help="--prompt-cache-bytes of the pressure phase")
    parser.add_argument("--pressure-disk", default="60M", help="--disk-bytes of the pressure phase")
    args = parser.parse_args()
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(only) - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s) {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    work = Path(tempfile.mkdtemp(prefix="segcache-soak-"))
    extra = shlex.split(args.serve_args)
    rng = random.Random(args.seed)

    def make(name: str, flags: list[str], store: Path | None = None) -> Serve:
        return Serve(args.model, store or work / f"{name}-store", work / f"{name}.log", flags + extra)

    print(f"segcache soak: {', '.join(only)} on {args.model.name}; logs in {work}", flush=True)
    results = []
    if "streams" in only:
        results += phase_streams(make, rng)
    if "disconnects" in only:
        results += phase_disconnects(make, rng)
    if "kill" in only:
        results += phase_kill(make, rng, work / "kill-store")
    if "soak" in only:
        results += phase_soak(make, rng, args.minutes)
    if "pressure" in only:
        results += phase_pressure(make, rng, work / "pressure-store", args.pressure_prompts, args.replay,
                                  args.pressure_ram, args.pressure_disk)
    print()
    for name, ok in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if not args.keep and all(ok for _, ok in results):
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
