"""Layer caches: one segment kind per module, each speaking mlx-lm's cache protocol."""

from .kv import KVLayer
from .recurrent import RecurrentLayer
from .window import WindowLayer
from .compat import register_names

register_names(KVLayer, RecurrentLayer, WindowLayer)  # for mlx-lm's load_prompt_cache; see its docstring

__all__ = ["KVLayer", "RecurrentLayer", "WindowLayer"]
