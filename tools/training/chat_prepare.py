"""Stage ``chat-prepare``: chat tokenizer, code stream, training and held-out dialogs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

import demo_dialogs
from training.chat_data import (CHAT_DEFAULTS, HELDOUT_DIALOGS, HELDOUT_DIALOGS_FILE, chat_code,
                                chat_workspaces, split_prefix)
from training.common import settings
from training.tokenizer import (CHAT_MARKUP_TOKENS, CHAT_SPECIAL_TOKENS, CHAT_EOS,
                                CHAT_TEMPLATE_FILE, chat_tokenizer, load_chat_tokenizer)


def run(args) -> None:
    """Chat tokenizer, code stream, training dialogs and held-out dialogs, in the work dir.

    Dialogs are stored by their system turn ("variant": tools offered or not, a
    system message or not): the system turn once per variant, and the rest of each
    dialog (the body: queries, calls, results, answers) packed into the variant's
    stream. Training computes a variant's system turn once per step and runs the
    bodies on top of it (:class:`ChatBatches`), so the ~500-token tool schemas are
    not recomputed, with gradients, for every row.
    """
    work, out = Path(args.work_dir), Path(args.out_dir)
    chosen = settings(CHAT_DEFAULTS, args)
    base = Path(args.init) if args.init else out / "target"
    tokenizer_dir = work / "chat_tokenizer"
    chat_tokenizer(base, out / CHAT_TEMPLATE_FILE, tokenizer_dir)
    tokenizer = load_chat_tokenizer(tokenizer_dir)
    code = chat_code(work)
    train_ws, heldout_ws = chat_workspaces()
    maker = demo_dialogs.DialogMaker(train_ws, chosen["seed"])
    limit = chosen["seq_len"]

    def body_length(dialog):
        tokens, _ = demo_dialogs.render(tokenizer, dialog)
        return len(tokens) - split_prefix(tokenizer, dialog, tokens)

    def fits(dialog):
        return body_length(dialog) <= limit

    variants: dict[str, dict] = {}
    kinds, lengths, count = {}, [], 0
    start = time.time()
    while count < chosen["dialogs"]:
        dialog = maker.dialog(fits)
        tokens, weights = demo_dialogs.render(tokenizer, dialog)
        cut = split_prefix(tokenizer, dialog, tokens)
        if len(tokens) - cut > limit:  # a single query too long for a window: draw another
            continue
        key = (f"tools={int(dialog['tools'] is not None)},"
               f"system={int(dialog['messages'][0]['role'] == 'system')}")
        v = variants.setdefault(key, {"prefix": tokens[:cut], "ids": [], "mask": [],
                                      "starts": []})
        assert v["prefix"] == tokens[:cut], f"variant {key}: a different system turn"
        v["starts"].append(len(v["ids"]))
        v["ids"] += tokens[cut:]
        v["mask"] += weights[cut:]
        lengths.append(len(tokens) - cut)
        count += 1
        for kind in dialog["kinds"]:
            kinds[kind] = kinds.get(kind, 0) + 1
        if count % 500 == 0:
            print(f"{count} dialogs, {time.time() - start:.0f} s", flush=True)
    arrays = {}
    for i, (key, v) in enumerate(sorted(variants.items())):
        arrays[f"prefix_{i}"] = np.array(v["prefix"], dtype=np.uint16)
        arrays[f"ids_{i}"] = np.array(v["ids"], dtype=np.uint16)
        arrays[f"mask_{i}"] = np.array(v["mask"], dtype=np.uint8)
        arrays[f"starts_{i}"] = np.array(v["starts"], dtype=np.int64)
    np.savez(work / "chat_dialogs.npz", **arrays)
    heldout_maker = demo_dialogs.DialogMaker(heldout_ws, chosen["seed"] + 1)
    heldout = []
    while len(heldout) < HELDOUT_DIALOGS:
        dialog = heldout_maker.dialog(fits, max_exchanges=1)
        heldout.append({k: dialog[k] for k in ("messages", "enable_thinking", "kinds")}
                       | {"tools": dialog["tools"] is not None})
    (work / HELDOUT_DIALOGS_FILE).write_text(json.dumps(
        {"tools": demo_dialogs.TOOLS, "dialogs": heldout}, indent=1) + "\n")
    stats = {
        "tokenizer": {"vocab_size": len(tokenizer.get_vocab()),
                      "added": {t: tokenizer.convert_tokens_to_ids(t)
                                for t in CHAT_SPECIAL_TOKENS + CHAT_MARKUP_TOKENS},
                      "eos_token": CHAT_EOS},
        "code_tokens": int(len(code)),
        "dialogs": count,
        "variants": {key: {"dialogs": len(v["starts"]), "system_turn_tokens": len(v["prefix"]),
                           "body_tokens": len(v["ids"]),
                           "assistant_tokens": int(sum(v["mask"]))}
                     for key, v in sorted(variants.items())},
        "body_tokens_median": float(np.median(lengths)), "kinds": kinds,
        "generator_seed": chosen["seed"], "heldout_seed": chosen["seed"] + 1,
        "heldout_dialogs": HELDOUT_DIALOGS,
    }
    (work / "chat_prepare.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=1), flush=True)
