"""Stage ``chat-merge``: pre + alpha (chat - pre); code loss and parsed calls per alpha."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten

import eval_demo
from training.chat_data import HELDOUT_DIALOGS_FILE
from training.corpus import validation_texts
from training.models import save_model_dir

MERGE_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# A candidate must call tools in a real agent loop: at least this share of the held-out
# tool-call turns must give a call that parses (eval_demo.call_turn_eval).
MIN_CALL_PARSE_RATE = 0.6


def merged(pre: nn.Module, chat: nn.Module, alpha: float) -> list[tuple[str, mx.array]]:
    """Weights pre + alpha (chat - pre); rows the pre-chat model lacks (new tokens) are chat's."""
    pre_w = dict(tree_flatten(pre.parameters()))
    out = []
    for name, value in tree_flatten(chat.parameters()):
        base = pre_w[name]
        if base.shape != value.shape:
            base = mx.concatenate([base, value[base.shape[0]:]])
        out.append((name, base + alpha * (value - base)))
    return out


def run(args) -> None:
    """Interpolates a chat-trained target with the pre-chat target; the trade-off per alpha.

    Weight averaging between a fine-tuned model and its start recovers some of what
    the fine-tune lost on the start's task while keeping some of the new skill. For
    each alpha of MERGE_ALPHAS (``--alphas`` overrides): the code loss on
    :func:`validation_texts` and on the shipped held-out texts (first
    EVAL_MAX_TOKENS tokens each, the pre-chat tokenizer's ids), and the tool-call
    turns of the held-out dialogs (``eval_demo.call_turn_eval``). An alpha passes when
    its validation losses are both at most the pre-chat target's and at least
    MIN_CALL_PARSE_RATE of its calls parse; the largest passing alpha is written to
    ``chat_merged``. The trials go to ``chat_merge.json`` in the work dir either way.
    """
    work, out = Path(args.work_dir), Path(args.out_dir)
    pre_dir = Path(args.init) if args.init else out / "target"
    chat_dir = work / args.chat_out
    pre, pre_tokenizer = mlx_lm.load(str(pre_dir))
    chat, tokenizer = mlx_lm.load(str(chat_dir))
    dialogs = json.loads((work / HELDOUT_DIALOGS_FILE).read_text())
    texts = {"validation": validation_texts(out),
             "heldout": {w: eval_demo.read_heldout_text(w, out) for w in eval_demo.HELDOUT_FILES}}
    # The pre-chat tokenizer's ids: both models read them alike (the chat vocabulary only
    # appends markup tokens), while the chat tokenizer's would give the pre-chat model
    # ids it lacks wherever the code spells the markup (mlx-lm's sources do).
    ids = {k: {w: eval_demo.eval_token_ids(pre_tokenizer, t) for w, t in v.items()}
           for k, v in texts.items()}

    def losses(model):
        return {k: {w: eval_demo.heldout_loss(model, i) for w, i in v.items()}
                for k, v in ids.items()}

    baseline = losses(pre)
    print(f"pre-chat code loss {baseline}", flush=True)
    alphas = [float(a) for a in args.alphas.split(",")] if args.alphas else MERGE_ALPHAS
    trials, chosen = [], None
    for alpha in alphas:
        candidate, _ = mlx_lm.load(str(chat_dir))
        candidate.load_weights(merged(pre, chat, alpha))
        loss = losses(candidate)
        calls = eval_demo.call_turn_eval(candidate, tokenizer, dialogs)
        kept = all(loss["validation"][w] <= baseline["validation"][w] for w in ids["validation"])
        calling = calls["parsed"] >= MIN_CALL_PARSE_RATE * calls["turns"]
        trials.append({"alpha": alpha, "code_loss": loss, "calls": calls,
                       "kept_code_quality": kept, "calls_tools": calling})
        print(json.dumps(trials[-1]), flush=True)
        if kept and calling:
            chosen = alpha
    stats = {"chat": args.chat_out, "alpha": chosen, "trials": trials,
             "pre_chat_code_loss": baseline,
             "validation": "first %d tokens of: held-out stdlib files not in heldout_stdlib.txt; "
                           "mlx-lm files not in heldout_other.txt" % eval_demo.EVAL_MAX_TOKENS,
             "rule": "the largest alpha whose validation losses are both <= the pre-chat "
                     f"target's and whose parsed calls are >= {MIN_CALL_PARSE_RATE} of the turns"}
    (work / "chat_merge.json").write_text(json.dumps(stats, indent=2))
    if chosen is None:
        raise SystemExit("no alpha both keeps the code loss at the pre-chat level and calls "
                         f"tools; the trials are in {work / 'chat_merge.json'}")
    chat.load_weights(merged(pre, chat, chosen))
    config = json.loads((chat_dir / "config.json").read_text())
    destination = work / "chat_merged"
    save_model_dir(chat, config, chat_dir, destination)
    (destination / "chat_merge.json").write_text(json.dumps(stats, indent=2))
    print(f"saved {destination}: alpha {chosen}", flush=True)
