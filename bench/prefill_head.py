"""One-row prefill with the output head at the last position only, against the full head.

    python bench/prefill_head.py [--rounds 7] [--tokens 1000] [--step 2048]

`Runtime(model).prefill` of a --tokens prompt on the shipped target, as it runs
(`Prefill.feed` forwards with `last_only=True`: adapters/head.py), and with
`Runtime.forward` made to ignore `last_only` (the full head over every position,
the path before), interleaved in each of --rounds rounds with the order
alternated. Prints the medians of wall and process CPU time and their ratios
(full / last-only: above 1 is faster), measured in the same run.
"""

from __future__ import annotations

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import argparse
import statistics
import time

import mlx.core as mx
import mlx_lm

from segcache import Runtime
from segcache.models import MODELS_DIR


def one(model, ids: list, step: int, full: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one cold prefill of `ids`."""
    forward = Runtime.forward
    if full:
        Runtime.forward = lambda self, tokens, last_only=False: forward(self, tokens)
    try:
        rt = Runtime(model)
        wall, cpu = time.perf_counter(), time.process_time()
        mx.eval(rt.prefill(ids, step_size=step))
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        Runtime.forward = forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--step", type=int, default=2048)
    args = ap.parse_args()
    model, _ = mlx_lm.load(str(MODELS_DIR / "target"))
    ids = [(7 * t + 3) % 5000 + 10 for t in range(args.tokens)]
    one(model, ids, args.step, False)  # warm-up: kernels, allocator
    one(model, ids, args.step, True)
    runs: dict[bool, list] = {False: [], True: []}
    for r in range(args.rounds):
        for full in ((False, True) if r % 2 == 0 else (True, False)):
            runs[full].append(one(model, ids, args.step, full))
    med = {full: [statistics.median(x[i] for x in runs[full]) for i in (0, 1)] for full in runs}
    for full, name in ((True, "full head"), (False, "last only")):
        wall = ", ".join(f"{w * 1e3:.0f}" for w, _ in runs[full])
        print(f"{name:10s} wall ms [{wall}]  median wall {med[full][0] * 1e3:.1f} ms  cpu {med[full][1] * 1e3:.1f} ms")
    print(f"full / last-only: wall {med[True][0] / med[False][0]:.3f}x  cpu {med[True][1] / med[False][1]:.3f}x")


if __name__ == "__main__":
    main()
