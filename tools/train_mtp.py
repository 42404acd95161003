"""Train an MTP head for a (frozen) target and measure its acceptance on held-out code.

    nice -n 10 python tools/train_mtp.py [--target DIR] [--init HEAD] [--minutes 30]
                                         [--out DIR/mtp.safetensors] [--eval-only]

The head at position t takes (the target's hidden state at t, after its final
norm; token t+1) and is trained toward the target's own next-token distribution
at t+1 (KL(target || head)), so it learns to predict what the target will say
(self-distillation: no labels, any text). Training text (--corpus): this
Python's standard library without the files of models/heldout_stdlib.txt (the
target's own domain), or mlx-lm's sources. The target stays frozen; the head
starts from --init (a head file) or, fresh, from the target's last
full-attention layer with `fc` passing the hidden state through. Runs for
--minutes (or --steps), checkpointing to --out as it goes.

Then the acceptance at draft depth 1, 2, 3 on held-out code (slices of
models/heldout_stdlib.txt, CPython's standard library files outside both the
target's and the head's training text): greedy MTP decoding through
segcache's decoder, depth 3, every round drafting 3; position j's acceptance is
the share of rounds that reached draft j and accepted it. Written next to the
head as mtp_train.json. Works for whatever target ships (any qwen3_5 /
qwen3_next model directory).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import sysconfig
import time
from pathlib import Path

import segcache  # noqa: F401, I001  (binds OpenBLAS before mlx loads)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
from mlx.utils import tree_flatten

from segcache.drafters import make_decoder
from segcache.mtp import MTPHead, forward_with_hidden, load_head, save_head
from segcache.mtp.module import _text_parts
from segcache.runtime import Runtime

MODELS = Path(segcache.__file__).resolve().parent / "models"


def warm_start(head: MTPHead, model) -> None:
    """The target's last full-attention layer as the head's layer; fc passes the hidden state through."""
    args, text_model, _, _ = _text_parts(model)
    last = [layer for layer in text_model.layers if not getattr(layer, "is_linear", False)][-1]
    head.module.layers[0].load_weights(list(tree_flatten(last.parameters())))
    eye = mx.eye(args.hidden_size)
    head.module.fc.weight = mx.concatenate([0.1 * eye, eye], axis=1)


def corpus(tok, seq: int, which: str) -> mx.array:
    """Training text: this Python's standard library ("stdlib": the target's own domain), but any
    file of models/heldout_stdlib.txt, or mlx-lm's sources ("mlx-lm": heldout_other.txt)."""
    if which == "stdlib":
        heldout = (MODELS / "heldout_stdlib.txt").read_text(encoding="utf-8")
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


def train(head: MTPHead, model, data: mx.array, *, minutes: float, steps: int, batch: int, lr: float,
          out: Path, seed: int) -> dict:
    mx.random.seed(seed)
    opt = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95], weight_decay=0.0)

    def loss(module, x, hidden, target_lp):
        logits, _ = head(hidden[:, :-1], x[:, 1:])
        lq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p = mx.exp(target_lp[:, 1:])
        return (p * (target_lp[:, 1:] - lq)).sum(-1).mean()  # KL(target || head)

    step_fn = nn.value_and_grad(head.module, loss)
    tic, losses, i = time.perf_counter(), [], 0
    while i < steps and time.perf_counter() - tic < 60 * minutes:
        x = data[mx.random.randint(0, data.shape[0], (batch,))]
        logits, hidden = forward_with_hidden(model, x)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        value, grads = step_fn(head.module, x, mx.stop_gradient(hidden), mx.stop_gradient(lp))
        frac = (time.perf_counter() - tic) / (60 * minutes)
        opt.learning_rate = lr * min(1.0, (i + 1) / 20) * max(0.05, 1 - frac)
        opt.update(head.module, grads)
        mx.eval(head.module.parameters(), opt.state)
        losses.append(value.item())
        i += 1
        if i % 25 == 0:
            recent = sum(losses[-25:]) / len(losses[-25:])
            print(f"step {i}: KL {recent:.3f} ({time.perf_counter() - tic:.0f} s)", flush=True)
            save_head(head, out, source="tools/train_mtp.py (checkpoint)")
    head.module.eval()
    return {"steps": i, "seconds": round(time.perf_counter() - tic), "final_kl": sum(losses[-25:]) / max(1, len(losses[-25:]))}


def acceptance(model, tok, head: MTPHead, *, prompts: int = 8, tokens: int = 48, depth: int = 3) -> dict:
    """Acceptance at draft positions 1..depth on held-out code, per file, through the decoder."""
    out = {}
    for name in ("heldout_stdlib.txt",):
        text = (MODELS / name).read_text(encoding="utf-8")
        rounds = []
        dec = make_decoder(model, num_draft_tokens=depth, mtp=head, gate=False, adaptive=False, one_row=True)
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
            per.append(round(sum(a >= j for _, a in reached) / len(reached), 3) if reached else None)
        out[name] = {"acceptance_at": per, "tokens_per_round": round(
            sum(a + 1 for _, a in rounds) / len(rounds), 3), "rounds": len(rounds)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(MODELS / "target"))
    ap.add_argument("--init", help="a head file to continue from (default: a warm start)")
    ap.add_argument("--out", help="where to write the head (default: TARGET/mtp.safetensors)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--corpus", choices=("stdlib", "mlx-lm"), default="stdlib",
                    help="training text: this Python's standard library but the held-out files (default), "
                         "or mlx-lm's sources (then heldout_other.txt is not held out)")
    ap.add_argument("--eval-only", action="store_true")
    args = ap.parse_args()
    model, tok = mlx_lm.load(args.target)
    out = Path(args.out) if args.out else Path(args.target) / "mtp.safetensors"
    record = {"target": Path(args.target).name}
    if args.eval_only:
        head = load_head(model, mtp_weights=args.init or out)
    else:
        if args.init:
            head = load_head(model, mtp_weights=args.init)
        else:
            head = MTPHead.build(model)
            warm_start(head, model)
        head.module.set_dtype(mx.float32)
        data = corpus(tok, args.seq, args.corpus)
        print(f"training on {data.size:,} tokens ({args.corpus}); target frozen", flush=True)
        record["training"] = train(head, model, data, minutes=args.minutes, steps=args.steps, batch=args.batch,
                                   lr=args.lr, out=out, seed=args.seed)
        record["training"].update(batch=args.batch, seq=args.seq, lr=args.lr, init=args.init or "warm start",
                                  corpus=args.corpus, corpus_tokens=int(data.size),
                                  command=" ".join(["python", "tools/train_mtp.py", *sys.argv[1:]]))
        save_head(head, out, source="tools/train_mtp.py")
    record["heldout"] = acceptance(model, tok, head)
    print(json.dumps(record, indent=1), flush=True)
    out.with_name("mtp_train.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
