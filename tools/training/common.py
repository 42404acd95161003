"""Paths, seeds and settings every training stage shares."""

from __future__ import annotations

import segcache  # noqa: I001  (must precede mlx: binds the system OpenBLAS)

import random
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "src" / "segcache" / "models"
DEFAULT_WORK_DIR = Path("/tmp/segcache_train_demo")
# the models of the segcache that is imported (tools/train_mtp.py reads and writes these)
PACKAGE_MODELS = Path(segcache.__file__).resolve().parent / "models"

EOS_TOKEN = "<|endoftext|>"
SEED = 1234


def seed_everything(seed: int) -> None:
    """Seeds Python, NumPy and MLX random generators."""
    random.seed(seed)
    np.random.seed(seed)
    mx.random.seed(seed)


def package_version(name: str) -> str:
    """The installed version of distribution ``name``."""
    return version(name)


def settings(defaults: dict, args) -> dict:
    """``defaults`` with the command line's overrides (options left unset keep the default).

    ``--time-based-cooldown`` clears a fixed cooldown, so the run places it from the
    wall clock.
    """
    chosen = dict(defaults)
    for key in chosen:
        if getattr(args, key, None) is not None:
            chosen[key] = getattr(args, key)
    if args.time_based_cooldown:
        chosen["cooldown_start"] = chosen["cooldown_steps"] = None
    return chosen
