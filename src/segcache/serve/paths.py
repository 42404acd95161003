"""Where `segcache serve` keeps a model's prefix store by default, and how its directories are made."""

from __future__ import annotations

import os
import sys
from pathlib import Path


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
