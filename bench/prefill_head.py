"""One-row prefill with the output head at the last position only, against the full head.

    python bench/prefill_head.py [--rounds 7] [--tokens 1000] [--step 2048] [--gdn-prefill native]

`Runtime(model, gdn_prefill=...).prefill` of a --tokens prompt on the shipped target, as it runs
(`Prefill.feed` forwards with `last_only=True`: adapters/head.py), and with
`Runtime.forward` made to ignore `last_only` (the full head over every position,
the path before), interleaved in each of --rounds rounds with the order
alternated. Prints the medians of wall and process CPU time and their ratios
(full / last-only: above 1 is faster), measured in the same run, and the median
of each round's own ratio.
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


def one(model, ids: list, step: int, gdn: str, full: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one cold prefill of `ids`."""
    forward = Runtime.forward
    if full:
        Runtime.forward = lambda self, tokens, last_only=False: forward(self, tokens)
    try:
        rt = Runtime(model, gdn_prefill=gdn)
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
    ap.add_argument("--gdn-prefill", default="native", help="the runtime's GDN prefill (native, chunked, auto)")
    args = ap.parse_args()
    model, _ = mlx_lm.load(str(MODELS_DIR / "target"))
    ids = [(7 * t + 3) % 5000 + 10 for t in range(args.tokens)]
    one(model, ids, args.step, args.gdn_prefill, False)  # warm-up: kernels, allocator
    one(model, ids, args.step, args.gdn_prefill, True)
    runs: dict[bool, list] = {False: [], True: []}
    for r in range(args.rounds):
        for full in ((False, True) if r % 2 == 0 else (True, False)):
            runs[full].append(one(model, ids, args.step, args.gdn_prefill, full))
    med = {full: [statistics.median(x[i] for x in runs[full]) for i in (0, 1)] for full in runs}
    for full, name in ((True, "full head"), (False, "last only")):
        wall = ", ".join(f"{w * 1e3:.0f}" for w, _ in runs[full])
        cpu = ", ".join(f"{c * 1e3:.0f}" for _, c in runs[full])
        print(f"{name:10s} wall ms [{wall}] cpu ms [{cpu}]")
        print(f"{'':10s} median wall {med[full][0] * 1e3:.1f} ms  cpu {med[full][1] * 1e3:.1f} ms")
    print(f"full / last-only: wall {med[True][0] / med[False][0]:.3f}x  cpu {med[True][1] / med[False][1]:.3f}x"
          f"  (median of the rounds' own ratios: wall {paired(runs, 0):.3f}x  cpu {paired(runs, 1):.3f}x)")


def paired(runs: dict, i: int) -> float:
    """The median over rounds of full / last-only in the same round (wall: i=0, CPU: i=1)."""
    return statistics.median(f[i] / o[i] for f, o in zip(runs[True], runs[False]))


if __name__ == "__main__":
    main()
