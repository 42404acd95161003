"""Multi-token-prediction (MTP) heads: the Qwen3-Next / Qwen3.5 module that drafts
the token after next from the target's last hidden state and the next token.

* :class:`MTPHead` - a head bound to its target: ``head(hidden, tokens, cache)
  -> (logits, hidden)``, one KV cache per head layer (``head.make_cache()``).
* :func:`forward_with_hidden` - the target's logits and last hidden state from
  one forward of the unmodified mlx-lm model.
* :func:`load_head` - the head from a model directory (``mtp.safetensors``, or an
  original checkpoint's ``mtp.*`` tensors) or from ``--mtp-weights``.
* :class:`MTP` - the drafter (the decoder's protocol) drafting with a head;
  :class:`HiddenStates` - a prefill's hidden states handed to it with a row.
* :func:`head_for` - the head ``--mtp`` uses (the model directory or ``--mtp-weights``).
* :class:`HeadSegment` - the head's attention cache as a drafter segment of a
  Runtime (``Runtime(model, mtp=head_or_path)``, registered here by name).
* :func:`extract` - ``segcache mtp extract``: an original checkpoint's head
  written next to an mlx-lm conversion, quantized like it.

docs/mtp.md describes the module, the hidden state that feeds it, and the file.
Names load on first use, so registering the ``segcache mtp`` command stays cheap.
"""

import importlib

from .. import drafter_segments

_LAZY = {
    "forward_with_hidden": "hidden",
    "MTPHead": "module",
    "MTPModule": "module",
    "num_mtp_layers": "module",
    "HEAD_FILE": "weights",
    "extract": "weights",
    "load_head": "weights",
    "head_for": "weights",
    "MTP": "drafter",
    "HiddenStates": "drafter",
    "save_head": "weights",
    "HeadSegment": "state",
}


def _segment(model, value):
    """`Runtime(model, mtp=value)`'s segment (mtp/state.py, loaded on first use)."""
    return importlib.import_module(".state", __name__).segment(model, value)


drafter_segments.register("mtp", _segment)

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'segcache.mtp' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
