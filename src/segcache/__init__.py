"""segcache: a segmented copy-on-write cache runtime for MLX and mlx-lm."""

from . import _blas

BLAS = _blas.preload()  # before anything imports mlx

from .errors import (  # noqa: E402
    BranchError,
    InvariantError,
    SegcacheError,
    StoreError,
    StoreFormatError,
    UnsupportedModelError,
)
from .runtime import Branch, Runtime  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BLAS",
    "Branch",
    "BranchError",
    "InvariantError",
    "Runtime",
    "SegcacheError",
    "StoreError",
    "StoreFormatError",
    "UnsupportedModelError",
]
