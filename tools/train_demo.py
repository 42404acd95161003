"""Train segcache's two small demo models (hybrid target + dense draft) on CPU.

The corpus is the Python standard library's own source. The script trains a
byte-level BPE tokenizer, then a hybrid Gated-DeltaNet/attention ``qwen3_5``
target and a small ``llama`` draft with MLX, and writes both in mlx-lm's model
directory format under ``src/segcache/models/`` together with held-out texts
and ``training.json``.

Stages (each reproducible from fixed seeds)::

    python tools/train_demo.py prepare          # corpus, tokenizer, held-out texts
    python tools/train_demo.py train target     # hybrid target
    python tools/train_demo.py train draft      # dense draft
    python tools/train_demo.py finalize         # evaluate, agreement, training.json
    python tools/train_demo.py all              # everything above in order
    python tools/train_demo.py distill          # fine-tune the shipped draft toward the
                                                # target (KL on its next-token distributions)
    python tools/train_demo.py ship-distilled   # install it as draft/, update training.json

Chat stages (the Qwen3.5 chat format with tool calls; not shipped yet: see
``chat-merge``, whose trials show the trade-off that kept the target as it is)::

    python tools/train_demo.py chat-prepare     # chat tokenizer, dialogs, held-out dialogs
    python tools/train_demo.py chat-drills      # copy drills (short exchanges, no schemas)
    python tools/train_demo.py chat-train [--init DIR] [--chat-out NAME] [--drill-rows N]
    python tools/train_demo.py chat-merge [--chat-out NAME]   # pre + alpha (chat - pre):
                                                # code loss and parsed calls per alpha
    python tools/train_demo.py chat-distill     # the draft on the chat target
    python tools/train_demo.py mtp-train        # an MTP head on the chat target
    python tools/train_demo.py chat-ship        # install them, update training.json

The defaults are the settings the shipped models were trained with.
"""

from __future__ import annotations

import segcache  # noqa: I001  (must precede mlx: binds the system OpenBLAS)

print(f"segcache.BLAS = {segcache.BLAS}", flush=True)

import argparse  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training.common import DEFAULT_OUT_DIR, DEFAULT_WORK_DIR  # noqa: E402

# stage -> its module in tools/training (each has run(args)); imported when its stage runs,
# so a stage loads only what it needs. "all" is prepare, train target and draft, finalize.
STAGES = {
    "prepare": "prepare",
    "train": "train",
    "finalize": "finalize",
    "all": None,
    "distill": "distill",
    "ship-distilled": "ship_distilled",
    "chat-prepare": "chat_prepare",
    "chat-train": "chat_train",
    "chat-drills": "chat_drills",
    "chat-merge": "chat_merge",
    "chat-distill": "chat_distill",
    "mtp-train": "mtp",
    "chat-ship": "chat_ship",
}
DISTILL_OUT = DEFAULT_WORK_DIR / "distilled_draft"


def stage(name: str):
    """The module of stage ``name``."""
    return importlib.import_module(f"training.{STAGES[name]}")


def main(argv: list[str] | None = None) -> None:
    """Parses the command line and runs the requested stage(s)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("model", nargs="?", choices=["target", "draft"])
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR))
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR))
    parser.add_argument("--vocab-size", type=int, default=1536)
    parser.add_argument("--steps", type=int, help="optimizer steps (default per model)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-minutes", type=float, help="wall-time budget for one model")
    parser.add_argument("--cooldown-start", type=int,
                        help="fix the cooldown start step (replays a recorded run)")
    parser.add_argument("--cooldown-steps", type=int, help="fixed cooldown length")
    parser.add_argument("--time-based-cooldown", action="store_true",
                        help="decide the cooldown at run time (last 20%% of --steps or 80%% "
                             "of --max-minutes, whichever comes first), as the first run did")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--kl-weight", type=float, help="distill: weight of KL(target||draft)")
    parser.add_argument("--ce-weight", type=float, help="distill: weight of data CE")
    parser.add_argument("--layers", type=int, help="distill: keep the draft's first N layers")
    parser.add_argument("--draft-init", help="distill: warm-start draft directory: the "
                                             "from-scratch draft ('train draft' output)")
    parser.add_argument("--distill-out", default=str(DISTILL_OUT),
                        help="distill: output model directory")
    parser.add_argument("--bench-json", help="ship-distilled: measured speed to record")
    parser.add_argument("--init", help="chat stages: the target to start from (default: "
                                       "target/ of --out-dir)")
    parser.add_argument("--dialogs", type=int, help="chat-prepare: training dialogs to draw")
    parser.add_argument("--dialog-rows", type=int, help="chat: dialog windows per step")
    parser.add_argument("--code-rows", type=int, help="chat: code windows per step")
    parser.add_argument("--drill-rows", type=int, help="chat-train: copy-drill windows per step")
    parser.add_argument("--drills", type=int, help="chat-drills: conversations to draw")
    parser.add_argument("--teacher", help="chat-distill / mtp-train: the chat target "
                                          "(default: chat_target in the work dir)")
    parser.add_argument("--chat-out", default="chat_target",
                        help="chat-train: output directory name in the work dir; chat-merge: "
                             "the chat-trained target to merge")
    parser.add_argument("--alphas", help="chat-merge: comma-separated alphas to try")
    parser.add_argument("--dialog-weight", type=float,
                        help="chat: weight of the dialog loss (the code loss gets the rest)")
    args = parser.parse_args(argv)
    if args.stage == "train" and args.model is None:
        parser.error("train needs a model: target or draft")
    if args.stage == "distill" and args.draft_init is None:
        parser.error("distill needs --draft-init (the from-scratch draft directory)")
    if args.stage != "all":
        stage(args.stage).run(args)
        return
    stage("prepare").run(args)
    for name in ("target", "draft"):
        args.model = name
        stage("train").run(args)
    stage("finalize").run(args)


if __name__ == "__main__":
    main()
