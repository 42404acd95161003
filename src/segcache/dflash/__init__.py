"""DFlash block drafters: a small non-causal decoder stack that drafts a whole block in one
forward from the outputs of chosen target layers (docs/dflash.md).

* :func:`load_dflash` - a drafter from a checkpoint directory in the published layout
  (config.json with `dflash_config`, safetensors), bound to its target; :func:`save_dflash`.
* :class:`Drafter` - the bound drafter (`context`, `context_kv`, `block`).
* :class:`ContextSegment` - its context K/V as a drafter segment of a Runtime
  (``Runtime(model, dflash=drafter)``, registered here by name).
* :class:`DFlash` - the decoder's drafter protocol over rows.

Names load on first use.
"""

import importlib

from .. import drafter_segments

_LAZY = {
    "DFlashConfig": "config",
    "is_dflash_dir": "load",
    "load_dflash": "load",
    "save_dflash": "load",
    "Drafter": "model",
    "DFlashModule": "model",
    "ContextSegment": "segment",
    "DFlash": "drafter",
}


def _segment(model, value):
    """`Runtime(model, dflash=value)`'s segment (dflash/segment.py, loaded on first use)."""
    return importlib.import_module(".segment", __name__).segment(model, value)


drafter_segments.register("dflash", _segment)

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'segcache.dflash' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
