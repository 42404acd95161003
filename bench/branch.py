"""Branches: fork/clone cost against context length, speculative rounds, memory.

1. fork() + the first forward step, and clone() + its first step, at growing
   context, against copy.deepcopy of mlx-lm's cache + its first step and a
   plain mlx-lm step. deepcopy itself is instant (MLX shares the data); the
   copy of every KV buffer happens at the first write. Target: fork + step
   costs what a plain step costs, at every context length (flat).
2. A speculative round, fork + verify forward of width w + commit(n), on the
   hybrid model for both recurrent strategies, / the verify forward alone on
   mlx-lm's cache (target <= 1.05). The round evaluates the logits before it
   commits, as a real round must read them to choose n.
3. The memory the branch machinery adds: peak during a round above the plain
   verify forward's peak, and the bytes a branch keeps per drafted token.
4. Which recurrent strategy the figures favour on this backend.

Every round of part 2 runs inside an outer branch that is rolled back
(untimed) before the next one, so each starts from the same context through
the public API; a commit(n) in a nested branch does the same work as at the
top level (the replay or the state pick, the conv tail slice).

    python bench/branch.py [--quick]
"""

from __future__ import annotations

import _common as C  # noqa: I001  (first: binds OpenBLAS before mlx loads)

import copy
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

import segcache
from segcache.runtime import default_recurrent_strategy

STRATEGIES = ("replay", "states")
ROUND_TARGET = 1.05
NOISE = 0.02  # differences of mean round ratios below this are within this machine's noise


# -- 1. fork / clone against context length ----------------------------------------


def fork_vs_context(model, vocab: int, contexts: list[int], warmup: int, repeats: int) -> list[list[str]]:
    rt = segcache.Runtime(model)
    native = make_prompt_cache(model)
    step = mx.array([[7]], dtype=mx.uint32)
    kept: dict[str, object] = {}  # the last clone / copy, dropped untimed before the next sample
    rows = []
    done = 0

    def reset() -> None:
        kept.clear()
        while rt.depth:
            rt.rollback()
        for c in native:  # undo the mlx-lm step (KVCache trims in O(1))
            c.trim(c.offset - done)

    def fork_step():
        reset()

        def run():
            rt.fork()
            return [rt.forward([7]), *C.cache_arrays(rt.cache)]

        return run

    def clone_step():
        reset()

        def run():
            kept["clone"] = other = rt.clone()
            return [other.forward([7]), *C.cache_arrays(other.cache)]

        return run

    def plain_step():
        reset()
        return lambda: [model(step, cache=native), *C.cache_arrays(native)]

    def deepcopy_step():
        reset()

        def run():
            kept["copy"] = dup = copy.deepcopy(native)
            return [model(step, cache=dup), *C.cache_arrays(dup)]

        return run

    sides = {"fork+step": fork_step, "clone+step": clone_step,
             "mlx-lm step": plain_step, "deepcopy+step": deepcopy_step}
    for context in contexts:
        t0 = time.perf_counter()
        more = C.tokens(context - done, vocab, seed=context)
        C.prefill(model, rt.cache, more)
        C.prefill(model, native, more)
        done = context
        filled = time.perf_counter() - t0
        stats = C.interleave(sides, warmup=warmup, repeats=repeats)
        fork_alone = C.Stats()
        for _ in range(repeats):
            reset()
            t = time.perf_counter()
            rt.fork()
            fork_alone.samples.append(time.perf_counter() - t)
        copy_alone = C.Stats()
        for _ in range(repeats):
            reset()
            t = time.perf_counter()
            kept["copy"] = copy.deepcopy(native)
            copy_alone.samples.append(time.perf_counter() - t)
        peaks = {name: C.peak_of(setup)[0] for name, setup in sides.items()}
        reset()
        base = stats["mlx-lm step"]
        rows.append([
            f"{context:,}", f"{fork_alone.median * 1e6:.0f} us",
            stats["fork+step"].ms(), stats["clone+step"].ms(), base.ms(), stats["deepcopy+step"].ms(),
            C.fmt_ratio(C.paired_ratio(stats["fork+step"], base)),
            f"{C.min_ratio(stats['fork+step'], base):.3f}",
            f"{C.mib(peaks['fork+step'])} / {C.mib(peaks['mlx-lm step'])}",
            f"{C.mib(peaks['clone+step'])} / {C.mib(peaks['deepcopy+step'])}",
        ])
        print(f"  context {context:,}: prefilled both caches in {filled:.1f} s; "
              f"deepcopy alone {copy_alone.median * 1e6:.0f} us", flush=True)
    return rows


# -- 2/3. speculative rounds on the hybrid model ----------------------------------------


class Rounds:
    """One runtime per strategy and an mlx-lm cache, all at the same context."""

    def __init__(self, model, pristine, prompt: list[int]):
        self.model, self.pristine = model, pristine
        self.rts = {s: segcache.Runtime(model, recurrent_strategy=s) for s in STRATEGIES}
        for rt in self.rts.values():
            C.prefill(model, rt.cache, prompt)
        self.native = make_prompt_cache(pristine)
        C.prefill(pristine, self.native, prompt)
        self.context = len(prompt)
        # Recurrent slots are replaced, never written in place, by a forward,
        # so keeping these references is a free snapshot to restore from.
        self.saved = [list(c.cache) if isinstance(c, ArraysCache) else None for c in self.native]

    def restore_native(self) -> None:
        for c, saved in zip(self.native, self.saved):
            if saved is None:
                c.trim(c.offset - self.context)
            else:
                c.cache = list(saved)

    def restore(self, rt) -> None:
        while rt.depth:
            rt.rollback()
        rt.fork()  # the outer branch each round runs in

    def verify(self, draft: list[int]):
        """setup() of the plain verify forward on mlx-lm's cache."""
        x = mx.array(draft, dtype=mx.uint32)[None]

        def setup():
            self.restore_native()
            return lambda: [self.pristine(x, cache=self.native), *C.cache_arrays(self.native)]

        return setup

    def round(self, strategy: str, draft: list[int], n: int, commit_times: list | None = None):
        """setup() of fork + verify forward + eval logits + commit(n) + eval cache.

        commit_times, if given, collects the seconds of commit(n) plus the
        eval of the state it leaves: the part of the round a plain verify
        forward does not have, timed apart from the noisy forward.
        """
        rt = self.rts[strategy]

        def setup():
            self.restore(rt)

            def run():
                rt.fork()
                mx.eval(rt.forward(draft))  # the round reads the logits to choose n
                start = time.perf_counter()
                rt.commit(n)
                mx.eval(C.cache_arrays(rt.cache))
                if commit_times is not None:
                    commit_times.append(time.perf_counter() - start)
                return []

            return run

        return setup

    def forward_only(self, strategy: str, draft: list[int]):
        """setup() of fork + verify forward, left open: what a branch keeps before commit."""
        rt = self.rts[strategy]

        def setup():
            self.restore(rt)

            def run():
                rt.fork()
                return [*C.cache_arrays(rt.cache), rt.forward(draft)]

            return run

        return setup

    def close(self) -> None:
        for rt in self.rts.values():
            while rt.depth:
                rt.rollback()
        self.restore_native()


def accepts(width: int) -> list[int]:
    return sorted({0, width // 2, width})


def speculative(rounds: Rounds, vocab: int, widths: list[int], warmup: int, repeats: int):
    """Round cost ratios and memory per (width, strategy, n)."""
    cost_rows, mem_rows, ratios = [], [], {s: [] for s in STRATEGIES}
    commit_ms = {s: [] for s in STRATEGIES}
    per_token = {s: [] for s in STRATEGIES}
    for w in widths:
        draft = C.tokens(w, vocab, seed=100 + w)
        sides = {"verify": rounds.verify(draft)}
        commits = {}
        for s in STRATEGIES:
            for n in accepts(w):
                commits[s, n] = []
                sides[f"{s} n={n}"] = rounds.round(s, draft, n, commits[s, n])
        stats = C.interleave(sides, warmup=warmup, repeats=repeats)
        base = stats["verify"]
        for s in STRATEGIES:
            for n in accepts(w):
                mine = stats[f"{s} n={n}"]
                r = C.paired_ratio(mine, base)
                ratios[s].append(r.median)
                commit = statistics.median(commits[s, n][warmup:])
                commit_ms[s].append(commit * 1e3)
                cost_rows.append([
                    str(w), s, str(n), base.ms(), mine.ms(), C.fmt_ratio(r),
                    f"{C.min_ratio(mine, base):.3f}", f"{commit * 1e3:.2f}",
                ])
        # memory: one sample each, after the timing warmed every buffer up
        verify_peak, verify_kept = C.peak_of(rounds.verify(draft))
        for s in STRATEGIES:
            round_peaks = [C.peak_of(rounds.round(s, draft, n))[0] for n in accepts(w)]
            _, open_kept = C.peak_of(rounds.forward_only(s, draft))
            extra = open_kept - verify_kept
            per_token[s].append(extra / w)
            mem_rows.append([
                str(w), s, C.mib(verify_peak), C.mib(max(round_peaks)),
                C.mib(max(round_peaks) - verify_peak), C.mib(extra), f"{extra / w / 1024:.1f} KiB",
            ])
        print(f"  width {w}: done", flush=True)
    rounds.close()
    return cost_rows, mem_rows, ratios, per_token, commit_ms


def main() -> None:
    args = C.parse_args(__doc__)
    quick = args.quick
    contexts = [256, 1024, 4096] if quick else [256, 1024, 4096, 16384]
    widths = [2, 4, 6]
    fork_repeats = args.repeats or (15 if quick else 30)
    round_repeats = args.repeats or (10 if quick else 30)
    round_context = 256 if quick else 512

    # --models ssm-hybrid / short-conv: parts 2-4 on that model (part 1 is kind-independent, skipped)
    hybrid_spec = {"hybrid": C.HYBRID, "ssm-hybrid": C.SSM_HYBRID, "short-conv": C.SHORT_CONV}[args.models or "hybrid"]
    long_model, long_params = C.build(C.LONG_CONTEXT)
    hybrid, hybrid_params = C.build(hybrid_spec)
    pristine, _ = C.build(hybrid_spec)
    C.header("branch: fork / clone vs context, speculative rounds, branch memory", [
        ("long-context (part 1)", C.LONG_CONTEXT, long_params),
        (f"{args.models or 'hybrid'} (parts 2-3)", hybrid_spec, hybrid_params),
    ])

    if args.models:
        contexts = []
    print(f"## 1. fork / clone + first step vs context ({C.LONG_CONTEXT['family']}, "
          f"prefill in chunks of 512, 2 warm-up + {fork_repeats} interleaved rounds; ms median [min-max])")
    rows = fork_vs_context(long_model, C.LONG_CONTEXT["vocab_size"], contexts, warmup=2, repeats=fork_repeats)
    print()
    print(C.table(rows, [
        "context", "fork() alone", "fork+step", "clone+step", "mlx-lm step", "deepcopy+step",
        "fork+step / mlx-lm step", "min / min", "peak fork+step / mlx-lm step", "peak clone+step / deepcopy+step",
    ]))
    print()

    vocab = hybrid_spec["vocab_size"]
    print(f"## 2. speculative round cost (hybrid, context {round_context}, "
          f"3 warm-up + {round_repeats} interleaved rounds)")
    print("round = fork + verify forward of width w + eval logits + commit(n) + eval cache; "
          "ratio = round / verify forward alone on mlx-lm's cache, paired per round, median [min-max]")
    rounds = Rounds(hybrid, pristine, C.tokens(round_context, vocab, seed=5))
    cost_rows, mem_rows, ratios, per_token, commit_ms = speculative(rounds, vocab, widths, warmup=3, repeats=round_repeats)
    print()
    print(C.table(cost_rows, [
        "w", "strategy", "n", "verify alone (ms)", "round (ms)", "round / verify", "min / min", "commit (ms)",
    ]))
    print("commit = median ms of commit(n) + the eval of the state it leaves, inside the round")
    print()

    print("## 3. memory the branch machinery adds (hybrid; one sample each, after warm-up)")
    print("kept = active bytes a branch holds after its verify forward (before commit) "
          "minus what the plain verify forward leaves")
    print(C.table(mem_rows, [
        "w", "strategy", "peak verify alone", "peak round (max over n)", "peak added",
        "kept by open branch", "kept per drafted token",
    ]))
    print()

    print("## 4. recommendation")
    worst = {s: max(ratios[s]) for s in STRATEGIES}
    mean = {s: statistics.mean(ratios[s]) for s in STRATEGIES}
    commit = {s: statistics.mean(commit_ms[s]) for s in STRATEGIES}
    kib = {s: statistics.mean(per_token[s]) / 1024 for s in STRATEGIES}
    for s in STRATEGIES:
        verdict = "meets" if worst[s] <= ROUND_TARGET else "MISSES"
        print(f"  {s:7s}: round / verify mean {mean[s]:.3f}, worst {worst[s]:.3f} ({verdict} <= {ROUND_TARGET}); "
              f"commit {commit[s]:.2f} ms on average; {kib[s]:.1f} KiB kept per drafted token")
    # The strategies run the same forward on the CPU (a per-token loop either
    # way); they differ in what commit does. Round ratios closer than the
    # noise of this machine are a tie, which the commit cost then breaks.
    faster = min(STRATEGIES, key=lambda s: mean[s])
    other = [s for s in STRATEGIES if s != faster][0]
    tie = mean[other] - mean[faster] < NOISE
    if tie:
        faster, other = sorted(STRATEGIES, key=lambda s: commit[s])
    how = (f"round ratios within {NOISE:.2f} (a tie on this machine); commit {commit[faster]:.2f} vs "
           f"{commit[other]:.2f} ms decides" if tie else
           f"mean round ratio {mean[faster]:.3f} vs {mean[other]:.3f}")
    picked = default_recurrent_strategy()
    device = "Metal" if mx.default_device() == mx.gpu and mx.metal.is_available() else "CPU"
    agrees = "support" if picked == faster else "do NOT support"
    print(f"recommendation on {device}: '{faster}' ({how}; it keeps {kib[faster]:.0f} KiB per drafted token "
          f"against {kib[other]:.0f}); default_recurrent_strategy() picks '{picked}': the figures {agrees} it")


if __name__ == "__main__":
    main()
