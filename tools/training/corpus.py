"""The training text: the Python standard library's own source, split into train and held out."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import mlx_lm
import numpy as np
from tokenizers import Tokenizer

import eval_demo
from training.common import EOS_TOKEN

HOLDOUT_EVERY = 20
HELDOUT_MAX_BYTES = 96_000
EXCLUDED_DIRS = {
    "test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
    "__pycache__", "turtledemo", "ensurepip", "pydoc_data",
}


def stdlib_root() -> Path:
    """The standard library's directory (sysconfig's ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files() -> list[Path]:
    """Lists the stdlib's ``.py`` files (no tests, IDLE, site-packages), sorted."""
    root = stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")
        )
        for name in filenames:
            if name.endswith(".py"):
                files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def other_source_files() -> list[Path]:
    """Python sources outside the training corpus: mlx-lm's own ``.py`` files."""
    root = Path(mlx_lm.__file__).resolve().parent
    return sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())


def read_sources(paths: list[Path]) -> list[tuple[Path, str]]:
    """Reads UTF-8 sources, skipping unreadable and empty files."""
    out = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((path, text))
    return out


def split_corpus(sources: list[tuple[Path, str]]) -> tuple[list, list]:
    """Splits sources into (train, held-out): every ``HOLDOUT_EVERY``-th file is held out."""
    train = [s for i, s in enumerate(sources) if i % HOLDOUT_EVERY != HOLDOUT_EVERY // 2]
    heldout = [s for i, s in enumerate(sources) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2]
    return train, heldout


def stdlib_split() -> tuple[list, list]:
    """The stdlib's (train, held-out) sources."""
    return split_corpus(read_sources(stdlib_source_files()))


def concat_up_to(texts: list[str], max_bytes: int) -> str:
    """Concatenates whole texts (blank-line separated) while staying under ``max_bytes``."""
    parts, size = [], 0
    for text in texts:
        piece = text if text.endswith("\n") else text + "\n"
        piece_size = len(piece.encode("utf-8")) + 1
        if size + piece_size > max_bytes:
            continue
        parts.append(piece)
        size += piece_size
    return "\n".join(parts)


def token_stream(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """The texts' ids (a ``tokenizers.Tokenizer``), EOS after each text, as ``uint16``."""
    stream = []
    for enc in tokenizer.encode_batch(texts):
        stream.extend(enc.ids)
        stream.append(eos_id)
    return np.array(stream, dtype=np.uint16)


def training_token_stream(work: Path, tokenizer_dir: Path,
                          cache_name: str = "train_tokens.npy") -> np.ndarray:
    """The training token stream: ``prepare``'s cached array, else rebuilt from the stdlib.

    Rebuilding tokenizes the training files (same split as ``prepare``) with the
    tokenizer in ``tokenizer_dir``, EOS after each file, exactly as ``prepare`` does.
    ``cache_name`` names the cached array in ``work`` (one per tokenizer).
    """
    cached = work / cache_name
    if cached.exists():
        return np.load(cached)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    train_sources, _ = stdlib_split()
    tokens = token_stream(tokenizer, [text for _, text in train_sources],
                          tokenizer.token_to_id(EOS_TOKEN))
    work.mkdir(parents=True, exist_ok=True)
    np.save(cached, tokens)
    return tokens


def heldout_sample(out: Path) -> str:
    """The text a saved model's reload is checked on: the first 20,000 characters of
    the held-out mlx-lm sources."""
    return (out / eval_demo.HELDOUT_FILES["other"]).read_text(encoding="utf-8")[:20000]


def validation_texts(out: Path) -> dict[str, str]:
    """Code outside training and outside the reported held-out texts, for choosing settings.

    ``stdlib``: the held-out stdlib files that ``heldout_stdlib.txt`` does not contain;
    ``other``: the mlx-lm files that ``heldout_other.txt`` does not contain.
    """
    _, heldout = stdlib_split()
    shipped = {w: eval_demo.read_heldout_text(w, out) for w in eval_demo.HELDOUT_FILES}
    return {
        "stdlib": "\n".join(t for _, t in heldout if t not in shipped["stdlib"]),
        "other": "\n".join(t for _, t in read_sources(other_source_files())
                           if t not in shipped["other"]),
    }
