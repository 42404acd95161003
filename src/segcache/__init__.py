"""segcache: a segmented copy-on-write cache runtime for MLX and mlx-lm.

The public API is what this module exports. Names that need mlx-lm load on
first use, so `import segcache` (and the store CLI) stays fast.
"""

import importlib

from . import _blas

BLAS = _blas.preload()  # before anything imports mlx

from .errors import (  # noqa: E402
    BranchError,
    GrammarError,
    InvariantError,
    ParamError,
    SegcacheError,
    StoreError,
    StoreFormatError,
    UnsupportedModelError,
    UnsupportedOperationError,
)

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "Runtime": "runtime",
    "Branch": "runtime",
    "open_store": "store",
    "PrefixStore": "store",
    "Record": "store",
    "stream_generate": "generation",
    "generate": "generation",
    "GenerationResponse": "generation",
    "GenerationStats": "generation",
    "Sampler": "sampling",
    "make_sampler": "sampling",
    "Keys": "sampling",
    "Processors": "processors",
    "make_processors": "processors",
    "Controls": "controls",
    "Grammars": "grammar",
    "PromptLookup": "lookup",
    "BatchRuntime": "batch",
    "BatchDecoder": "batch",
    "make_drafter": "drafters",
    "make_decoder": "drafters",
    "MTPHead": "mtp",
    "load_head": "mtp",
    "load_dflash": "dflash",
    "KVQuantization": "kvquant",
}

__all__ = [
    "BLAS",
    "BranchError",
    "GrammarError",
    "InvariantError",
    "ParamError",
    "SegcacheError",
    "StoreError",
    "StoreFormatError",
    "UnsupportedModelError",
    "UnsupportedOperationError",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        if name == "Runtime":
            importlib.import_module(".mtp", __name__)  # registers `Runtime(model, mtp=...)` (cheap: lazy names)
            importlib.import_module(".dflash", __name__)  # and `dflash=`
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'segcache' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
