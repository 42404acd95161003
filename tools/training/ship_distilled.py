"""Stage ``ship-distilled``: installs the distilled draft as ``draft/`` and records it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import eval_demo
from training.evaluation import greedy_agreements
from training.models import config_summary, dir_bytes


def run(args) -> None:
    """Installs the distilled draft (``--distill-out``) as ``draft/`` and records it.

    Copies the model files, re-evaluates the draft's held-out numbers and the
    draft/target greedy agreement, and updates ``training.json``: the draft's
    entry gets a ``distill`` section (teacher, steps, tokens, wall time, loss, the
    held-out numbers and agreement before and after), ``greedy_agreement`` the
    new rates. ``--bench-json`` adds the measured end-to-end speed, if given.
    """
    out = Path(args.out_dir)
    source = Path(args.distill_out)
    stats = json.loads((source / "distill.json").read_text())
    record = json.loads((out / "training.json").read_text())
    entry = record["models"]["draft"]
    before = {"heldout": entry["heldout"],
              "greedy_agreement": {k: v for k, v in record["greedy_agreement"].items()
                                   if k != "definition"}}
    destination = out / "draft"
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, destination / name)
    target, tokenizer = eval_demo.load_demo_model("target", out)
    draft, _ = eval_demo.load_demo_model("draft", out)
    heldout = eval_demo.evaluate_model(draft, tokenizer, out)
    agreement = greedy_agreements(target, draft, tokenizer, out)
    config = json.loads((destination / "config.json").read_text())
    entry["config"] = config_summary(config)
    entry["parameters"] = stats["parameters"]
    entry["dir_bytes"] = dir_bytes(destination)
    entry["heldout"] = heldout
    distill = {
        "command": "nice -n 10 python tools/train_demo.py distill --draft-init DIR "
                   f"--layers {stats['layers']} "
                   f"--lr {stats['peak_lr']} --steps {stats['steps']} "
                   f"--cooldown-start {stats['cooldown_start']} "
                   f"--cooldown-steps {stats['cooldown_steps']}   # = the defaults",
        "run": "concurrently with the 2-layer variant (--layers 2 --lr 1e-3), each under "
               "nice -n 10 with OPENBLAS_NUM_THREADS=1, --steps 3000 --max-minutes 19 "
               "--time-based-cooldown semantics (cooldown placed at 80% of the budget)",
        "draft_init": "DIR = the from-scratch draft: 'train draft' output, as shipped "
                      "before distillation (git show 1782407:src/segcache/models/draft/...)",
        "teacher": stats["teacher"],
        "warm_start": "the from-scratch draft described by 'training' (shipped before "
                      "distillation)" + (f", cut to its first {stats['layers']} layer(s)"
                                         if stats["layers"] < 2 else ""),
        **{k: v for k, v in stats.items() if k not in ("teacher", "init", "parameters")},
        "heldout_before": before["heldout"],
        "greedy_agreement_before": before["greedy_agreement"],
        "greedy_agreement_after": agreement,
    }
    if args.bench_json:
        distill["end_to_end"] = json.loads(Path(args.bench_json).read_text())
    entry["distill"] = distill
    record["greedy_agreement"].update(agreement)
    record["greedy_agreement"]["note"] = ("rates of the distilled draft; the from-scratch "
                                          "draft's are in models.draft.distill."
                                          "greedy_agreement_before")
    if "distilled" not in record["description"]:
        record["description"] += ("; the draft was then cut to its first layer and distilled "
                                  "from the target (models.draft.distill)")
    if "python tools/train_demo.py distill" not in " ".join(record["commands"]):
        record["commands"] += [distill["command"],
                               "python tools/train_demo.py ship-distilled"]
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print("draft", json.dumps(heldout, indent=1), "agreement", json.dumps(agreement, indent=1),
          flush=True)
