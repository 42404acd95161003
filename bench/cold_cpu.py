"""The cold-prompt mix in process, in CPU time: what a shared machine still measures.

    python bench/cold_cpu.py [--rounds 5] [--cold-chars 1000] [--tokens 64] [--stagger 0]

The prompts and answers of `bench/serve.py --cold` (8 distinct cold prompts of
--cold-chars characters of Python, --tokens greedy tokens each), without HTTP:

  segcache N=8   the server's Engine under its Scheduler at --decode-concurrency 8, a fresh
                 prefix store per run (every prompt cold); --stagger S submits the first
                 prompt S scheduler steps before the others (as HTTP arrivals spread)
  segcache one   the same at --decode-concurrency 1 (one request at a time)
  BatchGenerator mlx-lm's own batch of the same 8 prompts (no engine, store or detokenizer)

interleaved in each of --rounds rounds (the order rotated). For each: the
process CPU time and the wall time of the whole burst, medians, and the
ratios of the medians. CPU time moves far less than wall time when other jobs
load the machine; both BLAS threads count, so it is not a wall-clock figure.
Also counted: the prefill forwards and decode steps the engine ran, and where an
engine burst's wall time went, by scheduler step: those that ran a prefill
forward (a decode step of the running rows too), those that ran a decode step
only, and the last one (its rows leave: released, published, the store
flushed before the answer ends).
"""

from __future__ import annotations

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import argparse
import statistics
import tempfile
import time

import mlx_lm
from mlx_lm.generate import BatchGenerator

from segcache import open_store
from segcache.models import MODELS_DIR
from segcache.serve.engine import Engine, Finish, GenRequest
from segcache.serve.worker import Job, Scheduler


def engine_burst(model, tok, prompts, tokens: int, concurrency: int, stagger: int) -> dict:
    """One burst through a fresh Engine; CPU and wall seconds, forwards counted."""
    with tempfile.TemporaryDirectory() as d:
        store = open_store(d)
        engine = Engine(model, tok, decode_concurrency=concurrency, prompt_concurrency=len(prompts), store=store)
        sched = Scheduler(engine, max_running=concurrency, begin_step=engine.begin_step)
        engine.warm_up()
        done = set()

        def deliver(rid):
            return lambda ev: done.add(rid) if isinstance(ev, Finish) and ev.last else None

        jobs = [Job(GenRequest(f"r{i}", list(p), tokens), deliver(f"r{i}")) for i, p in enumerate(prompts)]
        c0, t0 = time.process_time(), time.perf_counter()
        sched.submit(jobs[0])
        steps = 0
        for job in jobs[1:] if stagger == 0 else ():
            sched.submit(job)
        split = dict(prefill_s=0.0, decode_s=0.0, last_s=0.0)
        while len(done) < len(jobs):
            if stagger and steps == stagger:
                for job in jobs[1:]:
                    sched.submit(job)
            forwards, tic = engine.prefill_chunks, time.perf_counter()
            sched.step()
            took = time.perf_counter() - tic
            steps += 1
            kind = "last_s" if len(done) == len(jobs) else "prefill_s" if engine.prefill_chunks > forwards else "decode_s"
            split[kind] += took
        out = dict(cpu=time.process_time() - c0, wall=time.perf_counter() - t0,
                   prefill=engine.prefill_chunks, decode=engine.decode_steps, **split)
        store.close()
    return out


def batch_generator(model, prompts, tokens: int) -> dict:
    """mlx-lm's BatchGenerator on the same prompts, until every row gave `tokens` tokens."""
    gen = BatchGenerator(model, max_tokens=tokens)
    c0, t0 = time.process_time(), time.perf_counter()
    gen.insert(prompts, max_tokens=[tokens] * len(prompts))
    n = 0
    while n < tokens * len(prompts):
        n += len(gen.next_generated())
    out = dict(cpu=time.process_time() - c0, wall=time.perf_counter() - t0)
    gen.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODELS_DIR / "target"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold-chars", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--stagger", type=int, default=0)
    args = ap.parse_args()
    model, tok = mlx_lm.load(args.model)
    text = (MODELS_DIR / "heldout_other.txt").read_text()
    prompts = [tok.encode(text[i * 5000 : i * 5000 + args.cold_chars]) for i in range(8)]
    runs = {
        "segcache N=8": lambda: engine_burst(model, tok, prompts, args.tokens, 8, args.stagger),
        "segcache one": lambda: engine_burst(model, tok, prompts, args.tokens, 1, 0),
        "BatchGenerator": lambda: batch_generator(model, prompts, args.tokens),
    }
    for run in runs.values():  # warm every path once
        run()
    got = {name: [] for name in runs}
    print(f"8 cold prompts of {args.cold_chars} characters ({min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens), {args.tokens} tokens each; stagger {args.stagger}")
    for r in range(args.rounds):
        order = list(runs)[r % len(runs):] + list(runs)[: r % len(runs)]
        for name in order:
            got[name].append(runs[name]())
            g = got[name][-1]
            extra = (f", {g['prefill']} prefill forwards, {g['decode']} decode steps; wall in steps with a prefill "
                     f"forward {g['prefill_s']:.3f} s, decode only {g['decode_s']:.3f} s, the last "
                     f"{g['last_s'] * 1e3:.1f} ms" if "prefill" in g else "")
            print(f"  round {r + 1} {name:<15} cpu {g['cpu']:.3f} s, wall {g['wall']:.3f} s{extra}", flush=True)
    med = {name: {k: statistics.median(g[k] for g in v) for k in ("cpu", "wall")} for name, v in got.items()}
    print("medians: " + ", ".join(f"{n} cpu {m['cpu']:.3f} s wall {m['wall']:.3f} s" for n, m in med.items()))
    for name in ("segcache N=8", "segcache one"):
        m = {k: statistics.median(g[k] for g in got[name]) for k in ("prefill_s", "decode_s", "last_s")}
        print(f"{name} wall medians: steps with a prefill forward {m['prefill_s']:.3f} s, decode only "
              f"{m['decode_s']:.3f} s, the last step {m['last_s'] * 1e3:.1f} ms")
    ours = med["segcache N=8"]
    for peer in ("segcache one", "BatchGenerator"):
        print(f"{peer} / segcache N=8 (how many times less segcache N=8 took): cpu {med[peer]['cpu'] / ours['cpu']:.2f}x, "
              f"wall {med[peer]['wall'] / ours['wall']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
