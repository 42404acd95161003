"""Replay an agent-style trace against `segcache serve` and `mlx_lm.server`; TTFT per phase.

    python bench/serve.py [--model DIR] [--tokens 24] [--mlx-blas same|wheel]
    python bench/serve.py --sweep [--sweep-tokens 64] [--streams 1,2,4,8] [--base SRC] [--sweep-rounds R]
                          [--only NAMES] [--no-one]
    python bench/serve.py --join [--join-chars 7000] [--sweep-tokens 64]
    python bench/serve.py --cold [--rounds 5] [--cold-chars 1000] [--sweep-tokens 64] [--vllm-mlx PATH] [--base SRC]
    python bench/serve.py --lone [--rounds 5] [--cold-chars 1000] [--sweep-tokens 64] [--base SRC]
    python bench/serve.py ... --target wide [--wide-layers 16] [--wide-mlp 12288] [--wide-bits 4]

Both servers run the same model (the shipped hybrid target by default) as
subprocesses on 127.0.0.1, driven by the official `openai` client with
streamed, greedy completions of `--tokens` tokens. The trace, in order:

  cold          session 1, turn 1: a shared ~6,000-character context + a question
  2nd session   sessions 2 and 3, turn 1: the same context, other questions
  continuation  turns 2 and 3 of each session (prompt + reply + a new question)
  regenerate    session 1's turn 2 again
  edit          session 1's turn 3 with its last question changed
  restart       the server restarts (SIGTERM), then session 2's turn 3 again
  concurrent    4 clients at once, each a new turn of its own session

Time to first token is measured at the client (request sent -> first text
chunk). Where both servers compute a turn cold, their texts must match.
By default mlx_lm.server runs with the same OpenBLAS segcache binds
(LD_PRELOAD); `--mlx-blas wheel` runs it on the mlx[cpu] wheel's own BLAS.

`--sweep` instead measures continuous batching: for N in --streams, N clients
at once (distinct prompts, greedy, --sweep-tokens each), against a fresh
server started with `--decode-concurrency N --prompt-concurrency N`:
segcache plain, segcache with prompt lookup, segcache with the draft model
(both batched speculative rounds), mlx_lm.server; and segcache one at a time
(--decode-concurrency 1) as the baseline. Reports aggregate generated tok/s
(completion tokens over the wall time) and mean TTFT. `--base SRC` adds
plain segcache served from another tree's sources. At each N the servers
run one after another, in an order rotated per round and per N (the first
server of a run reads ~5% high); `--sweep-rounds R` (default `--rounds`)
gives per-round ratios and medians; `--only` keeps some of the servers.

`--cold`: 8 clients at once, each a distinct cold prompt of --cold-chars
characters of Python and a --sweep-tokens answer, against fresh servers:
segcache at --decode-concurrency 8 (prompts prefilled together), segcache
one at a time (--decode-concurrency 1), mlx_lm.server at
--decode-concurrency 8 (its own batched prefill) and, where it is installed
(--vllm-mlx, or found by VLLM_MLX= or on PATH), vllm-mlx serving
with --continuous-batching --max-num-seqs 8 on the same OpenBLAS,
interleaved in each of --rounds rounds; per-round ratios, the load average
of each round, and medians. `--base SRC` adds segcache N=8 served from
another tree's sources (e.g. a `git worktree` of the commit before a
change), so before and after are measured in the same rounds.

`--lone`: one client, one cold prompt of --cold-chars characters and a
--sweep-tokens answer, against fresh servers at segcache's default
--decode-concurrency and at --decode-concurrency 1, interleaved for
--rounds rounds: medians of TTFT and of the decode rate after the first
token (a lone request must be as fast at the default as one at a time);
with `--base SRC`, the same two for another tree's sources.

`--target wide` serves the shipped target widened (segcache.testing.widen: the same
function and greedy text, at a ~155M model's cost, built once into bench/.cache) in place
of --model, to every server of the run; `--sweep` (its speculative rows: lookup, draft)
prints the target's c(k) on mlx-lm's own cache first.

`--join`: 4 streams decode (--sweep-tokens each); once each has its first
token a long prompt (--join-chars) arrives. Reports the longest gap between
two chunks of a running stream after that (how long the joining prefill
stalls them), the joining prompt's TTFT and the running streams' tok/s.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "src" / "segcache" / "models"
QUESTIONS = [
    ["\n\ndef parse_header(line):\n", "\n\ndef read_body(stream, size):\n", "\n\nclass Reader:\n"],
    ["\n\ndef format_date(value):\n", "\n\ndef parse_date(text):\n", "\n\nclass Calendar:\n"],
    ["\n\ndef walk(tree):\n", "\n\ndef count_nodes(tree):\n", "\n\nclass Visitor:\n"],
]
EDIT = "\n\ndef write_body(stream, data):\n"
MORE = ["\n\ndef close(self):\n", "\n\ndef flush(self):\n", "\n\ndef reset(self):\n", "\n\ndef main():\n"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server subprocess: start, wait for it to answer, stop."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path):
        self.name, self.cmd, self.env, self.port, self.log = name, cmd, env, port, log
        self.proc = None

    def start(self) -> float:
        tic = time.perf_counter()
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env)
        url = f"http://127.0.0.1:{self.port}/v1/models"
        while time.perf_counter() - tic < 300:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return time.perf_counter() - tic
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not start in 300 s: see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=600, max_retries=0)


def request(client: openai.OpenAI, prompt: str, tokens: int) -> tuple[float, str]:
    """(seconds to the first text chunk, the whole text) of one streamed greedy completion."""
    tic = time.perf_counter()
    ttft, text = None, []
    for ev in client.completions.create(model="default_model", prompt=prompt, max_tokens=tokens,
                                        temperature=0.0, stream=True):
        piece = ev.choices[0].text if ev.choices else ""
        if piece and ttft is None:
            ttft = time.perf_counter() - tic
        text.append(piece or "")
    return (ttft if ttft is not None else time.perf_counter() - tic), "".join(text)


def replay(server: Proc, context: str, tokens: int) -> dict:
    """Run the trace; returns {phase: [ttft, ...]}, the cold texts and the concurrent wall time."""
    server.start()
    client = server.client()
    phases: dict[str, list[float]] = {}
    texts: dict[str, str] = {}
    sessions = [context + q[0] for q in QUESTIONS]

    def turn(phase: str, s: int, prompt: str, key: str | None = None) -> str:
        ttft, text = request(client, prompt, tokens)
        phases.setdefault(phase, []).append(ttft)
        if key:
            texts[key] = text
        print(f"  {server.name:<14} {phase:<13} {ttft * 1000:9.0f} ms", flush=True)
        return text

    try:
        history = [sessions[0] + turn("cold", 0, sessions[0], "s1t1")]
        for s in (1, 2):
            history.append(sessions[s] + turn("2nd session", s, sessions[s], f"s{s + 1}t1"))
        prompts = {}
        for t in (1, 2):
            for s in range(3):
                prompts[(s, t)] = history[s] + QUESTIONS[s][t]
                history[s] = prompts[(s, t)] + turn("continuation", s, prompts[(s, t)])
        turn("regenerate", 0, prompts[(0, 1)])
        edited = prompts[(0, 2)][: -len(QUESTIONS[0][2])] + EDIT
        turn("edit", 0, edited)
        server.stop()
        server.start()
        client = server.client()
        turn("restart", 1, prompts[(1, 2)])
        # 4 clients at once, each a new turn of its own session (the 4th continues the edit)
        starts = [history[0] + MORE[0], history[1] + MORE[1], history[2] + MORE[2], edited + MORE[3]]
        out = [None] * 4
        clients = [server.client() for _ in range(4)]

        def one(i):
            out[i] = request(clients[i], starts[i], tokens)

        tic = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - tic
        phases["concurrent"] = [o[0] for o in out]
        print(f"  {server.name:<14} concurrent    {wall * 1000:9.0f} ms wall, TTFT "
              + ", ".join(f"{o[0] * 1000:.0f}" for o in out) + " ms", flush=True)
        return {"phases": phases, "texts": texts, "wall": wall}
    finally:
        server.stop()


def _stream(client: openai.OpenAI, prompt: str, tokens: int) -> tuple[float | None, int, float]:
    """(seconds to the first token or None, completion tokens, seconds in all) of one streamed greedy completion."""
    tic = time.perf_counter()
    ttft, n = None, 0
    for ev in client.completions.create(model="default_model", prompt=prompt, max_tokens=tokens, temperature=0.0,
                                        stream=True, stream_options={"include_usage": True}):
        if ev.choices and ttft is None:
            ttft = time.perf_counter() - tic
        if ev.usage is not None:
            n = ev.usage.completion_tokens
    return ttft, n, time.perf_counter() - tic


def streamed(client: openai.OpenAI, prompt: str, tokens: int) -> tuple[float, int]:
    """(seconds to the first token, completion tokens) of one streamed greedy completion."""
    ttft, n, total = _stream(client, prompt, tokens)
    return (ttft if ttft is not None else total), n


def timed(client: openai.OpenAI, prompt: str, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, decode tok/s after it) of one streamed greedy completion."""
    ttft, n, total = _stream(client, prompt, tokens)
    ttft = ttft if ttft is not None else total
    return ttft, (n - 1) / max(total - ttft, 1e-9)


def burst(server: Proc, prompts: list[str], tokens: int) -> tuple[float, float]:
    """Start `server`, warm it, run all prompts at once; (aggregate tok/s, mean TTFT s)."""
    server.start()
    try:
        streamed(server.client(), "def warm_up():\n", 4)
        out = [None] * len(prompts)
        clients = [server.client() for _ in prompts]

        def one(i):
            out[i] = streamed(clients[i], prompts[i], tokens)

        tic = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - tic
        return sum(o[1] for o in out) / wall, sum(o[0] for o in out) / len(out)
    finally:
        server.stop()


def joining(server: Proc, prompts: list[str], long_prompt: str, tokens: int) -> dict:
    """Start `server`; len(prompts) streams decode, then a long prompt arrives. Returns the largest
    gap between two chunks of a running stream after the long prompt was sent, its TTFT, and the
    running streams' aggregate tok/s."""
    server.start()
    try:
        streamed(server.client(), "def warm_up():\n", 4)
        started = threading.Barrier(len(prompts) + 1)
        stamps: list[list[float]] = [[] for _ in prompts]
        out = {}

        def run(i):
            n = 0
            for ev in server.client().completions.create(model="default_model", prompt=prompts[i], max_tokens=tokens,
                                                         temperature=0.0, stream=True):
                if ev.choices and ev.choices[0].text:
                    stamps[i].append(time.perf_counter())
                    n += 1
                    if n == 1:
                        started.wait()
            if n == 0:
                started.wait()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        tic = time.perf_counter()
        for t in threads:
            t.start()
        started.wait()  # every stream is decoding
        sent = time.perf_counter()
        out["ttft"] = streamed(server.client(), long_prompt, 4)[0]
        for t in threads:
            t.join()
        wall = time.perf_counter() - tic
        gaps = [b - a for st in stamps for a, b in zip(st, st[1:]) if b > sent]
        out["gap"] = max(gaps) if gaps else 0.0
        out["tps"] = sum(len(st) for st in stamps) / wall
        return out
    finally:
        server.stop()


def join_bench(args, env, mlx_env, work: Path) -> int:
    text = (MODELS / "heldout_stdlib.txt").read_text()
    n = 4
    prompts = [text[i * 2000 : i * 2000 + 400] for i in range(n)]
    long_prompt = (MODELS / "heldout_other.txt").read_text()[: args.join_chars]
    ours = [sys.executable, "-m", "segcache.cli", "serve", "--model", args.model, "--log-level", "WARNING"]
    configs = {
        "segcache": (ours, env),
        "mlx_lm.server": ([sys.executable, "-m", "mlx_lm.server", "--model", args.model, "--log-level", "WARNING"],
                          mlx_env),
    }
    print(f"{n} streams of {args.sweep_tokens} tokens decoding; a {len(long_prompt)}-character prompt joins")
    for name, (cmd, e) in configs.items():
        port = _port()
        full = cmd + ["--port", str(port), "--decode-concurrency", str(n + 1), "--prompt-concurrency", "1"]
        if name.startswith("segcache"):
            full += ["--prompt-cache-dir", str(work / "store-join")]
        r = joining(Proc(name, full, e, port, work / f"{name}-join.log"), prompts, long_prompt, args.sweep_tokens)
        print(f"  {name:<16} longest stall of a running stream {r['gap'] * 1000:6.0f} ms, joining TTFT "
              f"{r['ttft'] * 1000:6.0f} ms, running streams {r['tps']:6.1f} tok/s", flush=True)
    return 0


def sweep(args, env, mlx_env, work: Path) -> int:
    text = (MODELS / "heldout_stdlib.txt").read_text()
    streams = [int(x) for x in args.streams.split(",")]
    prompts = [text[i * 2000 : i * 2000 + 400] for i in range(max(streams))]
    ours = [sys.executable, "-m", "segcache.cli", "serve", "--model", args.model, "--log-level", "WARNING"]
    configs = {
        "segcache": (ours, env),
        "segcache lookup": (ours + ["--prompt-lookup"], env),
        "segcache draft": (ours + ["--draft-model", str(MODELS / "draft")], env),
        "mlx_lm.server": ([sys.executable, "-m", "mlx_lm.server", "--model", args.model, "--log-level", "WARNING"],
                          mlx_env),
    }
    if args.base:  # another tree's sources, plain: before and after in the same run
        configs["segcache base"] = (ours, base_env(env, args.base))
    if args.only:  # a subset of the servers (e.g. `--only segcache,segcache base` for a before/after)
        keep = [x.strip() for x in args.only.split(",")]
        configs = {k: v for k, v in configs.items() if k in keep}
    rows = {(name, n): [] for name in configs for n in streams}
    rounds = args.rounds if args.sweep_rounds is None else args.sweep_rounds
    loads = []
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        for i, n in enumerate(streams):  # at each N every server in turn, the order rotated per round and N
            names = list(configs)
            at = (r + i) % len(names)  # so no server is always first (the first one of a run reads ~5% high)
            for name in names[at:] + names[:at]:
                cmd, e = configs[name]
                port = _port()
                full = cmd + ["--port", str(port), "--decode-concurrency", str(n), "--prompt-concurrency", str(n)]
                if name.startswith("segcache"):
                    full += ["--prompt-cache-dir", str(work / f"store-{name.replace(' ', '-')}-{n}-{r}")]
                got = burst(Proc(name, full, e, port, work / f"{name.replace(' ', '-')}.log"), prompts[:n],
                            args.sweep_tokens)
                rows[(name, n)].append(got)
                print(f"  round {r + 1} {name:<16} N={n}: {got[0]:7.1f} tok/s, TTFT {got[1] * 1000:7.0f} ms",
                      flush=True)
    med = {key: (statistics.median(t for t, _ in v), statistics.median(x for _, x in v)) for key, v in rows.items()}
    print(f"\nload average (1 min) at each round's start: {', '.join(f'{x:.1f}' for x in loads)}")
    print(f"aggregate generated tok/s (TTFT ms), {args.sweep_tokens} tokens per stream, medians of {rounds} round(s)")
    print(f"{'N':>3}" + "".join(f"{name:>22}" for name in configs))
    for n in streams:
        print(f"{n:>3}" + "".join(f"{med[(c, n)][0]:>12.1f} ({med[(c, n)][1] * 1000:>6.0f})" for c in configs))

    def ratios(a: str, b: str) -> str:  # per-round ratios of a to b at each N, and their median
        out = []
        for n in streams:
            per = [x[0] / y[0] for x, y in zip(rows[(a, n)], rows[(b, n)])]
            out.append(f"N={n} {statistics.median(per):.2f}x (" + ", ".join(f"{x:.2f}" for x in per) + ")")
        return "; ".join(out)

    if "segcache" in configs:
        for peer in ("mlx_lm.server", "segcache base"):
            if peer in configs:
                print(f"segcache / {peer}, median of rounds: " + ratios("segcache", peer))
        if not args.no_one:
            top = max(streams)
            port = _port()
            one = ours + ["--port", str(port), "--decode-concurrency", "1", "--prompt-cache-dir",
                          str(work / "store-one")]
            base = burst(Proc("segcache 1-at-a-time", one, env, port, work / "one.log"), prompts[:top],
                         args.sweep_tokens)
            print(f"segcache one at a time, N={top}: {base[0]:.1f} tok/s; batched N={top} (median): "
                  f"{med[('segcache', top)][0] / base[0]:.2f}x of it")
    return 0


def cold(args, env, mlx_env, work: Path) -> int:
    text = (MODELS / "heldout_other.txt").read_text()
    n = 8
    prompts = [text[i * 5000 : i * 5000 + args.cold_chars] for i in range(n)]
    ours = [sys.executable, "-m", "segcache.cli", "serve", "--model", args.model, "--log-level", "WARNING"]
    configs = {
        "segcache N=8": (ours + ["--decode-concurrency", str(n), "--prompt-concurrency", str(n)], env),
        "segcache one": (ours + ["--decode-concurrency", "1"], env),
        "mlx_lm.server": ([sys.executable, "-m", "mlx_lm.server", "--model", args.model, "--log-level", "WARNING",
                           "--decode-concurrency", str(n), "--prompt-concurrency", str(n)], mlx_env),
    }
    if args.base:  # another tree's sources, e.g. the commit before a change: before and after in one run
        configs["segcache base"] = (configs["segcache N=8"][0], base_env(env, args.base))
    if args.vllm_mlx and Path(args.vllm_mlx).exists():
        # its own venv (its own mlx), the same OpenBLAS preloaded as for mlx_lm.server
        configs["vllm-mlx"] = ([args.vllm_mlx, "serve", args.model, "--offline", "--continuous-batching",
                                "--max-num-seqs", str(n), "--host", "127.0.0.1", "--served-model-name", "default_model"],
                               {k: v for k, v in mlx_env.items() if k != "PYTHONPATH"})
    got = {name: [] for name in configs}
    loads = []
    print(f"{n} clients at once, cold prompts of {args.cold_chars} characters, {args.sweep_tokens} tokens each; "
          f"servers: {', '.join(configs)}")
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        order = list(configs)[r % len(configs):] + list(configs)[: r % len(configs)]  # interleaved, rotated
        for name in order:
            cmd, e = configs[name]
            port = _port()
            full = cmd + ["--port", str(port)]
            if name.startswith("segcache"):  # a fresh store each time: every prompt is cold
                full += ["--prompt-cache-dir", str(work / f"store-cold-{r}-{name.replace(' ', '-')}")]
            if name == "vllm-mlx":  # it keeps its prefix cache under ~/.cache between runs: a fresh home
                e = dict(e, HOME=str(work / f"vllm-home-{r}"))
            tps, ttft = burst(Proc(name, full, e, port, work / f"cold-{name.replace(' ', '-')}.log"),
                              prompts, args.sweep_tokens)
            got[name].append(tps)
            print(f"  round {r + 1} {name:<14} {tps:7.1f} tok/s, mean TTFT {ttft * 1000:6.0f} ms", flush=True)
    med = {name: statistics.median(v) for name, v in got.items()}
    print(f"\nload average (1 min) at each round's start: {', '.join(f'{x:.1f}' for x in loads)}")
    print("medians: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in med.items()))
    for peer, goal in (("mlx_lm.server", 1.0), ("vllm-mlx", 1.0), ("segcache one", 2.0), ("segcache base", None)):
        if peer in got:
            ratios = [a / b for a, b in zip(got["segcache N=8"], got[peer])]
            aim = f" (goal >= {goal}x)" if goal else ""
            print(f"segcache N=8 / {peer}: median of rounds {statistics.median(ratios):.2f}x{aim}; "
                  "per round " + ", ".join(f"{x:.2f}x" for x in ratios))
    return 0


def lone(args, env, work: Path) -> int:
    """One request alone: segcache at its default --decode-concurrency against --decode-concurrency 1."""
    prompt = (MODELS / "heldout_other.txt").read_text()[: args.cold_chars]
    ours = [sys.executable, "-m", "segcache.cli", "serve", "--model", args.model, "--log-level", "WARNING"]
    configs = {"segcache default": (ours, env), "segcache one": (ours + ["--decode-concurrency", "1"], env)}
    if args.base:
        configs["base default"] = (ours, base_env(env, args.base))
        configs["base one"] = (ours + ["--decode-concurrency", "1"], base_env(env, args.base))
    got = {name: [] for name in configs}
    loads = []
    print(f"one client, a cold prompt of {len(prompt)} characters, {args.sweep_tokens} tokens")
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            port = _port()
            tag = name.replace(" ", "-")
            cmd, e = configs[name]
            full = cmd + ["--port", str(port), "--prompt-cache-dir", str(work / f"store-lone-{r}-{tag}")]
            server = Proc(name, full, e, port, work / f"lone-{tag}.log")
            server.start()
            try:
                timed(server.client(), "def warm_up():\n", 4)
                ttft, tps = timed(server.client(), prompt, args.sweep_tokens)
            finally:
                server.stop()
            got[name].append((ttft, tps))
            print(f"  round {r + 1} {name:<17} TTFT {ttft * 1000:6.0f} ms, decode {tps:6.1f} tok/s", flush=True)
    print(f"\nload average (1 min) at each round's start: {', '.join(f'{x:.1f}' for x in loads)}")
    for name, v in got.items():
        print(f"{name:<17} median TTFT {statistics.median(t for t, _ in v) * 1000:6.0f} ms, "
              f"decode {statistics.median(x for _, x in v):6.1f} tok/s")
    for tree in ("segcache", "base") if args.base else ("segcache",):
        a, b = got[f"{tree} default"], got[f"{tree} one"]
        ttft, rate = [x[0] / y[0] for x, y in zip(a, b)], [x[1] / y[1] for x, y in zip(a, b)]
        print(f"{tree} default / one: TTFT median {statistics.median(ttft):.2f}x, per round "
              + ", ".join(f"{x:.2f}x" for x in ttft) + f"; decode median {statistics.median(rate):.2f}x, per round "
              + ", ".join(f"{x:.2f}x" for x in rate))
    return 0


def base_env(env: dict, src: str) -> dict:
    """`env` with another tree's sources first on PYTHONPATH (`--base`)."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT / "src")]
    return dict(env, PYTHONPATH=os.pathsep.join([str(Path(src).resolve())] + rest))


def verify_costs(common, args) -> None:
    """Print c(k) of the served target (loaded here, then freed before any server starts)."""
    import gc

    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(args.model)
    text = (MODELS / "heldout_stdlib.txt").read_text()[:400]
    common.print_verify_costs(model, tokenizer.encode(text), common.target_label(args))
    del model
    gc.collect()
    mx.clear_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODELS / "target"))
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--context-chars", type=int, default=6000)
    ap.add_argument("--mlx-blas", choices=["same", "wheel"], default="same")
    ap.add_argument("--sweep", action="store_true", help="the concurrency sweep instead of the trace")
    ap.add_argument("--sweep-tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--join", action="store_true",
                    help="4 streams decode while a long prompt joins: their longest stall, its TTFT")
    ap.add_argument("--join-chars", type=int, default=7000)
    ap.add_argument("--cold", action="store_true",
                    help="8 clients, cold prompts at once: batched against one at a time and mlx_lm.server")
    ap.add_argument("--cold-chars", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep-rounds", type=int, default=None,
                    help="--sweep's rounds (default: --rounds), the servers' order rotated per round and N")
    ap.add_argument("--only", default="", help="--sweep: only these servers (comma-separated names)")
    ap.add_argument("--no-one", action="store_true", help="--sweep: skip the one-at-a-time baseline")
    ap.add_argument("--vllm-mlx", default=os.environ.get("VLLM_MLX") or shutil.which("vllm-mlx") or "",
                    help="the vllm-mlx command for --cold (skipped where it is not installed)")
    ap.add_argument("--lone", action="store_true",
                    help="one request alone: the default --decode-concurrency against 1 (TTFT, decode tok/s)")
    ap.add_argument("--base", default="",
                    help="--cold / --lone / --sweep: also serve another tree's src/ (e.g. a checkout of the commit "
                         "before a change), interleaved with this one")
    import _common  # here, not at the top: it loads segcache and mlx, which the helpers mtp.py imports need not

    _common.add_target_args(ap)
    args = ap.parse_args()
    if args.target != "shipped":
        if args.model != str(MODELS / "target"):
            ap.error("--model and --target wide both name the target; pass one")
        args.model = str(_common.target_dir(args))
    if args.sweep:
        verify_costs(_common, args)
    context = (MODELS / "heldout_other.txt").read_text()[: args.context_chars]
    work = Path(tempfile.mkdtemp(prefix="segcache-bench-serve-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    mlx_env = dict(env)
    blas = "the mlx[cpu] wheel's BLAS"
    libs = glob.glob("/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0")
    if args.mlx_blas == "same" and libs and sys.platform.startswith("linux"):
        mlx_env.update(LD_PRELOAD=libs[0], OPENBLAS_THREAD_TIMEOUT="4")
        blas = f"OpenBLAS, LD_PRELOAD={libs[0]}"
    if args.cold:
        print(f"mlx_lm.server and vllm-mlx on {blas}; logs in {work}")
        return cold(args, env, mlx_env, work)
    if args.lone:
        return lone(args, env, work)
    if args.sweep or args.join:
        print(f"mlx_lm.server on {blas}; logs in {work}")
        return (sweep if args.sweep else join_bench)(args, env, mlx_env, work)
    p1, p2 = _port(), _port()
    ours = Proc("segcache serve", [sys.executable, "-m", "segcache.cli", "serve", "--model", args.model,
                                   "--port", str(p1), "--prompt-cache-dir", str(work / "store"),
                                   "--log-level", "WARNING"], env, p1, work / "segcache.log")
    theirs = Proc("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", args.model,
                                    "--port", str(p2), "--log-level", "WARNING"], mlx_env, p2, work / "mlx_lm.log")
    print(f"model {args.model}; {args.tokens} tokens per completion; context {len(context)} characters")
    print(f"mlx_lm.server on {blas}; logs in {work}")
    results = {}
    for server in (ours, theirs):
        results[server.name] = replay(server, context, args.tokens)

    a, b = results["segcache serve"], results["mlx_lm.server"]
    print("\ntime to first token, summed per phase (ms)")
    print(f"{'phase':<14}{'n':>3}{'segcache':>11}{'mlx_lm':>11}{'ratio':>8}")
    seq = ("cold", "2nd session", "continuation", "regenerate", "edit", "restart")
    for ph in seq + ("concurrent",):
        x, y = sum(a["phases"][ph]), sum(b["phases"][ph])
        print(f"{ph:<14}{len(a['phases'][ph]):>3}{x * 1000:>11.0f}{y * 1000:>11.0f}{x / y:>7.2f}x")
    x = sum(sum(a["phases"][p]) for p in seq)
    y = sum(sum(b["phases"][p]) for p in seq)
    print(f"{'sequential':<14}{'':>3}{x * 1000:>11.0f}{y * 1000:>11.0f}{x / y:>7.2f}x")
    print(f"concurrent wall time: segcache {a['wall']:.2f} s, mlx_lm {b['wall']:.2f} s ({a['wall'] / b['wall']:.2f}x)")
    r = sum(a["phases"]["restart"]) / sum(b["phases"]["restart"])
    print(f"turn after a restart: {1 / r:.1f}x faster")
    same = all(a["texts"][k] == b["texts"][k] for k in a["texts"])
    print(f"cold texts identical ({', '.join(sorted(a['texts']))}): {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
