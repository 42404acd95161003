"""`--dflash PATH` / `--block-size B` of `segcache generate` and `segcache serve`, and a
`--draft-model PATH` that is a DFlash checkpoint (recognised from its config.json)."""

from __future__ import annotations

import sys

from .load import is_dflash_dir, load_dflash
from .model import Drafter


def take_draft_dir(args, command: str) -> None:
    """A `--draft-model` directory that is a DFlash checkpoint becomes `--dflash` (saying so)."""
    draft = getattr(args, "draft_model", None)
    if getattr(args, "dflash", None) is None and draft and is_dflash_dir(draft):
        print(f"{command}: --draft-model {draft} is a DFlash drafter (its config.json says so): drafting "
              "with it as --dflash", file=sys.stderr)
        args.dflash, args.draft_model = draft, None


def dflash_of(args, model, command: str = "segcache generate") -> Drafter | None:
    """The DFlash drafter the command line asks for, bound to `model`, or None.

    Raises:
        ValueError: --block-size without a DFlash drafter, --dflash with --draft-model or --mtp.
        UnsupportedModelError: a checkpoint that does not load or does not fit the model.
    """
    take_draft_dir(args, command)
    path = getattr(args, "dflash", None)
    block = getattr(args, "block_size", None)
    if path is not None and (getattr(args, "draft_model", None) or getattr(args, "mtp", False)):
        raise ValueError("--dflash drafts alone or beside --prompt-lookup, not with --draft-model or --mtp")
    if path is None:
        if block is not None:
            raise ValueError("--block-size needs --dflash (or a DFlash --draft-model)")
        return None
    return load_dflash(path, model, block_size=block)
