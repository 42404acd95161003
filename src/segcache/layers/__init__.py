"""Layer caches: one segment kind per module, each speaking mlx-lm's cache protocol."""

from .compat import register_names
from .composite import CompositeLayer
from .kv import KVLayer
from .quantized import QuantizedKVLayer
from .recurrent import RecurrentLayer
from .state import StateLayer
from .window import WindowLayer

register_names(KVLayer, QuantizedKVLayer, RecurrentLayer, WindowLayer, StateLayer, CompositeLayer)  # for mlx-lm's load_prompt_cache; see its docstring

__all__ = ["CompositeLayer", "KVLayer", "QuantizedKVLayer", "RecurrentLayer", "StateLayer", "WindowLayer"]
