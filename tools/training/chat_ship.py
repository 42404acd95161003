"""Stage ``chat-ship``: installs the chat target (with its MTP head) and draft; records them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer

import eval_demo
from segcache.mtp import HEAD_FILE, load_head
from training.chat_data import HELDOUT_DIALOGS_FILE
from training.evaluation import greedy_agreements, heldout_ids
from training.models import config_summary, count_parameters, dir_bytes
from training.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILES


def old_token_heldout(model, old_tokenizer_file: Path, out: Path) -> dict:
    """Held-out loss on the pre-chat tokenizer's ids (a superset vocabulary reads them alike)."""
    old = Tokenizer.from_file(str(old_tokenizer_file))
    result = {}
    for which in eval_demo.HELDOUT_FILES:
        ids = old.encode(eval_demo.read_heldout_text(which, out)).ids[:eval_demo.EVAL_MAX_TOKENS]
        result[which] = {"tokens": len(ids),
                         "loss_nats_per_token": eval_demo.heldout_loss(model, ids)}
    return result


def run(args) -> None:
    """Installs the chat target (with its MTP head) and the chat draft, and records them.

    Copies ``chat_target`` (+ ``mtp_head/mtp.safetensors``) to ``target/``,
    ``chat_draft`` to ``draft/``, the held-out dialogs next to them, evaluates
    (held-out code loss, draft/target agreement, tool calls on held-out dialogs,
    MTP acceptance at depths 1-3) and updates ``training.json``; the numbers of
    the models replaced are kept as ``*_before_chat``. ``--bench-json`` adds
    measured end-to-end speeds.
    """
    work, out = Path(args.work_dir), Path(args.out_dir)
    record = json.loads((out / "training.json").read_text())
    prepared = json.loads((work / "chat_prepare.json").read_text())
    old_tokenizer = work / "pre_chat_tokenizer.json"
    if not old_tokenizer.exists():  # the tokenizer of the models being replaced
        shutil.copy(out / "target" / "tokenizer.json", old_tokenizer)
    before = {name: {"heldout": record["models"][name]["heldout"]} for name in ("target", "draft")}
    before["greedy_agreement"] = {k: v for k, v in record["greedy_agreement"].items()
                                  if k in eval_demo.HELDOUT_FILES}
    for name, source in (("target", work / "chat_target"), ("draft", work / "chat_draft")):
        destination = out / name
        for f in destination.iterdir():
            f.unlink()
        for f in ("config.json", "model.safetensors") + TOKENIZER_FILES:
            shutil.copy(source / f, destination / f)
    config = json.loads((out / "target" / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1  # as Qwen3.5's config says it has a head
    (out / "target" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(work / "mtp_head" / "mtp.safetensors", out / "target" / HEAD_FILE)
    shutil.copy(work / HELDOUT_DIALOGS_FILE, out / HELDOUT_DIALOGS_FILE)
    (out / CHAT_TEMPLATE_FILE).write_bytes((work / "chat_tokenizer" / CHAT_TEMPLATE_FILE)
                                           .read_bytes())

    target, tokenizer = eval_demo.load_demo_model("target", out)
    draft, _ = eval_demo.load_demo_model("draft", out)
    head = load_head(target, out / "target")
    results = {}
    for name, model in (("target", target), ("draft", draft)):
        results[name] = {"heldout": eval_demo.evaluate_model(model, tokenizer, out),
                         "heldout_pre_chat_tokens": old_token_heldout(model, old_tokenizer, out)}
        print(name, json.dumps(results[name], indent=1), flush=True)
    agreement = greedy_agreements(target, draft, tokenizer, out)
    acceptance = {which: eval_demo.mtp_acceptance(target, head, heldout_ids(tokenizer, which, out))
                  for which in eval_demo.HELDOUT_FILES}
    print("agreement", json.dumps(agreement), "\nmtp", json.dumps(acceptance), flush=True)
    dialogs = json.loads((out / HELDOUT_DIALOGS_FILE).read_text())
    tool_calls = eval_demo.tool_call_eval(target, tokenizer, dialogs)
    print("tool calls", json.dumps(tool_calls), flush=True)

    chat_train = json.loads((work / "chat_target" / "chat_train.json").read_text())
    distill = json.loads((work / "chat_draft" / "chat_distill.json").read_text())
    mtp = json.loads((work / "mtp_head" / "mtp_train.json").read_text())
    for stats in (chat_train, distill, mtp):
        for key in ("init", "teacher", "target"):
            stats.pop(key, None)  # paths of the machine that trained
    record["chat"] = {
        "what": "the Qwen3.5 chat format with tool calls: tokenizer markup tokens, "
                "chat_template.jinja, synthetic tool-calling dialogs over the stdlib "
                "(tools/demo_dialogs.py)",
        **prepared,
        "heldout_dialogs_file": HELDOUT_DIALOGS_FILE,
        "tool_call_eval": "tools/eval_demo.py tool_call_eval: greedy replies to the held-out "
                          "dialogs (from the held-out stdlib files), per turn and as a closed "
                          "agent loop",
    }
    for name in ("target", "draft"):
        entry = record["models"][name]
        cfg = json.loads((out / name / "config.json").read_text())
        entry["config"] = config_summary(cfg)
        entry["parameters"] = count_parameters(target if name == "target" else draft)
        entry["dir_bytes"] = dir_bytes(out / name)
        entry["heldout_before_chat"] = before[name]["heldout"]
        entry["heldout"] = results[name]["heldout"]
        entry["heldout_pre_chat_tokens"] = results[name]["heldout_pre_chat_tokens"]
    record["models"]["target"]["chat"] = {
        "command": "nice -n 10 python tools/train_demo.py chat-train --init DIR "
                   f"--steps {chat_train['steps']} --cooldown-start {chat_train['cooldown_start']} "
                   f"--cooldown-steps {chat_train['cooldown_steps']}",
        "init": "DIR = the target as shipped before the chat stages (git show f843e73:"
                "src/segcache/models/target/...), its embedding grown by the 8 markup tokens",
        **chat_train,
        "tool_calls": tool_calls,
    }
    record["models"]["target"]["mtp"] = {
        "file": f"target/{HEAD_FILE}",
        "file_bytes": (out / "target" / HEAD_FILE).stat().st_size,
        "command": "nice -n 10 python tools/train_demo.py mtp-train "
                   f"--steps {mtp['steps']} --cooldown-start {mtp['cooldown_start']} "
                   f"--cooldown-steps {mtp['cooldown_steps']}",
        **mtp,
        "acceptance": acceptance,
        "acceptance_definition": "tools/eval_demo.py mtp_acceptance: at each position of the "
                                 "target's greedy continuation of held-out prompts, the head "
                                 "drafts 3 tokens (hidden t + token t+1 -> token t+2, then on "
                                 "its own hidden state and draft); depth_k = fraction of "
                                 "positions whose first k drafts all equal the target's greedy "
                                 "tokens",
    }
    record["models"]["draft"]["chat_distill"] = {
        "command": "nice -n 10 python tools/train_demo.py chat-distill --draft-init DIR "
                   f"--steps {distill['steps']} --cooldown-start {distill['cooldown_start']} "
                   f"--cooldown-steps {distill['cooldown_steps']}",
        "init": "DIR = the draft as shipped before the chat stages (git show f843e73:"
                "src/segcache/models/draft/...), its embedding grown by the 8 markup tokens",
        **distill,
        "greedy_agreement_before": before["greedy_agreement"],
        "greedy_agreement_after": agreement,
    }
    if args.bench_json:
        record["chat"]["end_to_end"] = json.loads(Path(args.bench_json).read_text())
    record["greedy_agreement"].update(agreement)
    record["greedy_agreement"]["note"] = (
        "rates of the chat-trained draft and target; earlier: models.draft.chat_distill."
        "greedy_agreement_before (distilled draft, pre-chat target) and models.draft.distill."
        "greedy_agreement_before (from-scratch draft)")
    if "chat format" not in record["description"]:
        record["description"] += (
            "; both were then taught the Qwen3.5 chat format with tool calls (models.target.chat, "
            "models.draft.chat_distill) and the target got a trained MTP head (models.target.mtp)")
    commands = [
        "python tools/train_demo.py chat-prepare",
        record["models"]["target"]["chat"]["command"],
        record["models"]["draft"]["chat_distill"]["command"] + "   # concurrently with:",
        record["models"]["target"]["mtp"]["command"],
        "python tools/train_demo.py chat-ship",
    ]
    record["commands"] = [c for c in record["commands"] if "chat" not in c and "mtp" not in c] \
        + commands
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / 'training.json'}", flush=True)
