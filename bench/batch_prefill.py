"""Would one batched forward of several joining prompts beat prefilling each alone?

    python bench/batch_prefill.py [--reps 7]

For k prompts' chunks (near-equal and spread lengths) on the shipped hybrid
target, the best of --reps interleaved runs of:

  alone native   k Runtime forwards, mlx-lm's per-token Gated DeltaNet loop
  alone auto     k Runtime forwards, chunked GDN off Metal (what `segcache serve` prefills with)
  batched        k empty BatchRuntime rows, one forward (ragged: inside a fork, then a
                 commit of each row's own length), GDN strategy "states" or "replay"
  +to_runtime    batched "states", then each row copied back to a Runtime (the store
                 publishes from one)

and, per k, the largest logit difference of a batched row against its prompt
alone and whether the argmax agrees.
"""

from __future__ import annotations

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import argparse
import time

import mlx.core as mx
import mlx_lm

from segcache import Runtime
from segcache.layers.kv import BatchKVLayer
from segcache.batch.runtime import BatchRuntime
from segcache.demo import MODELS_DIR


def alone(model, chunks, mode):
    rts = [Runtime(model, gdn_prefill=mode) for _ in chunks]
    tic = time.perf_counter()
    outs = []
    for rt, c in zip(rts, chunks):
        last = rt.forward(c)[:, -1] * 1
        mx.eval(last, [layer.state for layer in rt.cache])
        outs.append(last)
    return time.perf_counter() - tic, outs


def batched(model, chunks, strategy, to_runtime):
    br = BatchRuntime(model, recurrent_strategy=strategy)
    for i in range(len(chunks)):
        br.join(i)
    tic = time.perf_counter()
    ragged = len({len(c) for c in chunks}) > 1
    if ragged:
        br.fork()
    out = br.forward(chunks)
    lasts = [out[i, len(c) - 1] for i, c in enumerate(chunks)]
    if ragged:
        br.commit([len(c) for c in chunks])
    mx.eval(lasts, [(x.keys, x.values) if isinstance(x, BatchKVLayer) else x.cache for x in br.cache])
    if to_runtime:
        rts = [br.to_runtime(i) for i in range(len(chunks))]
        mx.eval([[layer.state for layer in rt.cache] for rt in rts])
    return time.perf_counter() - tic, lasts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    model, tok = mlx_lm.load(str(MODELS_DIR / "target"))
    text = (MODELS_DIR / "heldout_stdlib.txt").read_text()
    print(f"BLAS: {segcache.BLAS}; best of {args.reps}, ms")
    for k, base, spread in ((2, 167, 8), (4, 167, 8), (8, 167, 8), (2, 256, 0), (4, 256, 0), (4, 256, 40)):
        chunks = [tok.encode(text[i * 2000 : i * 2000 + 4000])[: base - (i * spread) % (spread + 1) if spread else base]
                  for i in range(k)]
        runs = {
            "alone native": lambda: alone(model, chunks, "native"),
            "alone auto": lambda: alone(model, chunks, "auto"),
            "batched states": lambda: batched(model, chunks, "states", False),
            "batched replay": lambda: batched(model, chunks, "replay", False),
            "+to_runtime": lambda: batched(model, chunks, "states", True),
        }
        best = {name: (float("inf"), None) for name in runs}
        for _ in range(args.reps):
            for name, run in runs.items():
                t, outs = run()
                if t < best[name][0]:
                    best[name] = (t, outs)
        ref, got = best["alone native"][1], best["batched states"][1]
        diff = max(mx.abs(a.reshape(-1) - b.reshape(-1)).max().item() for a, b in zip(ref, got))
        same = all(mx.argmax(a.reshape(-1)).item() == mx.argmax(b.reshape(-1)).item() for a, b in zip(ref, got))
        lens = sorted(len(c) for c in chunks)
        cells = ", ".join(f"{name} {t * 1000:.0f}" for name, (t, _) in best.items())
        print(f"k={k} lengths {lens[0]}..{lens[-1]}: {cells}; max |dlogit| {diff:.1e}, argmax same: {same}", flush=True)


if __name__ == "__main__":
    main()
