"""Tree speculation vs chains (issue 31, docs/tree.md): prompt lookup, a draft model and the MTP head, one row, held-out code.

On the shipped hybrid demo target (Gated DeltaNet + attention), its draft and
its MTP head, for held-out code prompts (mlx-lm's sources, outside the training
corpus):

  * verify cost: a forward of N positions (a chain, and a tree of N nodes) in a
    branch, in one-token forwards (c(N) = time(N) / time(1)), medians of ratios
    to a one-token forward timed next to each sample;
  * tokens per round of chains and of trees of 4, 8, 12, 16 draft nodes, per
    drafter, ungated (every round drafts, the width adapting as
    `stream_generate`'s) and gated (the decoder's cost gate choosing the
    width, the tree's depth): one untimed pass (the figure is deterministic),
    every output checked token for token against plain greedy;
  * end-to-end decode tok/s of plain greedy, each drafter's chain and its best
    tree (most tokens per round), ungated and gated (the cost gate choosing
    the width, the tree gate choosing trees or chains: batch/tree_gate.py),
    timed interleaved in one run; per prompt, gated tree against gated chain;
  * the cost model: per drafter, the best tree's tokens per round and seconds
    per round against its chain's (ungated), so end to end = tokens ratio /
    seconds ratio, and the tokens-per-round gain a 1.15x needs at that cost.

    python bench/tree.py [--quick] [--repeats N] [--max-tokens N] [--prompts N]
                         [--num-draft-tokens K] [--nodes 4,8,12,16] [--drafters lookup,draft,mtp]
                         [--target shipped|wide [--wide-layers 16] [--wide-mlp 12288] [--wide-bits 4]]

`--target wide`: the same on the shipped target widened (segcache.testing.widen: its function and
head, at a ~155M model's cost; built once into bench/.cache); the c(k) of mlx-lm's own cache is
printed first for whichever target runs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402  (imports segcache first)
    Stats, add_target_args, fmt_ratio, header, paired_ratio, print_verify_costs, rotated, table, target_dir,
    target_label,
)

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import segcache  # noqa: E402
from segcache import Runtime  # noqa: E402
from segcache.drafters import make_decoder  # noqa: E402
from segcache.mtp import load_head  # noqa: E402

MODELS_DIR = Path(segcache.__file__).resolve().parent / "models"


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from heldout_other.txt, each ending at a `def`/`class`
    line, spread over the file (as bench/speculative.py picks them, longer)."""
    lines = (MODELS_DIR / "heldout_other.txt").read_text().split("\n")
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
    picks = starts[len(starts) // (2 * count) :: max(1, len(starts) // count)][:count]
    return [tokenizer.encode("\n".join(lines[max(0, i - 120) : i + 1]))[-length:] for i in picks]


SHAPES = [0, 0]  # speculative rounds the tree gates ran as chains and as trees (gated tree sides)


def decode(model, prompt: list[int], max_tokens: int, *, k: int = 0, nodes: int = 0, gate: bool = False,
           draft=None, mtp=None):
    """One generation on the decoder, timed from after the prefill(s): (tokens, rounds, seconds, CPU seconds)."""
    rt = Runtime(model)
    rt.forward(prompt[:-1])
    mx.eval([layer.state for layer in rt.cache])
    drt = None
    if draft is not None:
        drt = Runtime(draft)
        drt.forward(prompt[:-1])
        mx.eval([layer.state for layer in drt.cache])
    decoder = make_decoder(model, num_draft_tokens=k, draft_model=draft, mtp=mtp if k else None, draft_tree=nodes,
                           one_row=True, gate=gate)
    decoder.add(0, rt, prompt[-1], max_tokens=max_tokens, draft_runtime=drt)
    gate = decoder.trees  # the model's tree gate (kept for the process): its rounds of each shape, counted
    before = dict(gate.rounds) if gate is not None else {}
    out = []
    tic, cpu = time.perf_counter(), time.process_time()
    while not decoder.rows[0].finished:
        out += [t for t, _, _ in decoder.step()[0]]
    seconds, cpu = time.perf_counter() - tic, time.process_time() - cpu
    if gate is not None:
        SHAPES[0] += gate.rounds[0] - before[0]
        SHAPES[1] += gate.rounds[gate.budget] - before[gate.budget]
    return out, decoder.rows[0].stats.rounds, seconds, cpu


def verify_costs(model, prompt: list[int], sizes: list[int], repeats: int) -> dict:
    """{N: (chain c(N), tree c(N))}: forwards of N positions in a branch, in one-token forwards:
    each sample timed next to a one-token forward (round robin over the shapes), the median of
    those paired ratios (a loaded machine moves both alike)."""
    rt = Runtime(model)
    rt.forward(prompt)
    mx.eval([layer.state for layer in rt.cache])
    rng = random.Random(0)

    def timed_forward(tokens, parents=None):
        branch = rt.fork()
        tic = time.perf_counter()
        out = rt.forward(tokens) if parents is None else rt.forward_tree(tokens, parents)
        mx.eval(out, [layer.state for layer in rt.cache])
        seconds = time.perf_counter() - tic
        branch.rollback()
        return seconds

    shapes = {}
    for n in sizes:
        tokens = [rng.randrange(64) for _ in range(n)]
        parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]  # bushy, a few deep
        shapes[n] = (tokens, parents)
    ratios = {(n, kind): [] for n in sizes for kind in ("chain", "tree")}
    for r in range(repeats + 1):
        for n, (tokens, parents) in shapes.items():
            for kind in ("chain", "tree"):
                one = timed_forward(prompt[-1:])
                t = timed_forward(tokens, parents if kind == "tree" and n > 1 else None)
                if r:
                    ratios[n, kind].append(t / one)
    return {n: (statistics.median(ratios[n, "chain"]), statistics.median(ratios[n, "tree"])) for n in sizes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, 48 tokens, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None, help="held-out prompts")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="the chain's (and the trees' depth) K")
    parser.add_argument("--nodes", default="4,8,12,16", help="tree budgets (draft nodes per round)")
    parser.add_argument("--drafters", default="lookup,draft,mtp", help="of lookup, draft (the draft model), mtp")
    add_target_args(parser)
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)
    max_tokens = args.max_tokens or (48 if args.quick else 128)
    count = args.prompts or (2 if args.quick else 4)
    budgets = [int(x) for x in args.nodes.split(",")]
    k = args.num_draft_tokens

    target = target_dir(args)
    model, tokenizer = mlx_lm.load(str(target))
    draft, _ = mlx_lm.load(str(MODELS_DIR / "draft"))
    head = load_head(model, target)
    params = lambda m: sum(v.size for _, v in tree_flatten(m.parameters()))  # noqa: E731
    header("tree speculation: chains vs trees, prompt lookup, a draft model and the MTP head, one row, held-out code",
           [("target", {"family": f"qwen3_5 (demo, {target_label(args)})"}, params(model)),
            ("draft", {"family": "llama (demo)"}, params(draft))])
    prompts = heldout_prompts(tokenizer, count, args.prompt_tokens)
    print(f"{count} prompts of {args.prompt_tokens} tokens, max_tokens {max_tokens}, K {k}, repeats {repeats} "
          "(+1 warm-up); medians; the machine is shared (2 cores), ratios are paired per round\n")
    print_verify_costs(model, prompts[0], target_label(args))
    print()

    costs = verify_costs(model, prompts[0], sorted({1, 2, 4, 5, 8, 9, 12, 13, 16, 17}), max(5, repeats * 3))
    print(table([[str(n), f"{c:.2f}", f"{t:.2f}", f"{t / c:.2f}"] for n, (c, t) in costs.items()],
                ["N positions", "c(N) chain", "c(N) tree", "tree / chain"]))
    print()

    every = {"lookup": {}, "draft model": {"draft": draft}, "mtp": {"mtp": head}}
    short = {"lookup": "lookup", "draft": "draft model", "mtp": "mtp"}
    drafters = {short[d]: every[short[d]] for d in args.drafters.split(",")}
    expected = [decode(model, p, max_tokens)[0] for p in prompts]
    n = sum(len(e) for e in expected)
    per_round, identical, best = {}, {}, {}
    for drafter, extra in drafters.items():  # untimed: tokens per round is deterministic ungated
        for gate in (False, True):
            g = " gated" if gate else ""
            for b in [0] + budgets:
                name = f"{drafter} {'chain' if not b else f'tree {b}'}{g}"
                outs = [decode(model, p, max_tokens, k=k, nodes=b, gate=gate, **extra) for p in prompts]
                per_round[name] = n / sum(r for _, r, _, _ in outs)
                identical[name] = [o for o, _, _, _ in outs] == expected
        trees = [f"{drafter} tree {b}" for b in budgets]
        best[drafter] = int(max(trees, key=lambda t: per_round[t]).split()[-1])
        print(f"{drafter}: tokens per round done", flush=True)
    rows = []
    for drafter in drafters:
        for gate in (False, True):
            g = " gated" if gate else ""
            chain = f"{drafter} chain{g}"
            for b in [0] + budgets:
                name = f"{drafter} {'chain' if not b else f'tree {b}'}{g}"
                rows.append([name, f"{per_round[name]:.2f}", f"{per_round[name] / per_round[chain]:.2f}x",
                             "yes" if identical[name] else "NO"])
    print()
    print(table(rows, ["side", "tokens/round", "vs its chain", "identical"]))
    print("(gated: the width the cost gate chose and, for trees, the tree gate's choice of trees or chains "
          "each round, both from CPU times measured in this run: the gate's clock; a gated round that drafts nothing counts as a round)")

    sides = {"plain": dict()}
    for drafter, extra in drafters.items():  # the best tree (most tokens per round ungated), ungated and gated
        for gate in (False, True):
            g = " gated" if gate else ""
            sides[f"{drafter} chain{g}"] = dict(k=k, gate=gate, **extra)
            sides[f"{drafter} tree {best[drafter]}{g}"] = dict(k=k, nodes=best[drafter], gate=gate, **extra)
    times = {name: Stats() for name in sides}
    cpus = {name: Stats() for name in sides}
    rounds = {name: 0 for name in sides}
    per_prompt = {name: [Stats() for _ in prompts] for name in sides}  # CPU seconds
    shapes = {name: [0, 0] for name in sides}
    for r in range(repeats + 1):
        for name in rotated(list(sides), r):
            total = total_cpu = 0.0
            SHAPES[:] = [0, 0]
            for j, (p, want) in enumerate(zip(prompts, expected)):
                out, used, seconds, cpu = decode(model, p, max_tokens, **sides[name])
                total += seconds
                total_cpu += cpu
                identical[name] = identical.get(name, True) and out == want
                if r:
                    per_prompt[name][j].samples.append(cpu)
                    rounds[name] += used
            if r:
                times[name].samples.append(total)
                cpus[name].samples.append(total_cpu)
                shapes[name] = [a + b for a, b in zip(shapes[name], SHAPES)]
        print(f"timed round {r} done", flush=True)

    def chain_of(name):
        return name.split(" tree ")[0] + " chain" + (" gated" if name.endswith("gated") else "")

    rows = []
    for name in sides:
        base = chain_of(name) if " tree " in name else None
        worst = ""
        if base is not None:
            worst = f"{min(paired_ratio(per_prompt[base][j], per_prompt[name][j]).median for j in range(count)):.3f}"
        rows.append([name, f"{n / times[name].median:.1f}", fmt_ratio(paired_ratio(times["plain"], times[name])),
                     "" if base is None else fmt_ratio(paired_ratio(times[base], times[name])),
                     f"{n / cpus[name].median:.1f}", fmt_ratio(paired_ratio(cpus["plain"], cpus[name])),
                     "" if base is None else fmt_ratio(paired_ratio(cpus[base], cpus[name])), worst,
                     "yes" if identical[name] else "NO"])
    print()
    print(table(rows, ["side", "tok/s", "vs plain", "vs its chain", "tok/CPU s", "CPU vs plain", "CPU vs its chain",
                       "worst prompt vs chain (CPU)", "identical"]))
    for name in sides:
        if name.endswith("gated") and " tree " in name:
            print(f"{name}: the tree gate ran {shapes[name][1]} tree rounds and {shapes[name][0]} chain rounds "
                  "(the timed runs)")
    print("\ntok/s: generated tokens / decode seconds (after the prefill) over all prompts; tok/CPU s: the same "
          "over the process's CPU seconds (steadier on a loaded machine: other processes barely move it); vs = "
          "paired ratio (>1: faster), median [min-max]; worst prompt: the lowest per-prompt median CPU ratio")

    rows = []  # the cost model: end to end = (tokens per round ratio) / (seconds per round ratio)
    for drafter in drafters:
        chain, tree = f"{drafter} chain", f"{drafter} tree {best[drafter]}"
        spr = lambda s: cpus[s].median * repeats / rounds[s]  # noqa: E731  CPU seconds per round (median run)
        tokens_ratio = per_round[tree] / per_round[chain]
        seconds_ratio = spr(tree) / spr(chain)
        rows.append([drafter, f"{best[drafter]}", f"{per_round[chain]:.2f}", f"{per_round[tree]:.2f}",
                     f"{tokens_ratio:.2f}x", f"{seconds_ratio:.2f}x", f"{tokens_ratio / seconds_ratio:.2f}x",
                     f"{1.15 * seconds_ratio:.2f}x"])
    print()
    print(table(rows, ["drafter", "tree", "chain tok/round", "tree tok/round", "tokens ratio", "s/round ratio",
                       "model e2e", "tokens ratio for 1.15x"]))
    print("(ungated; s/round: decode CPU seconds / rounds of the timed runs; model e2e = tokens ratio / s/round ratio)")
    print(f"load avg after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
