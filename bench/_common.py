"""Shared pieces of the benchmarks: header, models, timing, memory.

Import this module before anything that imports mlx: it imports segcache
first, which binds the system OpenBLAS ahead of the mlx[cpu] wheel's
reference BLAS (segcache.BLAS says which one is active).

Timing rules (the machine is shared and noisy):
  * MLX is lazy, so every timed call evaluates its outputs AND the cache
    state it leaves behind; otherwise work leaks into the next sample.
  * Sides that are compared run interleaved (A B C, then B C A, ...) so
    that load from other processes hits every side alike.
  * Each figure is the median of N repeats after warm-up, with min and max.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import segcache  # noqa: I001  (first: binds OpenBLAS before mlx loads)

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from segcache.testing import models
from segcache.testing.widen import WIDEN_VERSION, quantize_target, weights_digest, widen_target

# ~32M-parameter dense model and a hybrid of similar size (3 Gated DeltaNet
# layers per full-attention layer, as Qwen3.5 does). Head dims are 64 so the
# shapes look like a real model's, scaled down.
DENSE = dict(
    family="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
    num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
)
HYBRID = dict(
    family="qwen3_5", hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8192,
    linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, full_attention_interval=4,
)
# An SSM hybrid (Mamba-2 mixers, 3 per attention layer, as Granite 4.0-H
# interleaves them) and a short-conv hybrid (LFM2: 3 conv layers per
# attention layer), of similar size (issue 12).
SSM_HYBRID = dict(
    family="granitemoehybrid", hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
    shared_intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
    layer_types=["mamba", "mamba", "mamba", "attention"] * 2, mamba_n_heads=16, mamba_d_head=64,
    mamba_d_state=64, mamba_d_conv=4, mamba_n_groups=1, attention_multiplier=0.125,
)
SHORT_CONV = dict(
    family="lfm2", hidden_size=512, num_hidden_layers=8, block_dim=512, block_ff_dim=1408,
    num_attention_heads=8, num_key_value_heads=4, vocab_size=8192, full_attn_idxs=[3, 7],
)
# Few layers and a small vocabulary, so a 16k-token prompt prefills in seconds.
# KV of 64 MiB at 16k tokens: the copy a deepcopy defers to the first write.
LONG_CONTEXT = dict(
    family="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
    num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
)


def build(spec: dict):
    """(model, parameter count) for one of the specs above (seed 0: same spec, same weights)."""
    spec = dict(spec)
    family = spec.pop("family")
    model = models.build(family, seed=0, **spec)
    return model, sum(v.size for _, v in tree_flatten(model.parameters()))


def parse_args(doc: str, extra: list[tuple[str, str]] = ()) -> argparse.Namespace:
    """--quick, --repeats N, and the boolean flags `extra` names: (flag, help)."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (~1-2 min)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per figure")
    parser.add_argument("--models", default=None, help="comma-separated model roles to run (default: the bench's own)")
    for flag, help in extra:
        parser.add_argument(flag, action="store_true", help=help)
    return parser.parse_args()


def header(title: str, sized_models: list[tuple[str, dict, int]]) -> None:
    """Print what the figures were measured on."""
    print(f"# {title}")
    print(f"segcache {segcache.__version__} | mlx {mx.__version__} | mlx-lm {mlx_lm.__version__} "
          f"| python {platform.python_version()}")
    print(f"device: {mx.default_device()} | metal: {mx.metal.is_available()} | "
          f"{platform.machine()} {platform.system()} | cpus: {os.cpu_count()} | "
          f"load avg: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"BLAS: {segcache.BLAS}")
    for role, spec, params in sized_models:
        shape = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "family")
        print(f"model {role}: {spec['family']}, {params / 1e6:.1f}M params, fp32 ({shape})")
    print()


# -- cache state ---------------------------------------------------------------


def cache_arrays(cache) -> list:
    """Every array a prompt cache holds (KV buffers, conv tails, states).

    Reads the buffers themselves, not `c.state`, which may slice them: a slice
    kept alive would make the next in-place write copy the whole buffer.
    """
    out = []
    for c in cache:
        if getattr(c, "keys", None) is not None:
            out += [c.keys, c.values]
        inner = getattr(c, "cache", None)
        if isinstance(inner, list):
            out += [a for a in inner if a is not None]
    return out


def prefill(model, cache, tokens: list[int], chunk: int = 512) -> None:
    """Feed `tokens` in chunks with an eval between, as mlx-lm's generate does."""
    for i in range(0, len(tokens), chunk):
        model(mx.array(tokens[i : i + chunk], dtype=mx.uint32)[None], cache=cache)
        mx.eval(cache_arrays(cache))


def tokens(n: int, vocab: int, seed: int = 1) -> list[int]:
    key = mx.random.key(seed)
    return mx.random.randint(0, vocab, (n,), key=key).tolist()


# -- timing --------------------------------------------------------------------


@dataclass
class Stats:
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def lo(self) -> float:
        return min(self.samples)

    @property
    def hi(self) -> float:
        return max(self.samples)

    def ms(self) -> str:
        """'median [min-max] ms'."""
        return f"{self.median * 1e3:.2f} [{self.lo * 1e3:.2f}-{self.hi * 1e3:.2f}]"

    def spread(self) -> float:
        """(max - min) / median."""
        return (self.hi - self.lo) / self.median if self.samples else 0.0


def timed(run: Callable[[], list], *, collect: bool = True) -> float:
    """Seconds for `run()` plus the eval of the arrays it returns.

    The garbage collector is off while the clock runs (and first run to
    completion, unless collect=False for callers timing many short steps
    inside a block where they turned it off themselves).
    """
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        mx.eval(run())
        return time.perf_counter() - start
    finally:
        if was_enabled:
            gc.enable()


def rotated(names: list, r: int) -> list:
    """`names` starting at index r mod len: round r runs side r first."""
    k = r % len(names)
    return names[k:] + names[:k]


def interleave(
    sides: dict[str, Callable[[], object]],
    *,
    warmup: int,
    repeats: int,
) -> dict[str, Stats]:
    """Time several sides interleaved; return Stats per side (and phase).

    Args:
        sides: name -> setup(). setup() prepares one sample untimed and returns
            either run() or a dict phase -> run() timed in order (for instance
            prefill, then decode on the cache the prefill left). Each run is
            timed together with the eval of the arrays it returns (its outputs
            and the cache state).
        warmup: untimed rounds first.
        repeats: timed rounds; round r starts at side r (rotation), so no side
            always runs first or right after the same other side.

    Returns:
        name -> Stats, or "name/phase" -> Stats where setup returned phases.
    """
    names = list(sides)
    stats: dict[str, Stats] = {}
    for r in range(warmup + repeats):
        for name in rotated(names, r):
            runs = sides[name]()
            phases = runs.items() if isinstance(runs, dict) else [(None, runs)]
            for phase, run in phases:
                t = timed(run)
                if r >= warmup:
                    stats.setdefault(name if phase is None else f"{name}/{phase}", Stats()).samples.append(t)
            del runs, phases
    return stats


def paired_ratio(num: Stats, den: Stats) -> Stats:
    """Per-round ratios num/den of interleaved samples (round i against round i).

    Pairing cancels slow drifts in machine load that hit both sides of a round.
    """
    return Stats([a / b for a, b in zip(num.samples, den.samples)])


def min_ratio(num: Stats, den: Stats) -> float:
    """Ratio of the fastest samples: load from other processes only ever adds
    time, so on a busy machine the minimum is the steadiest estimate of a cost."""
    return num.lo / den.lo


def fmt_ratio(r: Stats) -> str:
    """'median [min-max]' of a ratio."""
    return f"{r.median:.3f} [{r.lo:.3f}-{r.hi:.3f}]"


# -- memory ----------------------------------------------------------------------


def reset_peak() -> int:
    """Reset the peak counter; return the active bytes now (after freeing garbage)."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def peak_since(base: int) -> int:
    """Peak bytes above `base` since the last reset_peak()."""
    return mx.get_peak_memory() - base


def active() -> int:
    gc.collect()
    return mx.get_active_memory()


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def table(rows: list[list[str]], head: list[str]) -> str:
    """A GitHub-flavoured markdown table."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(out + [line(r) for r in rows])


def flush() -> None:
    sys.stdout.flush()


def peak_of(setup: Callable[[], Callable[[], list]]) -> tuple[int, int]:
    """(peak bytes above the start, active bytes kept after) for one sample.

    setup() runs untimed and returns run(); the peak counts everything run()
    and the eval of its arrays allocate; the kept figure drops the returned
    arrays first, so it is what the caches retain.
    """
    run = setup()
    base = reset_peak()
    mx.eval(run())
    peak = peak_since(base)
    return peak, active() - base


# -- the speculative benches' target ---------------------------------------------

MODELS_DIR = Path(segcache.__file__).resolve().parent / "models"
CACHE_DIR = Path(__file__).resolve().parent / ".cache"  # gitignored: built, never committed
TARGETS = ("shipped", "wide")


def add_target_args(parser: argparse.ArgumentParser, *, directories: bool = False) -> None:
    """--target shipped|wide (or a model directory, where `directories`), --wide-layers, --wide-mlp,
    --wide-bits: which target a speculative bench runs on (default: the shipped one, as before)."""
    more = " or a model directory" if directories else ""
    parser.add_argument("--target", default="shipped", choices=None if directories else TARGETS,
                        help=f"the target: shipped (models/target), wide (the same function at a large model's "
                             f"cost: segcache.testing.widen, built once into bench/.cache){more}")
    parser.add_argument("--wide-layers", type=int, default=16, help="--target wide: decoder layers (default 16)")
    parser.add_argument("--wide-mlp", type=int, default=12288, help="--target wide: MLP width (default 12288)")
    parser.add_argument("--wide-bits", type=int, default=0, help="--target wide: quantize to these bits (0: float32)")


def target_dir(args: argparse.Namespace) -> Path:
    """The model directory `add_target_args`' flags name (the wide target built on first use)."""
    if args.target == "shipped":
        return MODELS_DIR / "target"
    if args.target == "wide":
        return wide_target(args.wide_layers, args.wide_mlp, bits=args.wide_bits)
    return Path(args.target)


def target_label(args: argparse.Namespace) -> str:
    """What the output calls the target."""
    if args.target == "wide":
        q = f", {args.wide_bits}-bit" if args.wide_bits else ""
        return f"wide ({args.wide_layers} layers, MLP {args.wide_mlp}{q}; the shipped target's function)"
    return "shipped (models/target)" if args.target == "shipped" else str(args.target)


def wide_target(layers: int = 16, mlp: int = 12288, *, seed: int = 0, bits: int = 0) -> Path:
    """The shipped target widened (and quantized to `bits`, 0: not), built once into bench/.cache/.

    The folder is keyed by the options, the builder's version and the shipped weights' hash, so a
    retrained target or another builder builds anew. Built aside and renamed into place, so two
    benches starting at once never read a half-written one.
    """
    source = MODELS_DIR / "target"
    key = hashlib.sha256(f"{weights_digest(source)}|{layers}|{mlp}|{seed}|v{WIDEN_VERSION}".encode()).hexdigest()[:12]
    name = f"wide-L{layers}-I{mlp}-s{seed}-{key}"
    out = CACHE_DIR / name
    if not (out / "config.json").is_file():
        print(f"building the wide target ({layers} layers, MLP {mlp}) into {out}", flush=True)
        _built_into(out, lambda tmp: widen_target(source, tmp, layers=layers, intermediate_size=mlp, seed=seed))
    if not bits:
        return out
    quantized = CACHE_DIR / f"{name}-q{bits}"
    if not (quantized / "config.json").is_file():
        print(f"quantizing it to {bits} bits into {quantized}", flush=True)
        _built_into(quantized, lambda tmp: quantize_target(out, tmp, bits=bits))
    return quantized


def _built_into(out: Path, build: Callable[[Path], Path]) -> None:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=CACHE_DIR))
    try:
        build(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another bench built it meanwhile: keep theirs
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- c(k): what a verify of k positions costs ------------------------------------

VERIFY_WIDTHS = (2, 4, 8, 16)


@dataclass
class VerifyCosts:
    """c(k) = a forward of k positions / a one-token forward, by the wall clock and by CPU time."""

    wall: dict[int, float]
    cpu: dict[int, float]
    one_wall_s: float
    one_cpu_s: float
    context: int
    repeats: int


def verify_costs(model, context: list[int], widths=VERIFY_WIDTHS, repeats: int = 7) -> VerifyCosts:
    """c(k) of `model` after a prefill of `context`, on mlx-lm's own cache (no segcache runtime).

    Each sample is one forward of k positions (all k positions' logits, as a verify computes)
    evaluated with the cache state it leaves, then rolled back: KV offsets trimmed, recurrent
    states put back (mlx arrays are values, so the saved ones are intact). The widths are
    interleaved, the order rotated per repeat; figures are medians over the one-token median.
    """
    cache = make_prompt_cache(model)
    prefill(model, cache, context)
    sizes = [1, *[k for k in widths if k != 1]]
    feed = [context[-1]] * max(sizes)  # what the tokens are does not change the cost

    def once(k: int) -> tuple[float, float]:
        marks = [c.offset if c.is_trimmable() else list(c.cache) for c in cache]
        gc.disable()
        wall, cpu = time.perf_counter(), time.process_time()
        mx.eval(model(mx.array(feed[:k], dtype=mx.uint32)[None], cache=cache), cache_arrays(cache))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        gc.enable()
        for c, mark in zip(cache, marks):
            if c.is_trimmable():
                c.trim(c.offset - mark)
            else:
                c.cache = mark
        return wall, cpu

    for k in sizes:  # warm-up: kernels, and the KV buffers grown once to the widest
        once(k)
    samples: dict[int, list] = {k: [] for k in sizes}
    for r in range(repeats):
        for k in rotated(sizes, r):
            samples[k].append(once(k))
    wall = {k: statistics.median(s[0] for s in samples[k]) for k in sizes}
    cpu = {k: statistics.median(s[1] for s in samples[k]) for k in sizes}
    return VerifyCosts({k: wall[k] / wall[1] for k in sizes}, {k: cpu[k] / cpu[1] for k in sizes},
                       wall[1], cpu[1], len(context), repeats)


def print_verify_costs(model, context: list[int], label: str, repeats: int = 7) -> VerifyCosts:
    """Measure and print c(k) for the target a bench runs on."""
    costs = verify_costs(model, context, repeats=repeats)
    widths = list(costs.wall)
    print(f"c(k) of the target, {label}: a forward of k positions / a one-token forward "
          f"(mlx-lm's cache after {costs.context} tokens; medians of {costs.repeats})")
    print("  k     " + "".join(f"{k:>7}" for k in widths))
    print("  wall  " + "".join(f"{costs.wall[k]:>7.2f}" for k in widths))
    print("  cpu   " + "".join(f"{costs.cpu[k]:>7.2f}" for k in widths))
    print(f"  one-token forward: {costs.one_wall_s * 1e3:.2f} ms wall, {costs.one_cpu_s * 1e3:.2f} ms CPU", flush=True)
    return costs
