"""segcache: a segmented copy-on-write cache runtime for MLX and mlx-lm."""

from . import _blas

BLAS = _blas.preload()  # before anything imports mlx

from .errors import BranchError, SegcacheError, UnsupportedModelError  # noqa: E402

__version__ = "0.1.0"
