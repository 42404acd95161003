"""Stage ``chat-distill``: the draft distilled from the chat target (``chat_draft``)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm

from training.chat_data import ChatBatches, FrozenForward, caches_from_state, chat_batches
from training.chat_data import prefix_state, train_on_chat
from training.common import SEED, seed_everything, settings
from training.loop import compiled_step, summary
from training.losses import cross_entropy, kl, log_softmax
from training.models import checkpointer, count_parameters, extend_vocab, save_checked
from training.models import train_gdn_in_chunks
from training.tokenizer import chat_vocab_size

CHAT_DISTILL_DEFAULTS = {"steps": 4000, "dialog_rows": 2, "code_rows": 2, "seq_len": 512,
                         "lr": 1e-3, "warmup": 20, "max_minutes": 20.0, "seed": SEED + 5,
                         "kl_weight": 1.0, "ce_weight": 0.1, "dialog_weight": 0.5,
                         "cooldown_start": None, "cooldown_steps": None}


def chat_distill_model(student: nn.Module, teacher: nn.Module, batches: ChatBatches, *,
                       settings: dict, checkpoint, checkpoint_every: int,
                       log_every: int = 10) -> dict:
    """Distils ``teacher`` into ``student`` on chat batches.

    Loss per predicted token: ``kl_weight`` x KL(teacher || student) + ``ce_weight``
    x CE(data); dialog rows count their assistant tokens, code rows every token, and
    the two are weighted ``dialog_weight`` / the rest. The system turns run once per
    step for the student (no gradient) and once per variant for the frozen teacher.
    """
    optimizer = optim.AdamW(learning_rate=settings["lr"], betas=[0.9, 0.95], weight_decay=0.0)
    frozen = FrozenForward(teacher)
    kl_w, ce_w, dw = settings["kl_weight"], settings["ce_weight"], settings["dialog_weight"]
    rows = settings["dialog_rows"]

    def terms(logits, t_logp, y):
        s_logp = log_softmax(logits)
        return kl(t_logp, s_logp), cross_entropy(s_logp, y)

    def loss_fn(model, state, x, y, mask, t_logp, xc, yc, tc_logp):
        caches = caches_from_state(model, state, rows) if state else None
        kl_d, ce_d = terms(model(x, cache=caches), t_logp, y)
        weight = mask / mx.maximum(mask.sum(), 1.0)
        dialog_kl, dialog_ce = (kl_d * weight).sum(), (ce_d * weight).sum()
        klc, cec = terms(model(xc), tc_logp, yc)
        code_kl, code_ce = klc.mean(), cec.mean()
        loss = dw * (kl_w * dialog_kl + ce_w * dialog_ce) + \
            (1 - dw) * (kl_w * code_kl + ce_w * code_ce)
        return loss, dialog_kl, code_kl

    step = compiled_step(student, optimizer, loss_fn)

    def step_fn(prefix, x, y, mask, xc, yc):
        _, t_logp = frozen.hidden_and_logprobs(prefix, x)
        _, tc_logp = frozen.hidden_and_logprobs(None, xc)
        state = prefix_state(student, prefix) if prefix is not None else []
        mx.eval(t_logp, tc_logp, state)
        return step(state, x, y, mask, t_logp, xc, yc, tc_logp)

    student.train()
    run = train_on_chat(step_fn, optimizer, batches, settings, checkpoint=checkpoint,
                        checkpoint_every=checkpoint_every, log_every=log_every,
                        loss_names=("loss", "dialog_kl", "code_kl"))
    student.eval()
    return summary(run, {
        "dialog_rows": rows, "code_rows": settings["code_rows"],
        "loss": f"{dw} x (dialog rows' assistant tokens) + {1 - dw} x (code rows) of "
                f"{kl_w} x KL(target || draft) + {ce_w} x CE(data), nats/token, temperature 1",
        "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0), grad clip 1.0",
    }, seed=settings["seed"],
        finals=("final_train_loss", "final_train_dialog_kl", "final_train_code_kl"))


def run(args) -> None:
    """Distils the chat target into the draft; writes ``chat_draft`` in the work dir.

    Warm start: ``--draft-init`` (default: ``draft/`` of the models dir; the shipped
    run started from the draft as shipped before the chat stages), its vocabulary
    grown to the chat tokenizer's. Teacher: ``--teacher`` (default: ``chat_target``).
    """
    work, out = Path(args.work_dir), Path(args.out_dir)
    chosen = settings(CHAT_DISTILL_DEFAULTS, args)
    train_gdn_in_chunks()
    seed_everything(chosen["seed"])
    tokenizer_dir = work / "chat_tokenizer"
    vocab_size = chat_vocab_size(tokenizer_dir)
    teacher_dir = Path(args.teacher) if args.teacher else work / "chat_target"
    init = Path(args.draft_init) if args.draft_init else out / "draft"
    teacher, _ = mlx_lm.load(str(teacher_dir))
    student, _ = mlx_lm.load(str(init))
    config = json.loads((init / "config.json").read_text())
    student, config = extend_vocab(student, config, vocab_size, chosen["seed"])
    config["eos_token_id"] = json.loads((teacher_dir / "config.json").read_text())["eos_token_id"]
    batches = chat_batches(work, chosen)
    print(f"chat-distill: {init} <- {teacher_dir}; settings {chosen}", flush=True)
    checkpoint = checkpointer(student, config, tokenizer_dir, work / "chat_draft_checkpoint")
    stats = chat_distill_model(student, teacher, batches, settings=chosen,
                               checkpoint=checkpoint, checkpoint_every=args.checkpoint_every)
    destination = work / "chat_draft"
    save_checked(student, config, tokenizer_dir, destination, vocab_size, out)
    stats.update(init=str(init), teacher=str(teacher_dir), max_minutes=chosen["max_minutes"],
                 kl_weight=chosen["kl_weight"], ce_weight=chosen["ce_weight"],
                 dialog_weight=chosen["dialog_weight"], parameters=count_parameters(student))
    (destination / "chat_distill.json").write_text(json.dumps(stats, indent=2))
    print(f"saved {destination}; final loss {stats['final_train_loss']:.4f}, "
          f"{stats['wall_time_s'] / 60:.1f} min", flush=True)
