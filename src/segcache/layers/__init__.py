"""Layer caches: one segment kind per module, each speaking mlx-lm's cache protocol."""

from .kv import KVLayer
from .recurrent import RecurrentLayer
from .window import WindowLayer

__all__ = ["KVLayer", "RecurrentLayer", "WindowLayer"]
