"""Train a DFlash block drafter for a (frozen) target and measure it on held-out code.

    nice -n 19 python tools/train_dflash.py [--target DIR] [--minutes 32] [--layers 1]
                                            [--taps 1,3] [--out DIR/dflash] [--eval-only]
                                            [--kl 0.5] [--no-warm] [--data-cache FILE.npy]

The data are the target's own greedy continuations (--cont tokens) of --sequences code
windows of --prompt tokens from this Python's standard library without the files of
models/heldout_stdlib.txt (tools/training/mtp.py's corpus); the drafter reads the outputs
of target layers --taps and is trained with the position-decayed cross-entropy of the
reference recipe plus --kl times KL(target || drafter) on blocks of 4, 8 and 16 at random
anchors of the continuations, from a warm start (the target's last full-attention layer;
--no-warm: fresh) (tools/training/dflash.py). --data-cache keeps the greedy data (the slow
part) for a rerun with other training settings. The result is a checkpoint in the published layout
(config.json with dflash_config + model.safetensors, float16 by default), and
dflash_train.json beside it: how it was trained, and tokens per round and acceptance per
block position at B = 4, 8, 16 on held-out code (ungated greedy DFlash decoding).
"""

from __future__ import annotations

import segcache  # noqa: F401, I001  (binds OpenBLAS before mlx loads)

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np

from segcache.dflash.load import load_dflash, read_module, save_dflash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training import dflash, mtp  # noqa: E402
from training.common import PACKAGE_MODELS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(PACKAGE_MODELS / "target"))
    ap.add_argument("--out", help="the checkpoint directory (default: TARGET/../dflash)")
    ap.add_argument("--minutes", type=float, default=32.0)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--taps", default="1,3", help="target layers whose outputs the drafter reads")
    ap.add_argument("--block-size", type=int, default=8, help="the config's default block size")
    ap.add_argument("--sequences", type=int, default=2000)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--cont", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--kl", type=float, default=0.5, help="weight of KL(target || drafter) beside the CE")
    ap.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                    help="start from the target's last full-attention layer (default; --no-warm: fresh)")
    ap.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warmup")
    ap.add_argument("--data-cache", help="a .npy of the greedy data: read if it exists, else written")
    ap.add_argument("--float32", action="store_true", help="ship float32 weights (default float16)")
    ap.add_argument("--eval-only", action="store_true")
    args = ap.parse_args(argv)
    model, tok = mlx_lm.load(args.target)
    out = Path(args.out) if args.out else Path(args.target).parent / "dflash"
    record: dict = {"target": Path(args.target).name}
    if not args.eval_only:
        taps = tuple(int(t) for t in args.taps.split(","))
        cfg = dflash.drafter_config(model, layers=args.layers, taps=taps, block_size=args.block_size)
        t0 = time.time()
        cache = Path(args.data_cache) if args.data_cache else None
        if cache is not None and cache.exists():
            data = mx.array(np.load(cache))
            if data.shape != (args.sequences, args.prompt + args.cont):
                raise SystemExit(f"{cache} holds {data.shape}, not {args.sequences} x {args.prompt + args.cont}")
        else:
            windows = mtp.code_windows(tok, args.prompt, "stdlib")
            mx.random.seed(args.seed)
            windows = windows[mx.random.permutation(windows.shape[0])[: args.sequences]]
            data = dflash.greedy_data(model, windows, prompt=args.prompt, cont=args.cont, seed=args.seed)
            if cache is not None:
                np.save(cache, np.array(data))
        hidden, log_probs = dflash.tapped_states(model, data, taps, log_probs=args.kl > 0)
        print(f"{data.shape[0]} sequences of {data.shape[1]} tokens (greedy continuations) in "
              f"{time.time() - t0:.0f}s; target frozen", flush=True)
        module, stats = dflash.train(model, cfg, data, hidden, prompt=args.prompt, minutes=args.minutes,
                                     steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr,
                                     gamma=args.gamma, out=out, seed=args.seed, log_probs=log_probs,
                                     kl=args.kl, warm=args.warm, warmup=args.warmup)
        if not args.float32:
            module.set_dtype(mx.float16)
        save_dflash(module, cfg, out)
        record["training"] = dict(stats, tool="tools/train_dflash.py (target frozen; position-decayed CE on the "
                                  "target's greedy continuations)", layers=args.layers, taps=list(taps),
                                  sequences=args.sequences, prompt=args.prompt, cont=args.cont, batch=args.batch,
                                  anchors=args.anchors, lr=args.lr, gamma=args.gamma, kl=args.kl,
                                  warm=args.warm, warmup=args.warmup,
                                  data_seconds=round(time.time() - t0 - stats["seconds"]),
                                  dtype="float32" if args.float32 else "float16",
                                  command="nice -n 19 python tools/train_dflash.py " + " ".join(argv or sys.argv[1:]))
    read_module(out)  # the written checkpoint loads in the published layout
    drafter = load_dflash(out, model)
    record["heldout_stdlib"] = dflash.acceptance(model, tok, drafter)
    (out / "dflash_train.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["heldout_stdlib"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
