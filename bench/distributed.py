"""Two ranks over loopback against one process on the same model: speed, time to first token, bytes per step.

The model (a ~32M-parameter hybrid by default, bench/_common.py HYBRID) is
written to a temporary model directory, then this script runs as its own rank
program: once as one process (a group of one: the whole model, no collective)
and once on two ranks over loopback with MLX's ring backend (what
`mlx.launch --backend ring -n 2` starts), tensor parallel or, with
--pipeline, pipeline parallel. Each run measures, with a per-rank prefix
store in a fresh directory:

  * time to first token, cold: a prompt of --prompt tokens through
    `Runtime.prefill` (resume nothing, compute, publish), then the first
    token's logits; resumed from RAM (a new runtime on the same store) and
    from disk (the store reopened: nothing in RAM), as after a restart;
  * decoding: --tokens greedy tokens, plain, through the reference lockstep
    loop (segcache.testing.lockstep: rank 0 decides each step and shares it,
    every step agreed by every rank: two channel messages per step) and
    through segcache's own engine (`stream_generate`, which needs no message:
    every rank computes the same logits bit for bit and decides alike);
  * bytes between ranks: the model's own collectives (all_sum / all_gather /
    send, counted by wrapping MLX's functions: payload per call, and the
    bytes a ring sends per rank for it) per decode step and per prompt
    token, and the channel's messages per decode step.

On this machine (2 cores, shared) two ranks split the cores that one process
uses alone, and loopback costs no wire time: the ratios say what the protocol
and the split cost here, not what two Macs would gain. Timings of the ranks
are rank 0's (the ranks run in lockstep).

Run: .venv/bin/python bench/distributed.py [--pipeline] [--family llama] [--prompt 512] [--tokens 48]
"""

from __future__ import annotations

import _common  # noqa: F401  (first: segcache binds OpenBLAS before mlx loads)

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from segcache import Runtime, stream_generate
from segcache.distributed import Channel, load, open_rank_store
from segcache.testing import lockstep, ranks

SPECS = {"qwen3_5": _common.HYBRID, "llama": _common.DENSE}


class Traffic:
    """Counts the model's collectives by wrapping MLX's functions (models look them up per call)."""

    OPS = ("all_sum", "all_gather", "send")

    def __init__(self, size: int):
        self.size = size
        self.payload = 0
        self.wire = 0
        self.calls = 0
        self._orig = {}

    def __enter__(self):
        for name in self.OPS:
            orig = self._orig[name] = getattr(mx.distributed, name)

            def wrapped(x, *args, _orig=orig, _name=name, **kwargs):
                self.calls += 1
                self.payload += x.nbytes
                n = self.size
                # what one rank puts on the wire: a ring all_sum reduce-scatters and all-gathers
                # (2(n-1)/n of the array), an all_gather forwards n-1 blocks, send sends it once
                self.wire += {"all_sum": 2 * (n - 1) * x.nbytes // n, "all_gather": (n - 1) * x.nbytes,
                              "send": x.nbytes}[_name]
                return _orig(x, *args, **kwargs)

            setattr(mx.distributed, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(mx.distributed, name, fn)
        return False

    def take(self) -> dict:
        out = {"calls": self.calls, "payload": self.payload, "wire": self.wire}
        self.calls = self.payload = self.wire = 0
        return out


def first_token(rt: Runtime, prompt: list[int]) -> float:
    """Seconds from nothing to the first generated token (prefill with the store, then the argmax)."""
    tic = time.perf_counter()
    logits = rt.prefill(prompt)
    tok = mx.argmax(logits, axis=-1)
    mx.eval(tok)
    return time.perf_counter() - tic


def rank_main(args) -> None:
    """One rank (or the one process): every figure, printed as RESULT lines."""
    channel = Channel(timeout=600)
    model, tokenizer, shard = load(args.model, pipeline=args.pipeline)
    prompt = _common.tokens(args.prompt, args.vocab, seed=3)
    out = {"size": channel.size, "rank": channel.rank, "shard": shard.describe() if shard else None}
    with Traffic(channel.size) as traffic:
        # time to first token: cold, resumed from RAM, resumed from disk (a restart)
        cold, ram, disk = [], [], []
        for r in range(args.repeats):
            root = Path(args.store) / f"run{r}"
            store = open_rank_store(root, shard, page_tokens=256)
            traffic.take()
            cold.append(first_token(Runtime(model, store=store, gdn_prefill="auto"), prompt))
            prefill_traffic = traffic.take()
            ram.append(first_token(Runtime(model, store=store, gdn_prefill="auto"), prompt))
            store.close()
            store = open_rank_store(root, shard, page_tokens=256)
            disk.append(first_token(Runtime(model, store=store, gdn_prefill="auto"), prompt))
            out["resumed_tokens"] = store.stats()["hit_tokens"]
            store.close()
            channel.check()  # every rank done with this repeat before the next
        out.update(ttft_cold=cold, ttft_ram=ram, ttft_disk=disk, prefill_traffic=prefill_traffic)

        # decoding: the lockstep loop (rank 0 decides) and the engine (every rank decides)
        short = prompt[: args.context]
        lock, engine = [], []
        for _ in range(args.repeats):
            rt = Runtime(model)
            sent, msgs = channel.stats.sent_bytes, channel.stats.collectives
            traffic.take()
            tic = time.perf_counter()
            lockstep.generate(rt, channel, short, max_tokens=args.tokens)
            lock.append(args.tokens / (time.perf_counter() - tic))
            decode_traffic = traffic.take()
            out["channel_bytes_per_token"] = (channel.stats.sent_bytes - sent) / args.tokens
            out["channel_messages_per_token"] = (channel.stats.collectives - msgs) / args.tokens
            rt = Runtime(model)
            rt.forward(short[:-1])
            mx.eval([c.state for c in rt.cache])
            traffic.take()
            gen = stream_generate(model, tokenizer, short[-1:], runtime=rt, max_tokens=args.tokens)
            first = next(gen)
            tic, n = time.perf_counter(), 1
            for _ in gen:
                n += 1
            engine.append((n - 1) / (time.perf_counter() - tic))
            engine_traffic = traffic.take()
            out["engine_tokens"] = n
            channel.check()
        # per token: the prompt part of the lockstep run is its first forward(s)
        out.update(lockstep_tps=lock, engine_tps=engine, decode_traffic=decode_traffic,
                   engine_traffic=engine_traffic)
    print("RESULT " + json.dumps(out), flush=True)


def run_ranks(args, n: int, model_dir: Path, store: Path) -> list[dict]:
    argv = [__file__, "--rank", "--model", str(model_dir), "--store", str(store), "--prompt", str(args.prompt),
            "--tokens", str(args.tokens), "--context", str(args.context), "--repeats", str(args.repeats),
            "--vocab", str(args.vocab)] + (["--pipeline"] if args.pipeline else [])
    if n == 1:  # no hostfile: mx.distributed.init() gives a group of one
        env = {k: v for k, v in os.environ.items() if k not in ("MLX_HOSTFILE", "MLX_RANK")}
        done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=3600)
        outs = [ranks.Rank(0, done.returncode, done.stdout, done.stderr)]
    else:
        outs = ranks.run(argv, n, timeout=3600)
    for r in outs:
        if r.returncode != 0:
            sys.exit(f"rank {r.rank} of {n} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return [r.json()[0] for r in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--family", default="qwen3_5", choices=sorted(SPECS))
    parser.add_argument("--pipeline", action="store_true", help="split the layers, not the heads")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens for time to first token (512)")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens before decoding")
    parser.add_argument("--tokens", type=int, default=None, help="tokens decoded per run (48)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure (3)")
    parser.add_argument("--quick", action="store_true", help="256-token prompt, 24 tokens, 2 repeats")
    # the rank program's own arguments
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank_main(args)
    for name, full, quick in (("prompt", 512, 256), ("tokens", 48, 24), ("repeats", 3, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    spec = dict(SPECS[args.family])
    if args.pipeline and args.family == "llama":
        sys.exit("llama has no pipeline() in mlx-lm: use --family qwen3_5 with --pipeline")
    args.vocab = spec["vocab_size"]
    model, params = _common.build(spec)
    _common.header(f"distributed: {'pipeline' if args.pipeline else 'tensor'} parallel, 2 ranks over loopback "
                   "vs one process", [("", spec, params)])
    tmp = Path(tempfile.mkdtemp(prefix="segcache-bench-dist-"))
    try:
        family = spec.pop("family")
        lockstep.save_model(family, tmp / "model", seed=0, **spec)
        del model
        one = run_ranks(args, 1, tmp / "model", tmp / "store1")[0]
        two = run_ranks(args, 2, tmp / "model", tmp / "store2")
        report(args, one, two)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _med(xs):
    return statistics.median(xs)


def report(args, one: dict, two: list[dict]) -> None:
    r0 = two[0]
    print(f"prompt {args.prompt} tokens (page 256), {args.tokens} tokens decoded after {args.context}, "
          f"{args.repeats} repeats; medians [min-max]; 2 ranks: rank 0's clock")
    print(f"shards: {[r['shard'] for r in two]}")
    print()
    print(f"{'':34} {'1 process':>22} {'2 ranks':>22} {'2 ranks / 1':>12}")

    def row(name, key, unit, scale=1.0, fmt="{:.1f}"):
        a, b = [x * scale for x in one[key]], [x * scale for x in r0[key]]
        cell = lambda v: f"{fmt.format(_med(v))} [{fmt.format(min(v))}-{fmt.format(max(v))}]"
        print(f"{name:34} {cell(a):>22} {cell(b):>22} {_med(b) / _med(a):>11.2f}x  {unit}")

    row("time to first token, cold", "ttft_cold", "ms", 1e3)
    row("time to first token, from RAM", "ttft_ram", "ms", 1e3)
    row("time to first token, from disk", "ttft_disk", "ms", 1e3)
    row("decode, lockstep (rank 0 decides)", "lockstep_tps", "tokens/s")
    row("decode, engine (each rank decides)", "engine_tps", "tokens/s")
    print(f"resumed tokens: {one['resumed_tokens']} (1 process), {r0['resumed_tokens']} (each rank)")
    print()
    print("bytes each rank sends (ring estimate: all_sum 2(n-1)/n of the array, all_gather n-1 blocks, send 1):")
    for r in two:
        e, p = r["engine_traffic"], r["prefill_traffic"]
        steps = max(1, r["engine_tokens"] - 1)
        print(f"  rank {r['rank']}: model, per decode step: {e['wire'] / steps:,.0f} B in {e['calls'] / steps:.0f} "
              f"collectives; per prompt token (cold prefill): {p['wire'] / args.prompt:,.0f} B")
    print(f"  lockstep loop, channel, per decode step: {r0['channel_bytes_per_token']:,.0f} B in "
          f"{r0['channel_messages_per_token']:.1f} messages (each rank)")


if __name__ == "__main__":
    main()
