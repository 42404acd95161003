"""The MTP head's training, once: stage ``mtp-train`` (on chat batches) and ``tools/train_mtp.py``.

Both train a head for a frozen target toward the target's own next-token
distributions (self-distillation): the head at position ``t`` takes (the
target's final hidden state at ``t``, token ``t+1``) and predicts the token at
``t+2``, starting from a copy of the target's last full-attention layer. The
stage trains on the chat batches with KL + CE and a warmup-stable-decay
schedule; ``train_mtp.py`` on plain code windows with KL alone and a schedule
sized by the wall clock. Both run :func:`training.loop.train_loop`.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
from mlx.utils import tree_flatten

from segcache.drafters import make_decoder
from segcache.mtp import MTPHead, forward_with_hidden, save_head
from segcache.runtime import Runtime
from training.chat_data import ChatBatches, FixedKV, FrozenForward, chat_batches, train_on_chat
from training.common import PACKAGE_MODELS, SEED, seed_everything, settings
from training.loop import WallClockSchedule, compiled_step, summary, train_loop
from training.losses import cross_entropy, kl, log_softmax
from training.models import count_parameters, train_gdn_in_chunks

# The head is judged on code (acceptance on held-out code), so its batches lean to code.
MTP_DEFAULTS = {"steps": 4000, "dialog_rows": 1, "code_rows": 3, "seq_len": 512, "lr": 2e-3,
                "warmup": 20, "max_minutes": 20.0, "seed": SEED + 6, "kl_weight": 1.0,
                "ce_weight": 0.1, "dialog_weight": 0.25,
                "cooldown_start": None, "cooldown_steps": None}


def init_head_from_target(head: MTPHead, target: nn.Module) -> None:
    """Starts the head's decoder layer as a copy of the target's last full-attention layer."""
    source = [layer for layer in target.layers if not getattr(layer, "is_linear", False)][-1]
    head.module.layers[0].load_weights(list(tree_flatten(source.parameters())), strict=True)


def warm_start(head: MTPHead, target: nn.Module) -> None:
    """:func:`init_head_from_target`, and ``fc`` passing the hidden state through."""
    init_head_from_target(head, target)
    eye = mx.eye(head.module.fc.weight.shape[0])
    head.module.fc.weight = mx.concatenate([0.1 * eye, eye], axis=1)


def head_terms(head: MTPHead, hidden, tokens, t_logp, labels, caches=None):
    """Per pair: KL(target || head), the head's CE on ``labels`` and greedy agreement."""
    logits, _ = head(hidden, tokens, caches)
    q = log_softmax(logits)
    agree = (mx.argmax(q, axis=-1) == mx.argmax(t_logp, axis=-1)).astype(mx.float32)
    return kl(t_logp, q), cross_entropy(q, labels), agree


def mtp_train_model(head: MTPHead, target: nn.Module, batches: ChatBatches, *, settings: dict,
                    checkpoint, checkpoint_every: int, log_every: int = 10) -> dict:
    """Trains the MTP head on the frozen target's own hidden states and distributions.

    The head at position ``t`` takes (target hidden at ``t``, token ``t+1``) and is
    trained toward the target's next-token distribution at ``t+1`` (the token at
    ``t+2``): ``kl_weight`` x KL(target || head) + ``ce_weight`` x CE(data). Dialog
    rows count the pairs whose predicted token is an assistant token, code rows
    every pair. On a dialog batch the head first runs over the system turn's pairs
    (no gradient), so its attention sees the same context as when drafting.
    """
    optimizer = optim.AdamW(learning_rate=settings["lr"], betas=[0.9, 0.95], weight_decay=0.0)
    frozen = FrozenForward(target)
    kl_w, ce_w, dw = settings["kl_weight"], settings["ce_weight"], settings["dialog_weight"]
    rows = settings["dialog_rows"]

    def loss_fn(module, state, hd, td, pd, ld, wd, hc, tc, pc, lc):
        caches = [FixedKV(mx.broadcast_to(k, (rows, *k.shape[1:])),
                          mx.broadcast_to(v, (rows, *v.shape[1:]))) for k, v in state] \
            if state else None
        kl_d, ce_d, agree = head_terms(head, hd, td, pd, ld, caches)
        weight = wd / mx.maximum(wd.sum(), 1.0)
        klc, cec, agreec = head_terms(head, hc, tc, pc, lc)
        loss = dw * ((kl_w * kl_d + ce_w * ce_d) * weight).sum() + \
            (1 - dw) * (kl_w * klc + ce_w * cec).mean()
        return loss, (kl_d * weight).sum(), (agree * weight).sum(), agreec.mean()

    step = compiled_step(head.module, optimizer, loss_fn)

    def step_fn(prefix, x, y, mask, xc, yc):
        hidden, t_logp = frozen.hidden_and_logprobs(prefix, x)
        hidden_c, tc_logp = frozen.hidden_and_logprobs(None, xc)
        state = []
        if prefix is not None:
            _, prefix_hidden = frozen.prefix(prefix)
            head_cache = head.make_cache()
            # the system turn's pairs (hidden t, token t+1); its last pairs with the body's
            # first token (every dialog body starts with the same <|im_start|>)
            nxt = mx.concatenate([prefix[:, 1:], x[:1, :1]], axis=1)
            head(prefix_hidden, nxt, head_cache)
            state = [(mx.stop_gradient(c.keys[..., :c.offset, :]),
                      mx.stop_gradient(c.values[..., :c.offset, :])) for c in head_cache]
        inputs = (state, hidden[:, :-1], y[:, :-1], t_logp[:, 1:], y[:, 1:], mask[:, 1:],
                  hidden_c[:, :-1], yc[:, :-1], tc_logp[:, 1:], yc[:, 1:])
        mx.eval(inputs)
        return step(*inputs)

    head.module.train()
    run = train_on_chat(step_fn, optimizer, batches, settings, checkpoint=checkpoint,
                        checkpoint_every=checkpoint_every, log_every=log_every,
                        loss_names=("loss", "dialog_kl", "dialog_agree", "code_agree"))
    head.module.eval()
    return summary(run, {
        "dialog_rows": rows, "code_rows": settings["code_rows"],
        "loss": f"{dw} x (dialog rows' assistant tokens) + {1 - dw} x (code rows) of "
                f"{kl_w} x KL(target at t+1 || head at t) + {ce_w} x CE(token t+2), "
                "nats/token, temperature 1",
        "input": "the target's final hidden state (after its final norm) at t and token t+1",
        "init": "decoder layer copied from the target's last full-attention layer; norms "
                "and fc as mlx initialises them",
        "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0), grad clip 1.0",
    }, seed=settings["seed"],
        finals=("final_train_loss", "final_train_dialog_kl", "final_train_dialog_agreement",
                "final_train_code_agreement"))


def run(args) -> None:
    """Trains an MTP head for the (frozen) chat target; writes ``mtp_head`` in the work dir."""
    work = Path(args.work_dir)
    chosen = settings(MTP_DEFAULTS, args)
    train_gdn_in_chunks()
    seed_everything(chosen["seed"])
    target_dir = Path(args.teacher) if args.teacher else work / "chat_target"
    target, _ = mlx_lm.load(str(target_dir))
    head = MTPHead.build(target)
    init_head_from_target(head, target)
    mx.eval(head.module.parameters())
    batches = chat_batches(work, chosen)
    n_params = count_parameters(head.module)
    print(f"mtp-train: head of {n_params:,} parameters on {target_dir}; settings {chosen}",
          flush=True)
    destination = work / "mtp_head"
    destination.mkdir(parents=True, exist_ok=True)

    def checkpoint(step, loss):
        save_head(head, destination / "checkpoint.safetensors", source=f"step {step}")

    stats = mtp_train_model(head, target, batches, settings=chosen, checkpoint=checkpoint,
                            checkpoint_every=args.checkpoint_every)
    save_head(head, destination / "mtp.safetensors",
              source="tools/train_demo.py mtp-train (segcache demo target)")
    stats.update(target=str(target_dir), parameters=n_params,
                 max_minutes=chosen["max_minutes"], kl_weight=chosen["kl_weight"],
                 ce_weight=chosen["ce_weight"], dialog_weight=chosen["dialog_weight"])
    (destination / "mtp_train.json").write_text(json.dumps(stats, indent=2))
    print(f"saved {destination}; final loss {stats['final_train_loss']:.4f}, dialog agreement "
          f"{stats['final_train_dialog_agreement']:.3f}, code agreement "
          f"{stats['final_train_code_agreement']:.3f}, {stats['wall_time_s'] / 60:.1f} min",
          flush=True)


# ------------------------------------------------------------------ tools/train_mtp.py


def code_windows(tok, seq: int, which: str) -> mx.array:
    """Training text: this Python's standard library ("stdlib": the target's own domain), but any
    file of models/heldout_stdlib.txt, or mlx-lm's sources ("mlx-lm": heldout_other.txt)."""
    if which == "stdlib":
        heldout = (PACKAGE_MODELS / "heldout_stdlib.txt").read_text(encoding="utf-8")
        root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        for f in sorted(glob.glob(str(root / "**" / "*.py"), recursive=True)):
            if "site-packages" in f:
                continue
            text = Path(f).read_text(encoding="utf-8", errors="replace")
            if len(text) > 400 and text[:400] not in heldout:
                files.append(text)
    else:
        src = Path(mlx_lm.__file__).parent
        files = [Path(f).read_text(encoding="utf-8", errors="replace")
                 for f in sorted(glob.glob(str(src / "**" / "*.py"), recursive=True))]
    ids = tok.encode("\n".join(files)[:4_000_000])  # ~1.4M tokens: enough for a short run
    n = (len(ids) // seq) * seq
    return mx.array(ids[:n]).reshape(-1, seq)


def train_on_code(head: MTPHead, model, data: mx.array, *, minutes: float, steps: int, batch: int,
                  lr: float, out: Path, seed: int) -> dict:
    """Trains ``head`` toward KL(target || head) on random rows of ``data`` for ``minutes``
    (or ``steps``), checkpointing to ``out`` every 25 steps (no gradient clipping)."""
    mx.random.seed(seed)
    opt = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95], weight_decay=0.0)

    def log_probs(logits):  # in the model's own dtype, as this tool always did
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def loss(module, x, hidden, target_lp):
        logits, _ = head(hidden[:, :-1], x[:, 1:])
        return kl(target_lp[:, 1:], log_probs(logits)).mean()

    loss_and_grad = nn.value_and_grad(head.module, loss)
    values = []

    def step_fn(x):
        logits, hidden = forward_with_hidden(model, x)
        value, grads = loss_and_grad(head.module, x, mx.stop_gradient(hidden),
                                     mx.stop_gradient(log_probs(logits)))
        opt.update(head.module, grads)
        mx.eval(head.module.parameters(), opt.state)
        values.append(value.item())
        return values[-1], None

    def rows():
        while True:
            yield (data[mx.random.randint(0, data.shape[0], (batch,))],)

    def checkpoint(step, loss):
        save_head(head, out, source="tools/train_mtp.py (checkpoint)")

    run = train_loop(step_fn, opt, rows(),
                     schedule=WallClockSchedule(steps=steps, lr=lr, max_minutes=minutes),
                     batch=batch, seq_len=data.shape[1], checkpoint=checkpoint,
                     checkpoint_every=25, log_every=25, loss_names=("KL",))
    head.module.eval()
    recent = values[-25:]
    return {"steps": run.stats["steps"], "seconds": round(run.timing["wall_time_s"]),
            "final_kl": sum(recent) / max(1, len(recent))}


def acceptance(model, tok, head: MTPHead, *, prompts: int = 8, tokens: int = 48,
               depth: int = 3) -> dict:
    """Acceptance at draft positions 1..depth on held-out code, per file, through the decoder."""
    out = {}
    for name in ("heldout_stdlib.txt",):
        text = (PACKAGE_MODELS / name).read_text(encoding="utf-8")
        rounds = []
        dec = make_decoder(model, num_draft_tokens=depth, mtp=head, gate=False, adaptive=False,
                           one_row=True)
        for i in range(prompts):
            ids = tok.encode(text[i * 3000 : i * 3000 + 400])
            rt = Runtime(model)
            rt.forward(ids[:-1])
            dec.add(i, rt, ids[-1], max_tokens=tokens)
            while not dec.rows[i].finished:
                dec.step()
            s = dec.rows[i].stats
            rounds += list(zip(s.drafted_per_round, s.accepted_per_round))
            dec.remove(i)
        per = []
        for j in range(1, depth + 1):
            reached = [(d, a) for d, a in rounds if d >= j and a >= j - 1]
            per.append(round(sum(a >= j for _, a in reached) / len(reached), 3)
                       if reached else None)
        out[name] = {"acceptance_at": per, "tokens_per_round": round(
            sum(a + 1 for _, a in rounds) / len(rounds), 3), "rounds": len(rounds)}
    return out
