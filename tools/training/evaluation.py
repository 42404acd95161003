"""What the ship stages measure on the held-out texts, per text."""

from __future__ import annotations

from pathlib import Path

import eval_demo


def greedy_agreements(target, draft, tokenizer, out: Path) -> dict:
    """Draft/target greedy agreement on each held-out text of ``out``."""
    return {which: eval_demo.greedy_agreement(target, draft, heldout_ids(tokenizer, which, out))
            for which in eval_demo.HELDOUT_FILES}


def heldout_ids(tokenizer, which: str, out: Path) -> list[int]:
    """The evaluated ids of held-out text ``which`` of ``out``."""
    return eval_demo.eval_token_ids(tokenizer, eval_demo.read_heldout_text(which, out))
