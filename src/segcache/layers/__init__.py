"""Layer caches: one segment kind per module, each speaking mlx-lm's cache protocol.

A module holds a kind and its batched form side by side (B rows in one cache,
layers/rows.py), as mlx-lm keeps `KVCache` beside `BatchKVCache`.
"""

from .compat import register_names
from .composite import BatchCompositeLayer, CompositeLayer
from .kv import BatchKVLayer, KVLayer
from .quantized import QuantizedKVLayer
from .recurrent import BatchRecurrentLayer, RecurrentLayer
from .state import BatchStateLayer, StateLayer
from .window import BatchWindowLayer, WindowLayer

register_names(KVLayer, QuantizedKVLayer, RecurrentLayer, WindowLayer, StateLayer, CompositeLayer)  # for mlx-lm's load_prompt_cache; see its docstring

__all__ = [
    "BatchCompositeLayer", "BatchKVLayer", "BatchRecurrentLayer", "BatchStateLayer", "BatchWindowLayer",
    "CompositeLayer", "KVLayer", "QuantizedKVLayer", "RecurrentLayer", "StateLayer", "WindowLayer",
]
