"""Tree speculation vs chains (issue 31, docs/tree.md): prompt lookup, one row, held-out code.

On the shipped hybrid demo target (Gated DeltaNet + attention), for each of a few
held-out code prompts (mlx-lm's sources, outside the training corpus):

  * verify cost: a forward of N positions (a chain, and a tree of N nodes) in a
    branch, in one-token forwards (c(N) = time(N) / time(1)), medians;
  * tokens per round and end-to-end decode tok/s of plain greedy, prompt lookup
    chains and trees of 4, 8, 12, 16 draft nodes, each ungated (every round
    drafts, the width adapting as `stream_generate`'s) and gated (the decoder's
    cost gate choosing the width, the tree's depth), timed interleaved in one run;
    every output checked token for token against plain greedy.

    python bench/tree.py [--quick] [--repeats N] [--max-tokens N] [--prompts N]
                         [--num-draft-tokens K] [--nodes 4,8,12,16]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Stats, fmt_ratio, header, paired_ratio, rotated, table  # noqa: E402  (imports segcache first)

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import segcache  # noqa: E402
from segcache import Runtime  # noqa: E402
from segcache.drafters import make_decoder  # noqa: E402
from segcache.lookup import PromptLookup  # noqa: E402

MODELS_DIR = Path(segcache.__file__).resolve().parent / "models"


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from heldout_other.txt, each ending at a `def`/`class`
    line, spread over the file (as bench/speculative.py picks them, longer)."""
    lines = (MODELS_DIR / "heldout_other.txt").read_text().split("\n")
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
    picks = starts[len(starts) // (2 * count) :: max(1, len(starts) // count)][:count]
    return [tokenizer.encode("\n".join(lines[max(0, i - 120) : i + 1]))[-length:] for i in picks]


def decode(model, prompt: list[int], max_tokens: int, *, k: int = 0, nodes: int = 0, gate: bool = False):
    """One generation on the decoder, timed from after the prefill: (tokens, rounds, seconds)."""
    rt = Runtime(model)
    rt.forward(prompt[:-1])
    mx.eval([layer.state for layer in rt.cache])
    decoder = make_decoder(model, num_draft_tokens=k, draft_tree=nodes, one_row=True, gate=gate)
    decoder.add(0, rt, prompt[-1], max_tokens=max_tokens)
    out = []
    tic = time.perf_counter()
    while not decoder.rows[0].finished:
        out += [t for t, _, _ in decoder.step()[0]]
    seconds = time.perf_counter() - tic
    return out, decoder.rows[0].stats.rounds, seconds


def verify_costs(model, prompt: list[int], sizes: list[int], repeats: int) -> dict:
    """{N: (chain c(N), tree c(N))}: forwards of N positions in a branch, in one-token forwards."""
    rt = Runtime(model)
    rt.forward(prompt)
    mx.eval([layer.state for layer in rt.cache])
    lookup = PromptLookup()
    lookup.extend(prompt)
    rng = random.Random(0)

    def timed_forward(tokens, parents=None):
        samples = []
        for _ in range(repeats + 1):
            branch = rt.fork()
            tic = time.perf_counter()
            out = rt.forward(tokens) if parents is None else rt.forward_tree(tokens, parents)
            mx.eval(out, [layer.state for layer in rt.cache])
            samples.append(time.perf_counter() - tic)
            branch.rollback()
        return Stats(samples[1:]).median

    one = timed_forward(prompt[-1:])
    out = {}
    for n in sizes:
        tokens = [rng.randrange(64) for _ in range(n)]
        parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]  # bushy, a few deep
        out[n] = (timed_forward(tokens) / one, timed_forward(tokens, parents) / one if n > 1 else 1.0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, 48 tokens, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None, help="held-out prompts")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="the chain's (and the trees' depth) K")
    parser.add_argument("--nodes", default="4,8,12,16", help="tree budgets (draft nodes per round)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)
    max_tokens = args.max_tokens or (48 if args.quick else 128)
    count = args.prompts or (2 if args.quick else 4)
    budgets = [int(x) for x in args.nodes.split(",")]
    k = args.num_draft_tokens

    model, tokenizer = mlx_lm.load(str(MODELS_DIR / "target"))
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    header("tree speculation: prompt lookup chains vs trees, one row, held-out code",
           [("target", {"family": "qwen3_5 (demo)"}, params)])
    prompts = heldout_prompts(tokenizer, count, args.prompt_tokens)
    print(f"{count} prompts of {args.prompt_tokens} tokens, max_tokens {max_tokens}, K {k}, repeats {repeats} "
          "(+1 warm-up); medians; the machine is shared (2 cores), ratios are paired per round\n")

    costs = verify_costs(model, prompts[0], sorted({1, 2, 4, 5, 8, 9, 12, 13, 16, 17}), max(5, repeats * 3))
    print(table([[str(n), f"{c:.2f}", f"{t:.2f}"] for n, (c, t) in costs.items()],
                ["N positions", "c(N) chain", "c(N) tree"]))
    print()

    sides = {"plain": dict()}
    for gate in (False, True):
        g = " gated" if gate else ""
        sides["chain" + g] = dict(k=k, gate=gate)
        for b in budgets:
            sides[f"tree {b}{g}"] = dict(k=k, nodes=b, gate=gate)
    expected = [decode(model, p, max_tokens)[0] for p in prompts]
    times = {name: Stats() for name in sides}
    rounds = {name: 0 for name in sides}
    identical = {name: True for name in sides}
    for r in range(repeats + 1):
        for name in rotated(list(sides), r):
            total = 0.0
            for p, want in zip(prompts, expected):
                out, n_rounds, seconds = decode(model, p, max_tokens, **sides[name])
                total += seconds
                identical[name] &= out == want
                if r == 0:
                    rounds[name] += n_rounds
            if r:
                times[name].samples.append(total)
        print(f"round {r} done", flush=True)
    n = sum(len(e) for e in expected)
    rows = []
    for name in sides:
        base = "chain gated" if name.endswith("gated") else "chain"
        rows.append([name, f"{n / rounds[name]:.2f}", f"{n / times[name].median:.1f}",
                     fmt_ratio(paired_ratio(times["plain"], times[name])),
                     "" if name == "plain" else fmt_ratio(paired_ratio(times[base], times[name])),
                     f"{(n / rounds[name]) / (n / rounds[base]):.2f}x" if name != "plain" else "",
                     "yes" if identical[name] else "NO"])
    print()
    print(table(rows, ["side", "tokens/round", "tok/s", "vs plain", "vs its chain", "tok/round vs chain",
                       "identical"]))
    print("\ntok/s: generated tokens / decode seconds (after the prefill) over all prompts; vs = paired "
          "time ratio (>1: faster), median [min-max]; tokens per round from the warm-up round")
    print(f"load avg after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
