"""Stage ``chat-drills``: copy drills (short exchanges, no schemas) from the training files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import demo_dialogs
from training.chat_data import CHAT_DEFAULTS, chat_workspaces
from training.common import EOS_TOKEN, settings
from training.tokenizer import load_chat_tokenizer


def run(args) -> None:
    """Copy drills (``demo_dialogs.drill``) from the training files: ``chat_drills.npz``."""
    work = Path(args.work_dir)
    chosen = settings(CHAT_DEFAULTS, args)
    tokenizer = load_chat_tokenizer(work / "chat_tokenizer")
    train_ws, _ = chat_workspaces()
    maker = demo_dialogs.DialogMaker(train_ws, chosen["seed"] + 2)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids, mask, starts = [], [], []
    while len(starts) < chosen["drills"]:
        tokens, weights = demo_dialogs.render(tokenizer, demo_dialogs.drill(maker))
        starts.append(len(ids))
        ids += tokens + [eos]
        mask += weights + [0]
    np.savez(work / "chat_drills.npz", ids=np.array(ids, dtype=np.uint16),
             mask=np.array(mask, dtype=np.uint8), starts=np.array(starts, dtype=np.int64))
    stats = {"drills": len(starts), "tokens": len(ids), "assistant_tokens": int(sum(mask)),
             "seed": chosen["seed"] + 2}
    (work / "chat_drills.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats), flush=True)
