"""Decode step time while the flush timer writes the prefix store, against none (issue 33, item 2).

    python bench/flush.py                 # shipped target, 6 rounds
    python bench/flush.py --rounds 10 --mb 60

`segcache serve`'s `Flusher` (serve/worker.py) writes the RAM tier's new records to disk
on its own thread, a chunk per hold of the store's lock; decoding does not touch the
store. Each round marks every RAM record dirty again (about --mb MB of records), then
times decode steps of one runtime while a `Flusher.flush()` runs on a thread, and as
many steps with nothing writing; the ratio of their medians is printed per round, and
the median over rounds (target <= 1.2x). The two windows of a round run back to back
(interleaved): on a shared machine, only ratios of one round mean something.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import mlx.core as mx
import mlx_lm

from segcache import Runtime
from segcache.serve.worker import FLUSH_CHUNK, FLUSH_PAUSE, Flusher
from segcache.store import open_store

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "src" / "segcache" / "models"


def step_times(rt: Runtime, token: int, until, least: int) -> list[float]:
    """Decode steps of rt (one token each) until `until()` is true and at least `least` ran."""
    out = []
    while len(out) < least or not until():  # until() is read between steps: the flush may end mid-step
        tic = time.perf_counter()
        logits = rt.forward([token])
        mx.eval(logits)
        out.append(time.perf_counter() - tic)
        token = int(mx.argmax(logits[0, -1]).item())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODELS / "target")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mb", type=float, default=40.0, help="MB of records each flush writes")
    ap.add_argument("--chunk", type=int, default=FLUSH_CHUNK, help="bytes per hold of the store's lock")
    ap.add_argument("--pause", type=float, default=FLUSH_PAUSE, help="seconds between two chunks")
    args = ap.parse_args()
    model, tok = mlx_lm.load(str(args.model))
    text = (MODELS / "heldout_stdlib.txt").read_text()
    rnd = random.Random(0)
    with tempfile.TemporaryDirectory() as d, open_store(d, ram_bytes=1 << 31, disk_bytes=1 << 33) as store:
        while store.stats()["ram_bytes"] < args.mb * 1e6:  # distinct prompts until the records weigh --mb
            start = rnd.randrange(0, len(text) - 3000)
            Runtime(model, store=store).prefill(tok.encode(f"# {rnd.random()}\n" + text[start : start + 3000]))
        store.flush()
        decoder = Runtime(model)
        decoder.prefill(tok.encode("def main():\n"))
        first = tok.encode("\n")[-1]
        step_times(decoder, first, lambda: True, 20)  # warm
        ratios = []
        print(f"records {store.stats()['ram_entries']} ({store.stats()['ram_bytes'] / 1e6:.0f} MB in RAM); "
              f"decode steps of one row of {args.model.name}", flush=True)
        for r in range(args.rounds):
            for k in store._ram.keys():  # the bench's own way to give the flush the same work again
                store._ram._dirty.add(k)
            flusher = Flusher(store, chunk=args.chunk, pause=args.pause)
            done = threading.Event()
            tic = time.perf_counter()
            writer = threading.Thread(target=lambda: (flusher.flush(), done.set()))
            writer.start()
            busy = step_times(decoder, first, done.is_set, 5)
            writer.join()
            wrote = time.perf_counter() - tic
            # then as many steps with nothing writing, back to back with the busy ones
            quiet = step_times(decoder, first, lambda: True, len(busy))
            ratio = statistics.median(busy) / statistics.median(quiet)
            ratios.append(ratio)
            print(f"round {r}: flush of {flusher.records} records took {wrote:.2f} s; step median "
                  f"{statistics.median(busy) * 1e3:.2f} ms while writing, {statistics.median(quiet) * 1e3:.2f} ms "
                  f"without ({len(busy)} steps each): {ratio:.2f}x", flush=True)
        med = statistics.median(ratios)
        print(f"median over {args.rounds} rounds: {med:.2f}x (target <= 1.2x)")
    return 0 if med <= 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())
