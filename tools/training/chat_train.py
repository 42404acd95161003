"""Stage ``chat-train``: the target trained further on chat batches (``chat_target``)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm

from training.chat_data import CHAT_DEFAULTS, ChatBatches, caches_from_state, chat_batches
from training.chat_data import prefix_state, train_on_chat
from training.common import EOS_TOKEN, seed_everything, settings
from training.loop import WSD, compiled_step, summary
from training.models import checkpointer, extend_vocab, save_checked, train_gdn_in_chunks
from training.tokenizer import CHAT_EOS, load_chat_tokenizer


def chat_train_model(model: nn.Module, batches: ChatBatches, *, settings: dict, checkpoint,
                     checkpoint_every: int, log_every: int = 10) -> dict:
    """Trains ``model`` further on chat batches (AdamW, warmup-stable-decay).

    Per step: the variant's system turn runs once (no gradient: its tokens carry no
    loss, and the gradient through its keys/values into later tokens is dropped),
    the dialog bodies run on top of it, and the code windows run alone.
    """
    optimizer = optim.AdamW(learning_rate=settings["lr"], betas=[0.9, 0.95],
                            weight_decay=0.1)
    weight = settings["dialog_weight"]
    rows = settings["dialog_rows"]

    def loss_fn(model, state, x, y, mask, xc, yc, drills):
        caches = caches_from_state(model, state, rows) if state else None
        ce = nn.losses.cross_entropy(model(x, cache=caches).astype(mx.float32), y,
                                     reduction="none")
        ce_sum, count = (ce * mask).sum(), mask.sum()
        if drills:  # the copy drills count as dialog tokens
            xd, yd, md = drills
            ced = nn.losses.cross_entropy(model(xd).astype(mx.float32), yd, reduction="none")
            ce_sum, count = ce_sum + (ced * md).sum(), count + md.sum()
        dialog_ce = ce_sum / mx.maximum(count, 1.0)
        code_ce = nn.losses.cross_entropy(model(xc).astype(mx.float32), yc, reduction="mean")
        return weight * dialog_ce + (1.0 - weight) * code_ce, dialog_ce, code_ce

    step = compiled_step(model, optimizer, loss_fn)

    def step_fn(prefix, x, y, mask, xc, yc, *drills):
        state = prefix_state(model, prefix) if prefix is not None else []
        return step(state, x, y, mask, xc, yc, list(drills))

    model.train()
    run = train_on_chat(step_fn, optimizer, batches, settings, checkpoint=checkpoint,
                        checkpoint_every=checkpoint_every, log_every=log_every,
                        loss_names=("loss", "dialog", "code"))
    model.eval()
    return summary(run, {
        "dialog_rows": rows, "code_rows": settings["code_rows"],
        "drill_rows": settings["drill_rows"],
        "loss": f"{weight} x CE over the dialog and drill rows' assistant tokens + "
                f"{1 - weight} x CE over the code rows, nats/token",
        "system_turn": "computed once per step without gradient; the dialog rows run on it",
        "schedule": WSD,
        "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1), grad clip 1.0",
    }, seed=settings["seed"],
        finals=("final_train_loss", "final_train_dialog_ce", "final_train_code_ce"))


def run(args) -> None:
    """Trains the target further on chat batches; writes ``chat_target`` in the work dir.

    Warm start: ``--init`` (default: ``target/`` of the models dir; the shipped run
    started from the target as shipped before the chat stages), its vocabulary
    grown to the chat tokenizer's.
    """
    work, out = Path(args.work_dir), Path(args.out_dir)
    chosen = settings(CHAT_DEFAULTS, args)
    train_gdn_in_chunks()
    seed_everything(chosen["seed"])
    init = Path(args.init) if args.init else out / "target"
    tokenizer_dir = work / "chat_tokenizer"
    tokenizer = load_chat_tokenizer(tokenizer_dir)
    vocab_size = len(tokenizer.get_vocab())
    model, _ = mlx_lm.load(str(init))
    config = json.loads((init / "config.json").read_text())
    model, config = extend_vocab(model, config, vocab_size, chosen["seed"])
    config["eos_token_id"] = [tokenizer.convert_tokens_to_ids(CHAT_EOS),
                              tokenizer.convert_tokens_to_ids(EOS_TOKEN)]
    batches = chat_batches(work, chosen, drill_rows=chosen["drill_rows"])
    print(f"chat-train: from {init}, vocab {vocab_size}; settings {chosen}", flush=True)
    destination = work / args.chat_out
    checkpoint = checkpointer(model, config, tokenizer_dir, work / f"{args.chat_out}_checkpoint")
    stats = chat_train_model(model, batches, settings=chosen, checkpoint=checkpoint,
                             checkpoint_every=args.checkpoint_every)
    save_checked(model, config, tokenizer_dir, destination, vocab_size, out)
    stats.update(init=str(init), max_minutes=chosen["max_minutes"],
                 dialog_weight=chosen["dialog_weight"], vocab_size=vocab_size,
                 settings={k: v for k, v in chosen.items()
                           if k not in ("cooldown_start", "cooldown_steps")})
    (destination / "chat_train.json").write_text(json.dumps(stats, indent=2))
    print(f"saved {destination}; final loss {stats['final_train_loss']:.4f} (dialog "
          f"{stats['final_train_dialog_ce']:.4f}, code {stats['final_train_code_ce']:.4f}), "
          f"{stats['wall_time_s'] / 60:.1f} min", flush=True)
