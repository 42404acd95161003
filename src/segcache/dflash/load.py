"""Load a DFlash drafter from a checkpoint directory in the published layout, and write one.

    <dir>/config.json           the drafter's config with its `dflash_config` (config.py)
    <dir>/*.safetensors         its weights: fc.weight, hidden_norm.weight, norm.weight,
                                layers.N.{input_layernorm,post_attention_layernorm}.weight,
                                layers.N.self_attn.{q,k,v,o}_proj.weight, .{q,k}_norm.weight,
                                layers.N.mlp.{gate,up,down}_proj.weight
                                (quantized: .scales / .biases beside, config.json "quantization")
                                DFlash2 adds layers.N.{attention_conv,mlp_conv}.base_kernel,
                                .kernel_projection.weight, candidate_selector.hidden_projection.weight
                                and the bare arrays candidate_selector.{predecessor,successor}_codebook
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UnsupportedModelError
from .config import DFlashConfig, is_dflash, parse, published
from .model import DFlashModule, Drafter, _target_parts

WEIGHTS_FILE = "model.safetensors"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def is_dflash_dir(path) -> bool:
    """Whether `path` is a directory holding a DFlash drafter's config.json."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return is_dflash(json.loads(cfg.read_text()))
    except (OSError, ValueError):
        return False


def read_module(path) -> tuple[DFlashModule, DFlashConfig]:
    """The drafter's module and config from `path` (not yet bound to a target).

    Raises:
        UnsupportedModelError: no config.json or weights there, a config this does not build, or
            weights that do not match it (the message names the first difference).
    """
    path = Path(path)
    where = path / "config.json"
    if not where.is_file():
        raise UnsupportedModelError(f"{path}: no config.json; a DFlash drafter is a directory with config.json "
                                    "and safetensors weights")
    cfg = parse(json.loads(where.read_text()), str(where))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no *.safetensors weights beside config.json")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    for name in CODEBOOKS:  # published bare, an Embedding's weight here
        if name in weights:
            weights[f"{name}.weight"] = weights.pop(name)
    module = DFlashModule(cfg)
    if cfg.quantization:
        q = cfg.quantization
        nn.quantize(module, group_size=int(q.get("group_size", 64)), bits=int(q.get("bits", 4)),
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise UnsupportedModelError(f"{path}: weights do not match the DFlash config: {exc}") from None
    module.eval()
    mx.eval(module.parameters())
    return module, cfg


def load_dflash(path, target: nn.Module, *, block_size: int | None = None) -> Drafter:
    """A DFlash drafter from a checkpoint directory, bound to `target` (an mlx-lm model).

    Args:
        path: the checkpoint directory (config.json + safetensors).
        target: the model it drafts for: hidden size and vocabulary must match the drafter's.
        block_size: overrides the config's `block_size` (positions per block, the last verified
            token included: block_size - 1 drafts).

    Raises:
        UnsupportedModelError: as `read_module`, or a target that does not fit (naming the mismatch).
        ValueError: a block size below 2.
    """
    module, cfg = read_module(path)
    if block_size is not None:
        if block_size < 2:
            raise ValueError(f"block_size={block_size}: a block holds the last token and at least one mask")
        cfg.block_size = int(block_size)
    drafter = Drafter(module, cfg, target)
    _match_dtype(drafter)
    return drafter


def _match_dtype(drafter: Drafter) -> None:
    """Float weights of another float dtype than the target's activations take theirs: a matrix
    product of the two promotes the weights at every call anyway (the same values, so the same
    drafts), and a copy made once spares that cast per block (float16 weights of a float32 target)."""
    inner, _, _ = _target_parts(drafter.model)
    act = inner.embed_tokens(mx.array([[0]], dtype=mx.uint32)).dtype
    floats = {p.dtype for _, p in tree_flatten(drafter.module.parameters()) if mx.issubdtype(p.dtype, mx.floating)}
    if drafter.cfg.quantization or not mx.issubdtype(act, mx.floating) or floats == {act}:
        return
    if mx.finfo(act).bits > max(mx.finfo(d).bits for d in floats):  # only widen: never lose precision
        drafter.module.set_dtype(act)
        mx.eval(drafter.module.parameters())



def save_dflash(module: DFlashModule, cfg: DFlashConfig, path) -> Path:
    """Write `module` and `cfg` in the published layout (config.json + model.safetensors)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(published(cfg), indent=2) + "\n")
    weights = dict(tree_flatten(module.parameters()))
    for name in CODEBOOKS:
        if f"{name}.scales" not in weights and f"{name}.weight" in weights:  # float codebooks go bare
            weights[name] = weights.pop(f"{name}.weight")
    mx.save_safetensors(str(path / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    return path


def bound_drafter(target: nn.Module, dflash, block_size: int | None = None) -> Drafter:
    """`dflash=` as the generation surfaces take it: a `Drafter` bound to `target`, or its checkpoint
    directory; `block_size` (None: the config's) set on the drafter's config.

    Raises:
        ValueError: a drafter bound to another model, or a block size below 2.
        UnsupportedModelError: as `load_dflash`.
    """
    if not isinstance(dflash, Drafter):
        return load_dflash(dflash, target, block_size=block_size)
    if dflash.model is not target:
        raise ValueError("dflash=: the drafter is bound to another model than the target")
    if block_size is not None:
        if block_size < 2:
            raise ValueError(f"block_size={block_size}: a block holds the last token and at least one mask")
        dflash.cfg.block_size = int(block_size)
    return dflash
