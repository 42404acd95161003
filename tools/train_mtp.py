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

import segcache  # noqa: F401, I001  (binds OpenBLAS before mlx loads)

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm

from segcache.mtp import MTPHead, load_head, save_head

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training import mtp  # noqa: E402
from training.common import PACKAGE_MODELS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Trains (or with --eval-only, loads) a head, measures it and writes mtp_train.json."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(PACKAGE_MODELS / "target"))
    ap.add_argument("--init", help="a head file to continue from (default: a warm start)")
    ap.add_argument("--out", help="where to write the head (default: TARGET/mtp.safetensors)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--corpus", choices=("stdlib", "mlx-lm"), default="stdlib",
                    help="training text: this Python's standard library but the held-out files "
                         "(default), or mlx-lm's sources (then heldout_other.txt is not held out)")
    ap.add_argument("--eval-only", action="store_true")
    args = ap.parse_args(argv)
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
            mtp.warm_start(head, model)
        head.module.set_dtype(mx.float32)
        data = mtp.code_windows(tok, args.seq, args.corpus)
        print(f"training on {data.size:,} tokens ({args.corpus}); target frozen", flush=True)
        record["training"] = mtp.train_on_code(head, model, data, minutes=args.minutes,
                                               steps=args.steps, batch=args.batch, lr=args.lr,
                                               out=out, seed=args.seed)
        record["training"].update(batch=args.batch, seq=args.seq, lr=args.lr,
                                  init=args.init or "warm start",
                                  corpus=args.corpus, corpus_tokens=int(data.size),
                                  command=" ".join(["python", "tools/train_mtp.py", *sys.argv[1:]]))
        save_head(head, out, source="tools/train_mtp.py")
    record["heldout"] = mtp.acceptance(model, tok, head)
    print(json.dumps(record, indent=1), flush=True)
    out.with_name("mtp_train.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
