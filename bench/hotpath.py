"""Hot path: prefill and decode tokens/s through segcache vs mlx-lm's own cache.

Three sides, interleaved round by round on the same model and tokens:
  mlx-lm       model(x, cache=make_prompt_cache(model))
  rt.cache     model(x, cache=rt.cache)     (segcache layers, mlx-lm's call)
  rt.forward   rt.forward(ids)              (segcache's own entry point)

Each round builds a fresh cache per side and times a prefill of P tokens
(one call, as mlx-lm's generate does below its 2048-token prefill step); the
first rounds also time a decode of D tokens one at a time on that cache
(decode tokens/s from the median step of each round).
Every call evaluates the logits and the whole cache state. Prefills
interleave call by call and decode steps step by step, rotating the order,
so load from other processes hits all sides alike. Ratios are tokens/s of
segcache / tokens/s of mlx-lm, paired per round (median [min-max]), and the
same from the fastest sample of each side; target >= 1.00, never below 0.97.

Full: P=1024, D=128, 8 prefill and 2 decode rounds. --quick: P=512, D=32,
6 and 2 rounds. The segcache sides run Gated DeltaNet as mlx-lm does
(gdn_prefill="native"): this measures the runtime's overhead, not the chunked
prefill.

--gdn: the chunked Gated DeltaNet prefill instead (bench/gdn_prefill.py):
the recurrence alone and whole prefills at 512 and 4096 tokens (--long adds
16384), chunked vs native vs a llama of the same size; --crossover adds the
short-block timings behind CHUNKED_FROM.

    python bench/hotpath.py [--quick]
    python bench/hotpath.py --gdn [--long] [--crossover] [--repeats N]
"""

from __future__ import annotations

import _common as C  # noqa: I001  (first: binds OpenBLAS before mlx loads)

import gc
import statistics

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import segcache

TARGET, FLOOR = 1.00, 0.97


class Side:
    """One way of running the model: a fresh cache per round, then prefill and steps."""

    def __init__(self, model, new_cache=None, runtime: bool = False):
        self.model, self.new_cache, self.runtime = model, new_cache, runtime

    def reset(self) -> None:
        if self.runtime:
            self.rt = segcache.Runtime(self.model, gdn_prefill="native")
            self.cache = self.rt.cache
        else:
            self.cache = self.new_cache()

    def call(self, ids: list[int], x: mx.array):
        """Logits for `ids` (`x` is the same ids as a [1, S] array)."""
        if self.runtime:
            return self.rt.forward(ids)
        return self.model(x, cache=self.cache)

    def run(self, ids: list[int], x: mx.array):
        return lambda: [self.call(ids, x), *C.cache_arrays(self.cache)]


def sides(model, pristine) -> dict[str, Side]:
    """mlx-lm runs on `pristine`, a twin of `model` (same weights) that segcache
    never adapted, so its figures carry no segcache code at all."""
    return {
        "mlx-lm": Side(pristine, lambda: make_prompt_cache(pristine)),
        "rt.cache": Side(model, lambda: segcache.Runtime(model, gdn_prefill="native").cache),
        "rt.forward": Side(model, runtime=True),
    }


def measure(sides: dict[str, Side], prompt: list[int], steps: list[int], *, prefills: int, decodes: int):
    """Per side: Stats of prefill seconds, and of decode seconds (median step x steps).

    Round 0 is the warm-up of both phases; rounds 1..prefills time a prefill,
    and rounds 1..decodes also time a decode on the cache that prefill left.
    Prefills interleave call by call and decode steps step by step, rotating
    the order, so load from other processes lands on every side alike. A
    decode round interleaves hundreds of steps, so it needs fewer rounds than
    prefill (one call per side per round) to settle.
    """
    names = list(sides)
    x = mx.array(prompt, dtype=mx.uint32)[None]
    step_x = [mx.array([[t]], dtype=mx.uint32) for t in steps]
    pre = {n: C.Stats() for n in names}
    dec = {n: C.Stats() for n in names}
    for r in range(1 + max(prefills, decodes)):
        for side in sides.values():
            side.reset()
        for n in C.rotated(names, r):
            t = C.timed(sides[n].run(prompt, x))
            if 1 <= r <= prefills:
                pre[n].samples.append(t)
        if r > decodes:
            continue
        step_times = {n: [] for n in names}
        gc.collect()
        gc.disable()
        try:
            for i, (tok, sx) in enumerate(zip(steps, step_x)):
                for n in C.rotated(names, r + i):
                    step_times[n].append(C.timed(sides[n].run([tok], sx), collect=False))
        finally:
            gc.enable()
        if r >= 1:
            for n in names:
                # median step x D: a few steps stalled by another process
                # would otherwise decide a whole round
                dec[n].samples.append(statistics.median(step_times[n]) * len(steps))
    return pre, dec


def main() -> None:
    args = C.parse_args(__doc__, extra=[
        ("--gdn", "the chunked Gated DeltaNet prefill (bench/gdn_prefill.py)"),
        ("--long", "with --gdn: also 16384 tokens (native takes minutes)"),
        ("--crossover", "with --gdn: short-block timings behind CHUNKED_FROM"),
    ])
    if args.gdn:
        import gdn_prefill

        gdn_prefill.main(args.long, args.crossover, args.repeats)
        return
    n_prefill, n_decode = (512, 32) if args.quick else (1024, 128)
    prefills = args.repeats or (6 if args.quick else 8)
    decodes = max(1, prefills // 3)
    specs = {"dense": C.DENSE, "hybrid": C.HYBRID, "ssm-hybrid": C.SSM_HYBRID, "short-conv": C.SHORT_CONV}
    if args.models:
        specs = {role: specs[role] for role in args.models.split(",")}
    built = {role: C.build(spec) for role, spec in specs.items()}
    pristine = {role: C.build(spec)[0] for role, spec in specs.items()}
    C.header(
        f"hotpath: prefill {n_prefill} tokens x {prefills} rounds, decode {n_decode} tokens x {decodes} rounds "
        "(after 1 warm-up round; sides interleaved)",
        [(role, specs[role], params) for role, (_, params) in built.items()],
    )
    rows, worst = [], None
    for role, (model, _) in built.items():
        family, vocab = specs[role]["family"], specs[role]["vocab_size"]
        prompt = C.tokens(n_prefill, vocab, seed=1)
        steps = C.tokens(n_decode, vocab, seed=2)
        pre, dec = measure(sides(model, pristine[role]), prompt, steps, prefills=prefills, decodes=decodes)
        for phase, n, stats in (("prefill", n_prefill, pre), ("decode", n_decode, dec)):
            base = stats["mlx-lm"]
            for side in ("rt.cache", "rt.forward"):
                mine = stats[side]
                r = C.paired_ratio(base, mine)  # time ratio = tokens/s ratio
                worst = r if worst is None or r.median < worst.median else worst
                rows.append([
                    f"{role} ({family})", phase, side,
                    f"{n / base.median:.1f}", f"{n / mine.median:.1f}",
                    C.fmt_ratio(r), f"{C.min_ratio(base, mine):.3f}", f"{mine.spread() * 100:.0f}% / {base.spread() * 100:.0f}%",
                ])
        C.flush()
    print(C.table(rows, [
        "model", "phase", "segcache via", "mlx-lm tok/s", "segcache tok/s",
        "ratio median [min-max]", "best / best", "spread seg / mlx-lm",
    ]))
    print()
    if worst.median >= TARGET:
        verdict = f"meets the target {TARGET:.2f}"
    elif worst.median >= FLOOR:
        verdict = f"under the target {TARGET:.2f}, above the floor {FLOOR:.2f}"
    else:
        verdict = f"BELOW the floor {FLOOR:.2f}"
    print(f"lowest median ratio {worst.median:.3f}: {verdict}")
    print("ratio = tokens/s segcache / tokens/s mlx-lm, per interleaved round; best / best = the same from the")
    print("fastest sample of each side; spread = (max-min)/median of the times of segcache / mlx-lm")


if __name__ == "__main__":
    main()
