"""Where `segcache serve` keeps a model's prefix store by default, how its directories are made, and how a
path is shown to a user."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..models import MODELS_DIR


def default_cache_dir(identity: bytes) -> Path:
    """The store of a model identity under the user's cache directory."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "segcache" / "serve" / identity.hex()[:32]


def private_dirs(path: Path) -> None:
    """Create what is missing of `path` 0700 (a store holds prompt contents); existing parents are left alone."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700)
        os.chmod(d, 0o700)


def shown(path: Path) -> str:
    """A path as a user reads it: the shipped models package-relative, home as ~."""
    path = Path(path).resolve()
    for base, name in ((MODELS_DIR.resolve(), "segcache/models"), (Path.home().resolve(), "~")):
        if path == base or base in path.parents:
            rest = path.relative_to(base).as_posix()
            return name if rest == "." else f"{name}/{rest}"
    return str(path)
