"""Speculative vs plain greedy generation on a hybrid target: end-to-end tokens/s.

Cases, all on the same hybrid (Gated DeltaNet + attention) target and timed
interleaved with plain greedy generation on the same prompt in the same run:

  * dense draft      a llama draft model
  * dense draft, held-out prompts
                     the same on code prompts from outside the training
                     corpus (mlx-lm's sources), one after the other
  * hybrid draft     the target's own first layers (shared weights, early exit)
  * prompt lookup    n-gram drafts from the prompt + output, on a prompt that
                     asks the model to repeat/edit code it was shown

Every speculative output is checked token-for-token against mlx-lm's greedy
`stream_generate` in the same run. Uses the shipped demo models
(src/segcache/models/target, draft) when they exist; otherwise random
models from the mlx-lm classes, built so that the hybrid draft agrees with
the target always (an acceptance upper bound) and the dense draft almost
never (a lower bound), which the output says.

    python bench/speculative.py [--quick] [--repeats N] [--max-tokens N] [--num-draft-tokens K]
                                [--draft-min-prob P] [--heldout-prompts N] [--target DIR --draft DIR]
                                [--target shipped|wide [--wide-layers 16] [--wide-mlp 12288] [--wide-bits 4]]

`--target wide` runs on the shipped target widened (segcache.testing.widen: its function at a
~155M model's cost, built once into bench/.cache); the hybrid draft stays its first layers. The
c(k) of mlx-lm's own cache is printed for whichever target runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402  (imports segcache first)
    add_target_args, fmt_ratio, header, interleave, paired_ratio, print_verify_costs, table, target_dir, target_label,
)

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import segcache  # noqa: E402
from segcache.generation import DRAFT_MIN_PROB, stream_generate  # noqa: E402
from segcache.testing import models  # noqa: E402
from segcache.testing import tokenizer as test_tokenizer  # noqa: E402

MODELS_DIR = Path(segcache.__file__).resolve().parent / "models"
EXIT_LAYERS = 2  # layers of the target the hybrid draft keeps

CODE = '''def parse_header(line, sep=":"):
    """Split a header line into a lower-cased name and a stripped value."""
    name, _, value = line.partition(sep)
    name = name.strip().lower()
    if not name:
        raise ValueError("empty header name in %r" % line)
    return name, value.strip()


def parse_headers(lines):
    headers = {}
    for line in lines:
        if not line.strip():
            break
        name, value = parse_header(line)
        headers.setdefault(name, []).append(value)
    return headers
'''
PROMPT = "# A small helper module.\nimport os\n\n\ndef join(parts):\n    return os.sep.join(parts)\n"
# Editing code: the model has just read the code and is asked to write it again,
# renamed; most of its output then repeats n-grams of the prompt.
LOOKUP_PROMPT = CODE + "\n\n# The same functions again, with `sep` renamed to `delimiter`:\n\n" + CODE[:60]


def heldout_prompts(tokenizer, count: int, length: int = 80) -> list[list[int]]:
    """`count` code prompts from heldout_other.txt (mlx-lm's sources, outside the
    training corpus): the `length` tokens up to a `def`/`class` line, spread
    evenly over the file."""
    lines = (MODELS_DIR / "heldout_other.txt").read_text().split("\n")
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
    picks = starts[:: max(1, len(starts) // count)][:count]
    return [tokenizer.encode("\n".join(lines[max(0, i - 30) : i + 1]))[-length:] for i in picks]


def early_exit(model, layers: int):
    """A model of the same class made of `model`'s embedding, first `layers` layers and head.

    The weights are the target's own arrays (shared, not copied).
    """
    cfg = dict(model.args.text_config) if hasattr(model.args, "text_config") else vars(model.args).copy()
    cfg["num_hidden_layers"] = layers
    if hasattr(model.args, "text_config"):
        cfg = {"model_type": model.args.model_type, "text_config": cfg}
    arch = importlib.import_module(type(model).__module__)
    draft = arch.Model(arch.ModelArgs.from_dict(cfg))
    keep = []
    for name, w in tree_flatten(model.parameters()):
        parts = name.split(".")
        if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
            continue
        keep.append((name, w))
    draft.load_weights(keep, strict=True)
    return draft


def silence_layers_after(model, first: int) -> None:
    """Zero the output projections of layers >= first: they still compute, but add nothing."""
    zeroed = [
        (name, mx.zeros_like(w))
        for name, w in tree_flatten(model.parameters())
        if ".layers." in name
        and int(name.split(".layers.")[1].split(".")[0]) >= first
        and name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))
    ]
    model.load_weights(zeroed, strict=False)
    mx.eval(model.parameters())


def load_models(target_dir=None, draft_dir=None):
    """(target, dense draft, hybrid draft, tokenizer, description lines, specs)."""
    given = target_dir is not None
    target_dir = Path(target_dir or MODELS_DIR / "target")
    draft_dir = Path(draft_dir or MODELS_DIR / "draft")
    if (target_dir / "config.json").exists() and (draft_dir / "config.json").exists():
        target, tokenizer = mlx_lm.load(str(target_dir))
        dense, _ = mlx_lm.load(str(draft_dir))
        hybrid = early_exit(target, EXIT_LAYERS)
        what = "models given on the command line" if given else "shipped demo models"
        notes = [
            f"models: {what}: target {target_dir}, draft {draft_dir}; tokenizer vocab {len(tokenizer.vocab)}",
            f"hybrid draft: the target's first {EXIT_LAYERS} layers + its head (early exit, shared weights)",
        ]
        specs = [("target", json.loads((target_dir / "config.json").read_text())),
                 ("dense draft", json.loads((draft_dir / "config.json").read_text()))]
        return target, dense, hybrid, tokenizer, notes, specs
    spec = dict(hidden_size=256, num_hidden_layers=6, intermediate_size=768, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, linear_num_value_heads=8, linear_num_key_heads=4,
                linear_key_head_dim=32, linear_value_head_dim=32)
    target = models.build("qwen3_5", seed=0, **spec)
    silence_layers_after(target, EXIT_LAYERS)
    hybrid = early_exit(target, EXIT_LAYERS)
    dense_spec = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=384)
    dense = models.build("llama", seed=1, **dense_spec)
    notes = [
        "models: RANDOM weights (no demo models in src/segcache/models yet)",
        f"hybrid draft: the target's first {EXIT_LAYERS} of 6 layers; the target's layers "
        f"{EXIT_LAYERS}-5 compute but have zeroed output projections, so the draft always "
        "agrees: an UPPER BOUND (acceptance 100% at the real cost ratio)",
        "dense draft: an unrelated random llama: acceptance ~0, a LOWER BOUND (cost of drafting in vain)",
        "prompt lookup: acceptance depends on how much a random model repeats itself",
    ]
    specs = [("target", {"family": "qwen3_5", **spec}), ("dense draft", {"family": "llama", **dense_spec})]
    return target, dense, hybrid, test_tokenizer.tokenizer(eos=False), notes, specs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short generations, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--draft-min-prob", type=float, default=DRAFT_MIN_PROB,
                        help=f"stop a round's drafting below this draft probability (default {DRAFT_MIN_PROB}; 0 = off)")
    parser.add_argument("--heldout-prompts", type=int, default=4, help="prompts in the held-out code case")
    add_target_args(parser, directories=True)
    parser.add_argument("--draft", help="dense draft model directory (default: the shipped demo draft)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    max_tokens = args.max_tokens or (64 if args.quick else 256)
    k, gate = args.num_draft_tokens, args.draft_min_prob

    given = None if args.target == "shipped" else target_dir(args)
    target, dense, hybrid, tokenizer, notes, specs = load_models(given, args.draft)
    params = lambda m: sum(v.size for _, v in tree_flatten(m.parameters()))  # noqa: E731
    sized = [(role, {"family": cfg.get("model_type", cfg.get("family")),
                     **{x: cfg[x] for x in ("hidden_size", "num_hidden_layers") if x in cfg}}, params(m))
             for (role, cfg), m in zip(specs, (target, dense))]
    header("speculative generation: hybrid target, speculative vs plain greedy", sized)
    for line in notes:
        print(line)
    print(f"max_tokens {max_tokens}, num_draft_tokens {k}, draft_min_prob {gate}, repeats {repeats} "
          "(+1 warm-up), figures are medians; ratios are paired per round\n")

    heldout = heldout_prompts(tokenizer, args.heldout_prompts)
    print_verify_costs(target, heldout[0], target_label(args))
    print()
    drafting = {"num_draft_tokens": k, "draft_min_prob": gate}
    cases = [
        ("dense draft", [tokenizer.encode(PROMPT)], {"draft_model": dense, **drafting}),
        (f"dense draft, {len(heldout)} held-out prompts", heldout, {"draft_model": dense, **drafting}),
        ("hybrid draft", [tokenizer.encode(PROMPT)], {"draft_model": hybrid, **drafting}),
        ("prompt lookup", [tokenizer.encode(LOOKUP_PROMPT)], {"prompt_lookup": True, "num_draft_tokens": k}),
    ]
    rows = []
    for name, prompts, kwargs in cases:
        expected = [[r.token for r in mlx_lm.stream_generate(target, tokenizer, mx.array(p), max_tokens=max_tokens)]
                    for p in prompts]
        seen = {}

        def side(label, **kw):
            def setup():
                def run():
                    outs = [list(stream_generate(target, tokenizer, p, max_tokens=max_tokens, **kw)) for p in prompts]
                    seen[label] = ([[r.token for r in out] for out in outs], [out[-1].stats for out in outs])
                    return []
                return run
            return setup

        def mlx_side():
            def run():
                for p in prompts:
                    for _ in mlx_lm.stream_generate(target, tokenizer, mx.array(p), max_tokens=max_tokens):
                        pass
                return []
            return run

        stats = interleave({"mlx-lm": mlx_side, "plain": side("plain"), "spec": side("spec", **kwargs)},
                           warmup=1, repeats=repeats)
        n = sum(len(e) for e in expected)
        tps = {s: n / stats[s].median for s in stats}
        spec_tokens, spec_stats = seen["spec"]
        plain_tokens, _ = seen["plain"]
        identical = spec_tokens == expected and plain_tokens == expected
        drafted = sum(st.drafted for st in spec_stats)
        accepted = sum(st.accepted for st in spec_stats)
        rounds = sum(st.rounds for st in spec_stats)
        times = [sum(getattr(st, f) for st in spec_stats) for f in ("draft_time", "verify_time", "commit_time")]
        rows.append([
            name, "+".join(str(len(p)) for p in prompts), str(n),
            f"{tps['mlx-lm']:.1f}", f"{tps['plain']:.1f}", f"{tps['spec']:.1f}",
            fmt_ratio(paired_ratio(stats["plain"], stats["spec"])),
            fmt_ratio(paired_ratio(stats["mlx-lm"], stats["spec"])),
            f"{accepted / max(drafted, 1):.1%}", f"{accepted / max(rounds, 1):.2f}",
            "/".join(f"{t:.2f}" for t in times),
            "yes" if identical else "NO",
        ])
        print(f"{name}: done ({'identical' if identical else 'OUTPUT DIFFERS'})", flush=True)
    print()
    print(table(rows, ["case", "prompt", "tokens", "mlx-lm tok/s", "plain tok/s", "spec tok/s",
                       "speedup vs plain", "speedup vs mlx-lm", "accepted", "acc/round",
                       "draft/verify/commit s", "identical"]))
    print("\ntok/s: generated tokens / end-to-end seconds (prefill included) of one generation"
          " (of all the case's prompts, one after the other);"
          "\nplain = segcache greedy without drafts on the same runtime code; mlx-lm = mlx_lm.stream_generate;"
          "\nspeedup = paired per-round time ratio, median [min-max]; identical = speculative and plain"
          " outputs equal mlx-lm's greedy tokens")
    print(f"load avg after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
