"""A Runtime's committed state from segcache layer caches: `Runtime.from_prompt_cache`.

A prompt cache file written by `save_prompt_cache(path, rt.cache)` and read back
by mlx-lm's `load_prompt_cache` holds one segcache layer per decoder layer. A
runtime built for the model loads copies of their committed states (each
layer through its persistence protocol, so no kind is switched), with token
ids unknown: it forks and generates, but never publishes. mlx-lm's own classes
in such a file are `prompt_file.py`'s.
"""

from __future__ import annotations

from typing import Sequence

from .layers.protocol import PAGES
from .layers.quantized import QuantizedKVLayer


def load_layers(rt, cache: Sequence):
    """`rt` (fresh, built for the model) holding the committed state of the layers `cache`.

    A full-attention layer saved quantized (`QuantizedKVLayer`, after kv_bits
    switched it) is loaded into a quantized layer of the same group size and bits.

    Raises:
        ValueError: `cache` does not fit the model's layers.
    """
    cache = list(cache)
    if len(cache) != len(rt.cache):
        raise ValueError(f"from_prompt_cache(): {len(cache)} caches for {len(rt.cache)} layers")
    forms = {i: src.kv_form() for i, (src, own) in enumerate(zip(cache, rt.cache))
             if isinstance(src, QuantizedKVLayer) and own.kv_switches}  # saved after kv_bits switched
    if forms:
        rt.quantize_layers(forms)
    for i, (src, own) in enumerate(zip(cache, rt.cache)):
        if type(src) is not type(own) or src.layout() != own.layout():
            found = src.layout() if type(src) is type(own) else type(src).__name__
            raise ValueError(f"from_prompt_cache(): layer {i} is {found}, this model needs {own.layout()}")
    counts = {src.committed_offset for src in cache}
    if len(counts) != 1:
        raise ValueError(f"from_prompt_cache(): the layers hold different token counts {sorted(counts)}")
    n = counts.pop()
    if n == 0:
        return rt
    states = []
    for src, own in zip(cache, rt.cache):
        if src.resumes_from == PAGES:  # through the persistence protocol: copies, no kind switch
            arrays, meta = {name: [a] for name, a in src.export_rows(0, n).items()}, {}
        else:
            arrays, meta = src.export_state()
        states.append(own.state_from(arrays, meta, n))
    rt.restore([None] * n, states)
    return rt
