"""`segcache check`: parse the flags, run `segcache.check`, print one line per property and a verdict.

    segcache check --model PATH [--draft-model PATH] [--examples N] [--seed S] [--store-dir DIR] [--json]

Exit status: 0 every property holds (or is skipped, saying why), 1 a property failed (its shrunk
counterexample printed as a program of calls), 2 the model cannot be checked (not found, too
large for memory, or a layer segcache does not support).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time

WHAT_TO_DO = (
    "what to do: serve this model with mlx_lm.server meanwhile (segcache refuses it rather than "
    "serve it inexactly), or teach segcache its layer: a recurrent module needs a hook in "
    "segcache/adapters/state.py (docs/compatibility.md lists what is served); then run segcache check again"
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `check` subcommand on an argparse `subparsers` object."""
    p = subparsers.add_parser(
        "check",
        help="check that branches, batching, the prefix store and speculative decoding are exact on a model",
        description="Run segcache's property harness on a model, with mlx-lm's own caches as the reference: "
        "the runtime state machine, the batch machine (where the family batches), the store machine on a "
        "temporary store, and speculative greedy identity with each drafter the model can use. A failure "
        "prints hypothesis's shrunk counterexample as a program of calls and exits 1 (docs/check.md).",
    )
    p.add_argument("--model", required=True, help="model directory or Hugging Face repo, as segcache serve takes")
    p.add_argument("--draft-model", default=None, help="also check speculative decoding with this draft model")
    p.add_argument("--examples", type=int, default=None,
                   help="examples (programs, prompts) per property; default: scaled to the model's size")
    p.add_argument("--seed", type=int, default=0, help="hypothesis's seed: the same seed runs the same examples")
    p.add_argument("--store-dir", default=None,
                   help="where the store property makes its temporary stores (each removed after its program; "
                        "nothing already there is touched); default: the system's temporary directory")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run `segcache check`; returns the exit status."""
    if args.examples is not None and args.examples < 1:
        print("segcache check: --examples must be >= 1", file=sys.stderr)
        return 2
    from . import check
    from .serve.paths import shown
    from .errors import ModelError, UnsupportedModelError

    start = time.perf_counter()
    try:
        subject = check.load(args.model, args.draft_model)
    except UnsupportedModelError as exc:
        return _refused(args, f"not supported: {exc}", WHAT_TO_DO)
    except ModelError as exc:
        return _refused(args, str(exc), "")
    budget = check.budget_for(subject, args.examples)
    head = {
        "model": args.model, "family": subject.family, "dtype": str(subject.dtype).replace("mlx.core.", ""),
        "quantization": subject.quantization or None, "weight_bytes": subject.weight_bytes, "draft_model": args.draft_model, "seed": args.seed,
        "budget": {"scale": round(budget.scale, 3), "examples": budget.examples, "steps": budget.steps,
                   "context": budget.context, "prompt": budget.prompt, "generate": budget.generate},
    }
    if not args.json:
        where = shown(check.model_dir(args.model))
        kind = f"{subject.quantization} quantized, " if subject.quantization else ""
        print(f"segcache check: {where} ({subject.family}, {kind}{head['dtype']}, {_mb(subject.weight_bytes)} of weights)"
              + (f", draft {shown(check.model_dir(args.draft_model))}" if args.draft_model else ""))
        scaled = "--examples" if args.examples else f"scale {budget.scale:.2f} for its size"
        print(f"budget ({scaled}): {_examples(budget.examples)} examples; programs of {budget.steps} steps up to "
              f"{budget.context} tokens, prompts up to {budget.prompt}, generating up to {budget.generate}; "
              f"seed {args.seed}")
    results = []
    for result in check.run(subject, budget, seed=args.seed, store_dir=args.store_dir):
        results.append(result)
        if not args.json:
            print(_line(result), flush=True)
    failed = [r for r in results if r.status == "fail"]
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({**head, "verdict": "fail" if failed else "pass", "seconds": round(seconds, 2),
                          "properties": [r.as_dict() for r in results]}, indent=2))
        return 1 if failed else 0
    held = sum(r.status == "pass" for r in results)
    skipped = sum(r.status == "skip" for r in results)
    unrun = sum(r.status == "not run" for r in results)
    if not failed:
        print(f"verdict: PASS: {held} properties hold, {skipped} skipped ({seconds:.1f} s)")
        return 0
    print(f"verdict: FAIL: {', '.join(r.name for r in failed)} ({held} hold, {skipped} skipped, {unrun} not run; {seconds:.1f} s)")
    for r in failed:
        print(f"\n{r.name}: {r.detail}")
        if r.program:
            calls = f"{r.calls} call" + ("" if r.calls == 1 else "s")
            print(f"shrunk counterexample ({calls}; paste it into a bug report, it runs as it is):")
            print(textwrap.indent("\n".join(r.program), "    "))
    again = f"segcache check --model {args.model} --seed {args.seed}" + (
        f" --draft-model {args.draft_model}" if args.draft_model else "") + (
        f" --examples {args.examples}" if args.examples else "")
    print(f"\nreproduce: {again}")
    return 1


def _refused(args, message: str, advice: str) -> int:
    if args.json:
        print(json.dumps({"model": args.model, "verdict": "refused", "error": message, "advice": advice,
                          "properties": []}, indent=2))
    else:
        print(f"segcache check: {message}", file=sys.stderr)
        if advice:
            print(advice, file=sys.stderr)
    return 2


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _examples(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def _line(r) -> str:
    if r.status in ("skip", "not run"):
        return f"  {r.name:<28} {r.status}  {r.detail}"
    if r.status == "fail":
        return f"  {r.name:<28} FAIL  {r.examples:>4} examples  {r.seconds:6.1f} s  (shrinking included)"
    note = f"  ({r.detail})" if r.detail else ""
    return f"  {r.name:<28} pass  {r.examples:>4} examples  {r.seconds:6.1f} s{note}"
