"""Recompute the demo models' held-out numbers from the shipped package files.

Everything here works from what ``segcache`` ships under ``segcache/models``
(model directories, held-out texts, ``training.json``) so a test on any
machine can reproduce the figures recorded at training time.

Usage::

    python tools/eval_demo.py            # print recomputed vs recorded numbers
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

import segcache  # noqa: F401  (binds the system BLAS before mlx loads)

import mlx.core as mx
import mlx.nn as nn
import numpy as np

MODELS_DIR = Path(
    os.environ.get("SEGCACHE_DEMO_MODELS_DIR", Path(segcache.__file__).resolve().parent / "models")
)
HELDOUT_FILES = {
    "stdlib": "heldout_stdlib.txt",
    "other": "heldout_other.txt",
}
EVAL_MAX_TOKENS = 8192
EVAL_WINDOW = 256
AGREEMENT_PROMPTS = 5
AGREEMENT_PROMPT_TOKENS = 64
AGREEMENT_NEW_TOKENS = 64


def load_demo_model(name: str, models_dir: Path = MODELS_DIR):
    """Loads a shipped demo model with ``mlx_lm.load``.

    Args:
        name: ``"target"`` or ``"draft"``.
        models_dir: Directory holding the model directories.

    Returns:
        ``(model, tokenizer)`` as returned by ``mlx_lm.load``.
    """
    import mlx_lm

    return mlx_lm.load(str(models_dir / name))


def read_heldout_text(which: str, models_dir: Path = MODELS_DIR) -> str:
    """Returns the shipped held-out text ``which`` ("stdlib" or "other")."""
    return (models_dir / HELDOUT_FILES[which]).read_text(encoding="utf-8")


def eval_token_ids(tokenizer, text: str, max_tokens: int = EVAL_MAX_TOKENS) -> list[int]:
    """Tokenizes ``text`` (no special tokens) and keeps the first ``max_tokens``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return list(ids[:max_tokens])


def unigram_entropy(token_ids: list[int]) -> float:
    """Entropy in nats/token of the empirical unigram distribution of ``token_ids``."""
    counts = np.array(list(Counter(token_ids).values()), dtype=np.float64)
    probs = counts / counts.sum()
    return float(-(probs * np.log(probs)).sum())


def heldout_loss(model: nn.Module, token_ids: list[int], window: int = EVAL_WINDOW) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping windows.

    The sequence is cut into consecutive windows of ``window + 1`` tokens that
    share one boundary token; each window is scored from a fresh context.
    Windows are batched; a ragged last window is scored on its own.

    Args:
        model: An mlx-lm model returning logits for ``[B, T]`` token ids.
        token_ids: Tokens to score.
        window: Number of predicted tokens per window.

    Returns:
        Mean cross-entropy in nats per predicted token.
    """
    model.eval()
    ids = np.asarray(token_ids, dtype=np.int32)
    n_full = (len(ids) - 1) // window
    chunks = []
    if n_full:
        starts = np.arange(n_full) * window
        chunks.append(np.stack([ids[s : s + window + 1] for s in starts]))
    tail_start = n_full * window
    tail = ids[tail_start:] if len(ids) - tail_start > 1 else None
    total, count = 0.0, 0
    batches = []
    if chunks:
        full = chunks[0]
        for b in range(0, len(full), 16):
            batches.append(full[b : b + 16])
    if tail is not None:
        batches.append(tail[None])
    for batch in batches:
        x = mx.array(batch[:, :-1])
        y = mx.array(batch[:, 1:])
        logits = model(x).astype(mx.float32)
        losses = nn.losses.cross_entropy(logits, y, reduction="sum")
        total += losses.item()
        count += y.size
    return total / count


def greedy_agreement(
    target: nn.Module,
    draft: nn.Module,
    token_ids: list[int],
    n_prompts: int = AGREEMENT_PROMPTS,
    prompt_tokens: int = AGREEMENT_PROMPT_TOKENS,
    new_tokens: int = AGREEMENT_NEW_TOKENS,
) -> dict:
    """Measures how often the draft's greedy token equals the target's.

    For each prompt (evenly spaced slices of ``token_ids``), the target
    decodes ``new_tokens`` greedily; then both models score prompt plus
    continuation in one forward pass, and at each of the ``new_tokens``
    positions we check whether the draft's argmax equals the target's
    (teacher forcing on the target's own greedy continuation: exactly the
    per-token acceptance test of greedy speculative decoding).

    Returns:
        Dict with ``rate`` (fraction of agreeing positions), ``matches``,
        ``positions`` and ``mean_accepted_run`` (average length of the agreeing
        prefix per drafted block of 4 tokens, a speculative-decoding proxy).
    """
    from mlx_lm.models.cache import make_prompt_cache

    target.eval()
    draft.eval()
    span = len(token_ids) - prompt_tokens
    starts = [int(i * span / n_prompts) for i in range(n_prompts)]
    matches = 0
    positions = 0
    accepted_runs = []
    for start in starts:
        prompt = token_ids[start : start + prompt_tokens]
        seq = list(prompt)
        cache = make_prompt_cache(target)
        logits = target(mx.array(seq)[None], cache=cache)
        for _ in range(new_tokens):
            seq.append(int(mx.argmax(logits[0, -1]).item()))
            logits = target(mx.array(seq[-1:])[None], cache=cache)
        x = mx.array(seq[:-1])[None]
        target_pred = mx.argmax(target(x)[0, prompt_tokens - 1 :], axis=-1)
        draft_pred = mx.argmax(draft(x)[0, prompt_tokens - 1 :], axis=-1)
        agree = np.array((target_pred == draft_pred).tolist(), dtype=bool)
        matches += int(agree.sum())
        positions += len(agree)
        for b in range(0, len(agree) - 3, 4):
            block = agree[b : b + 4]
            run = 4 if block.all() else int(np.argmin(block))
            accepted_runs.append(run)
    return {
        "rate": matches / positions,
        "matches": matches,
        "positions": positions,
        "prompts": n_prompts,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "mean_accepted_run_of_4": float(np.mean(accepted_runs)),
    }


def evaluate_model(model: nn.Module, tokenizer, models_dir: Path = MODELS_DIR,
                   max_tokens: int = EVAL_MAX_TOKENS) -> dict:
    """Held-out loss and unigram entropy on both shipped held-out texts."""
    results = {}
    for which in HELDOUT_FILES:
        ids = eval_token_ids(tokenizer, read_heldout_text(which, models_dir), max_tokens)
        loss = heldout_loss(model, ids)
        entropy = unigram_entropy(ids)
        results[which] = {
            "tokens": len(ids),
            "loss_nats_per_token": loss,
            "unigram_entropy_nats_per_token": entropy,
            "loss_over_unigram": loss / entropy,
        }
    return results


def load_training_record(models_dir: Path = MODELS_DIR) -> dict:
    """Returns the parsed ``training.json``."""
    return json.loads((models_dir / "training.json").read_text())


def main(argv: list[str] | None = None) -> int:
    """Prints recomputed held-out numbers next to the recorded ones."""
    record = load_training_record()
    ok = True
    for name in ("target", "draft"):
        model, tokenizer = load_demo_model(name)
        recomputed = evaluate_model(model, tokenizer, max_tokens=record["eval"]["max_tokens"])
        for which, numbers in recomputed.items():
            recorded = record["models"][name]["heldout"][which]
            print(
                f"{name:6s} {which:6s} loss {numbers['loss_nats_per_token']:.4f} "
                f"(recorded {recorded['loss_nats_per_token']:.4f}) "
                f"unigram {numbers['unigram_entropy_nats_per_token']:.4f} "
                f"ratio {numbers['loss_over_unigram']:.3f}"
            )
            if not math.isclose(numbers["loss_nats_per_token"],
                                recorded["loss_nats_per_token"], abs_tol=2e-3):
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
