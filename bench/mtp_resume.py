"""Time to first token of a stored prompt after a restart, with MTP and without.

    python bench/mtp_resume.py [--tokens 3000] [--repeats 5] [--model DIR] [--configs plain,mtp,...]
    python bench/mtp_resume.py --in-process N [--configs ...]

A ~3,000-token prompt (held-out stdlib code) is prefilled once with the MTP head on,
into an on-disk store (the target's records and the head's: store/drafter_records.py).
Each sample is a fresh process (a restart: empty RAM tier, the model loaded anew)
that opens the store and times `stream_generate` from the call to its first token:

    plain        without MTP: resumed to the prompt's last token but one, which the first
                 step forwards (mlx-lm's shape: resume-to-prompt-1)
    mtp          with MTP, the head's state resumed from the store
    mtp-recompute with MTP on a copy of the store without the head's records (what a
                 resume cost before them: one forward of the whole restored prefix)
    plain-whole  without MTP, `whole_prompt=True`: the whole prompt resumed with the boundary
                 records (its end's checkpoint keeps the last logits), no forward before
                 the first token
    mtp-whole    the same with MTP (the head's records at the prompt's end too)
    serve-prompt1, serve-mtp-prompt1
                 the server's request engine (serve/engine.py, one row: `Engine`, `Scheduler`),
                 timed from the request's submit to its first chunk, with sessions not whole:
                 the server before whole-prompt sessions (resume-to-prompt-1), without MTP and with
    serve, serve-mtp
                 the same with the server's default whole-prompt sessions (docs/serve.md)

The store holds both ends (the prompt but its last token, published by a generation, and
the whole prompt with its logits, published by a `whole_prompt` one). Configurations are
interleaved per repeat; every run's first token must equal plain's. Prints the medians
and the median of each repeat's ratio to plain.

`--in-process N` instead times N samples of each configuration in this process (the model
and head loaded once, a fresh Runtime per sample on the store opened without a RAM tier,
so every record is read from disk; mtp-recompute left out), configurations rotated per
sample: wall clock and CPU time, each sample's ratio to plain's in the same sample. Not a
restart, but many more samples on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import segcache  # noqa: I001  (binds OpenBLAS before mlx loads)

import mlx_lm

from segcache import Runtime, open_store
from segcache.generation import stream_generate
from segcache.models import MODELS_DIR
from segcache.mtp import load_head
from segcache.serve.engine import Chunk, Engine, GenRequest
from segcache.serve.worker import Job, Scheduler

CONFIGS = ("plain", "mtp", "mtp-recompute", "plain-whole", "mtp-whole", "serve-prompt1", "serve-mtp-prompt1",
           "serve", "serve-mtp")


def _uses_head(config: str) -> bool:
    return config.startswith("mtp") or config.startswith("serve-mtp")


def _agrees(first: str, want: str) -> bool:
    """The first token's text agrees with plain's (the server's first chunk may hold more tokens, or
    fewer characters while its detokenizer waits for the rest of one; a leading space dropped)."""
    first, want = first.strip(), want.strip()
    return first.startswith(want) or want.startswith(first)


def _first(model, tokenizer, head, ids, store, config: str) -> tuple[float, str]:
    """(seconds from the call to the first token, its text) of one configuration on `store`."""
    if config.startswith("serve"):
        engine = Engine(model, tokenizer, store=store, mtp=head, num_draft_tokens=2,
                        whole_prompt=not config.endswith("-prompt1"))
        sched = Scheduler(engine, max_queue=1, max_running=1, begin_step=engine.begin_step)
        got = []
        tic = time.perf_counter()
        job = Job(GenRequest("bench", list(ids), 8), lambda e: got.append(e) if isinstance(e, Chunk) else None)
        sched.submit(job)
        while not got and sched.step():
            pass
        ttft = time.perf_counter() - tic
        job.cancel()
        while sched.step():
            pass
        return ttft, got[0].text
    rt = Runtime(model, store=store, gdn_prefill="auto")
    tic = time.perf_counter()
    gen = stream_generate(model, tokenizer, ids, max_tokens=8, runtime=rt, mtp=head, num_draft_tokens=2,
                          whole_prompt=config.endswith("-whole"))
    first = next(gen)
    ttft = time.perf_counter() - tic
    gen.close()
    return ttft, tokenizer.decode([first.token])


def _prompt(tokenizer, n: int) -> list[int]:
    """The first n tokens of the held-out stdlib code (never seen by the shipped head's training)."""
    ids = tokenizer.encode((MODELS_DIR / "heldout_stdlib.txt").read_text())
    if len(ids) < n:
        raise SystemExit(f"the held-out text has {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def _child(args) -> None:
    """One sample: load, open the store, time the first token; print JSON."""
    model, tokenizer = mlx_lm.load(args.model)
    head = load_head(model, args.model) if _uses_head(args.config) else None
    ids = json.loads(Path(args.prompt).read_text())
    with open_store(args.store, page_tokens=256) as store:
        ttft, text = _first(model, tokenizer, head, ids, store, args.config)
    print(json.dumps({"ttft": ttft, "first": text}))


def _in_process(model, tokenizer, head, ids, path, configs, n) -> None:
    """N samples of each configuration in this process (see the module docstring)."""
    wall = {c: [] for c in configs}
    cpu = {c: [] for c in configs}
    want = None
    with open_store(path, page_tokens=256, ram_bytes=0) as store:
        for i in range(n + 1):  # the first round warms up (not counted)
            for c in configs[i % len(configs):] + configs[: i % len(configs)]:
                c0 = time.process_time()
                w, first = _first(model, tokenizer, head if _uses_head(c) else None, ids, store, c)
                t = time.process_time() - c0
                want = want or first
                if not _agrees(first, want):
                    raise SystemExit(f"{c}: first token {first!r}, plain's {want!r}")
                if i:
                    wall[c].append(w)
                    cpu[c].append(t)
    print(f"time to first token in this process, {n} samples each (median, min-max; ratio: median of each "
          f"sample's to plain's; the same first token throughout)")
    for c in configs:
        rw = statistics.median(a / b for a, b in zip(wall[c], wall["plain"]))
        rc = statistics.median(a / b for a, b in zip(cpu[c], cpu["plain"]))
        print(f"  {c:<12} wall {statistics.median(wall[c]) * 1e3:7.1f} ms ({min(wall[c]) * 1e3:.1f}-"
              f"{max(wall[c]) * 1e3:.1f}) {rw:.2f}x plain   cpu {statistics.median(cpu[c]) * 1e3:7.1f} ms {rc:.2f}x plain")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(MODELS_DIR / "target"))
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS) + " (plain always)")
    p.add_argument("--in-process", type=int, default=0, metavar="N")
    p.add_argument("--child", choices=CONFIGS)
    p.add_argument("--store")
    p.add_argument("--prompt")
    args = p.parse_args()
    if args.child:
        args.config = args.child
        _child(args)
        return
    model, tokenizer = mlx_lm.load(args.model)
    ids = _prompt(tokenizer, args.tokens)
    work = Path(tempfile.mkdtemp(prefix="mtp_resume_"))
    try:
        prompt = work / "prompt.json"
        prompt.write_text(json.dumps(ids))
        with_head, without = work / "with_head", work / "without_head"
        with open_store(with_head, page_tokens=256) as store:  # the prompt stored with the head on
            head = load_head(model, args.model)
            rt = Runtime(model, store=store, gdn_prefill="auto")
            for _ in stream_generate(model, tokenizer, ids, max_tokens=1, runtime=rt, mtp=head):
                pass
            rt = Runtime(model, store=store, gdn_prefill="auto")  # ... and whole, with its last logits
            for _ in stream_generate(model, tokenizer, ids, max_tokens=1, runtime=rt, mtp=head, whole_prompt=True):
                pass
            store.flush()
        with open_store(with_head, page_tokens=256) as store:
            kinds = sorted({e.kind for e in store.entries()})
        shutil.copytree(with_head, without)
        with open_store(without, page_tokens=256) as store:
            for e in store.entries():
                if e.kind in ("dpage", "dckpt"):
                    store.delete(e.key)
        print(f"segcache.BLAS: {segcache.BLAS}; prompt {len(ids)} tokens; records {kinds}; "
              f"{args.repeats} repeats, a fresh process per sample, configurations interleaved")
        configs = ["plain"] + [c for c in CONFIGS if c != "plain" and c in args.configs.split(",")]
        if args.in_process:
            _in_process(model, tokenizer, head, ids, with_head, [c for c in configs if c != "mtp-recompute"],
                        args.in_process)
            return
        stores = {c: without if c == "mtp-recompute" else with_head for c in configs}
        times = {c: [] for c in configs}
        ratios = {c: [] for c in configs}
        want = None
        for r in range(args.repeats):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            got = {}
            for c in order:
                out = subprocess.run([sys.executable, __file__, "--child", c, "--store", str(stores[c]),
                                      "--prompt", str(prompt), "--model", args.model],
                                     check=True, capture_output=True, text=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                got[c] = res["ttft"]
                want = want or res["first"]
                if not _agrees(res["first"], want):
                    raise SystemExit(f"{c}: first token {res['first']!r}, plain's {want!r}")
            for c in configs:
                times[c].append(got[c])
                ratios[c].append(got[c] / got["plain"])
            print(f"  repeat {r + 1}: " + ", ".join(f"{c} {got[c] * 1e3:.0f} ms" for c in configs), flush=True)
        print("time to first token after a restart (median, min-max; ratio: median of each repeat's to plain)")
        for c in configs:
            t = times[c]
            print(f"  {c:<14} {statistics.median(t) * 1e3:8.1f} ms ({min(t) * 1e3:.1f}-{max(t) * 1e3:.1f})"
                  f"   {statistics.median(ratios[c]):.2f}x plain")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
