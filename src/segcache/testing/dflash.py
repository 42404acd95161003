"""Tiny random DFlash drafters for tests and benchmarks, in the published layout."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..dflash.config import ARCHITECTURE, ARCHITECTURE_2, DFlashConfig
from ..dflash.load import load_dflash, save_dflash
from ..dflash.model import DFlashModule, _target_parts


def tiny_config(target: nn.Module, *, layers: int = 1, layer_ids=None, block_size: int = 4,
                mask_token_id: int | None = None, dflash2: bool = False, top_k: int = 8) -> DFlashConfig:
    """A small drafter config fitting `target` (its hidden size and vocabulary); `dflash2`: a DFlash2
    drafter (convolutions of reach 3 per 16 channels, a selector of rank 8 over `top_k` candidates)."""
    inner, _, _ = _target_parts(target)
    vocab, hidden = inner.embed_tokens.weight.shape[0], inner.embed_tokens.weight.shape[1]
    n = len(inner.layers)
    ids = tuple(layer_ids) if layer_ids is not None else tuple(sorted({min(1, n - 1), n - 1}))
    arch = ARCHITECTURE_2 if dflash2 else ARCHITECTURE
    raw = {"model_type": "qwen3", "architectures": [arch], "torch_dtype": "float32"}
    sizes = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=top_k) if dflash2 else {}
    return DFlashConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=2 * hidden, vocab_size=vocab,
                        target_layer_ids=ids, mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
                        block_size=block_size, num_target_layers=n, max_position_embeddings=4096,
                        architecture=arch, raw=raw, **sizes)


def random_module(cfg: DFlashConfig, seed: int = 0, gain: float = 1.0, blind: bool = False) -> DFlashModule:
    """A drafter module with random weights drawn from `seed` (norm weights too, so none is blind).
    `blind`: every layer's output projections zero, so each masked position drafts what the target's
    head makes of the mask token's embedding (a drafter whose acceptance a test can choose by the mask;
    a DFlash2 one's selector still rescores those logits by the draft before).
    DFlash2's base kernels (zeros at init) are drawn too, and its codebooks at a scale where the
    selector often overrules a position's argmax."""
    mx.random.seed(seed)
    module = DFlashModule(cfg)
    drawn = []
    for name, w in tree_flatten(module.parameters()):
        if blind and name.endswith(("o_proj.weight", "down_proj.weight")):
            drawn.append((name, mx.zeros(w.shape)))
        elif name.endswith("norm.weight"):
            drawn.append((name, 1.0 + 0.2 * mx.random.normal(w.shape)))
        elif name.endswith("base_kernel"):
            drawn.append((name, 0.3 * mx.random.normal(w.shape)))
        elif name.endswith("codebook.weight"):
            drawn.append((name, 1.5 * mx.random.normal(w.shape)))
        else:
            drawn.append((name, gain * w))
    module.load_weights(drawn)
    mx.eval(module.parameters())
    return module


def write_checkpoint(target: nn.Module, path, *, seed: int = 0, blind: bool = False, **config) -> Path:
    """A random drafter for `target` written in the published layout at `path`."""
    cfg = tiny_config(target, **config)
    return save_dflash(random_module(cfg, seed, blind=blind), cfg, path)


def random_drafter(target: nn.Module, path, *, seed: int = 0, blind: bool = False, **config):
    """A random drafter for `target`, written at `path` and loaded back (a `dflash.Drafter`)."""
    return load_dflash(write_checkpoint(target, path, seed=seed, blind=blind, **config), target)
