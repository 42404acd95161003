"""Stage ``prepare``: corpus, tokenizer, held-out texts and the training token stream."""

from __future__ import annotations

import json
import platform
import sysconfig
from pathlib import Path

import numpy as np

import eval_demo
from training.common import EOS_TOKEN, SEED, package_version, seed_everything
from training.corpus import (EXCLUDED_DIRS, HELDOUT_MAX_BYTES, HOLDOUT_EVERY, concat_up_to,
                             other_source_files, read_sources, split_corpus,
                             stdlib_source_files, token_stream)
from training.tokenizer import check_round_trip, save_tokenizer_files, train_tokenizer


def run(args) -> None:
    """Builds corpus, tokenizer, held-out texts and the training token stream."""
    seed_everything(SEED)
    work, out = Path(args.work_dir), Path(args.out_dir)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "__init__.py").touch()

    stdlib = read_sources(stdlib_source_files())
    train_sources, heldout_sources = split_corpus(stdlib)
    other = read_sources(other_source_files())
    print(f"stdlib files {len(stdlib)}: train {len(train_sources)}, held out "
          f"{len(heldout_sources)}; other (mlx_lm) files {len(other)}", flush=True)

    train_texts = [text for _, text in train_sources]
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    tokenizer_dir = work / "tokenizer"
    save_tokenizer_files(tokenizer, tokenizer_dir)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)

    heldout_stdlib = concat_up_to([t for _, t in heldout_sources], HELDOUT_MAX_BYTES)
    heldout_other = concat_up_to([t for _, t in other], HELDOUT_MAX_BYTES)
    (out / eval_demo.HELDOUT_FILES["stdlib"]).write_text(heldout_stdlib, encoding="utf-8")
    (out / eval_demo.HELDOUT_FILES["other"]).write_text(heldout_other, encoding="utf-8")
    check_round_trip(tokenizer_dir, [heldout_stdlib[:20000], heldout_other[:20000],
                                     "def f(x):\n\tif x:\n        return  x  \n\n\n  # é ✓\r\n"])

    tokens = token_stream(tokenizer, train_texts, eos_id)
    np.save(work / "train_tokens.npy", tokens)
    heldout_token_total = sum(len(e.ids) for e in tokenizer.encode_batch(
        [t for _, t in heldout_sources]))
    corpus = {
        "source": "CPython standard library .py files (sysconfig stdlib path)",
        "python_version": platform.python_version(),
        "stdlib_path": sysconfig.get_paths()["stdlib"],
        "excluded_dirs": sorted(EXCLUDED_DIRS) + ["config-*"],
        "files_total": len(stdlib),
        "files_train": len(train_sources),
        "files_heldout": len(heldout_sources),
        "heldout_rule": f"file index % {HOLDOUT_EVERY} == {HOLDOUT_EVERY // 2} "
                        "in sorted relative-path order",
        "train_bytes": sum(len(t.encode("utf-8")) for t in train_texts),
        "train_tokens": int(len(tokens)),
        "heldout_tokens_all_files": int(heldout_token_total),
        "heldout_stdlib_text": {
            "file": eval_demo.HELDOUT_FILES["stdlib"],
            "bytes": len(heldout_stdlib.encode("utf-8")),
            "description": "whole held-out stdlib files concatenated, blank-line separated",
        },
        "heldout_other_text": {
            "file": eval_demo.HELDOUT_FILES["other"],
            "bytes": len(heldout_other.encode("utf-8")),
            "description": "mlx_lm package .py files (outside the training corpus), "
                           "concatenated",
            "package": "mlx_lm " + package_version("mlx_lm"),
            "files_available": len(other),
        },
    }
    tokenizer_info = {
        "type": "byte-level BPE (HF tokenizers); NFC normalizer and the Qwen2/Qwen3.5 "
                "split regex, as transformers' Qwen3_5Tokenizer rebuilds them",
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_token": EOS_TOKEN,
        "eos_token_id": eos_id,
        "trained_on": "training files only",
    }
    (work / "prepare.json").write_text(json.dumps(
        {"corpus": corpus, "tokenizer": tokenizer_info}, indent=2))
    print(json.dumps(corpus, indent=1), flush=True)
    print(f"vocab {tokenizer.get_vocab_size()}, train tokens {len(tokens)}, "
          f"bytes/token {corpus['train_bytes'] / len(tokens):.2f}", flush=True)
