"""Reading, converting, quantizing and writing MTP head weights.

Two sources of a head:

* an original (Hugging Face) checkpoint: its ``mtp.*`` tensors, in the
  checkpoint's own conventions: zero-centred RMS-norm weights (the norm scales
  by ``1 + w``), routed experts either one tensor per expert
  (``experts.{e}.gate_proj.weight``, Qwen3-Next / Qwen3.5-MoE) or fused
  (``experts.gate_up_proj``, ``experts.down_proj``, Qwen3.6). mlx-lm's
  ``sanitize`` drops these tensors when it loads or converts the checkpoint;
* ``mtp.safetensors``, the file segcache writes next to an mlx-lm model
  (``segcache mtp extract``, or ``tools/train_demo.py`` for the shipped target):
  parameter names of :class:`~segcache.mtp.module.MTPModule`, mlx conventions
  (norm weights scale by ``w``, experts stacked as ``switch_mlp``), optionally
  quantized like the model, with its format, layer count and quantization in the
  safetensors metadata.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import hf_repo_to_path, load_model

from ..errors import ModelError
from .module import MTPHead, MTPModule, _text_parts, num_mtp_layers

HEAD_FILE = "mtp.safetensors"
FORMAT = "segcache-mtp"
VERSION = "1"

# Norm weights stored zero-centred in the checkpoints (Qwen3-Next RMSNorm: x * (1 + w)),
# as mlx-lm's own sanitize lists them for the backbone, plus the head's three norms.
_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                  ".q_norm.weight", ".k_norm.weight")
_HEAD_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
_MTP_KEY = re.compile(r"(?:^|\.)mtp\.(.+)$")


def checkpoint_tensors(path: Path) -> dict[str, mx.array]:
    """The ``mtp.*`` tensors of a checkpoint directory or safetensors file, prefix removed.

    A directory with ``model.safetensors.index.json`` is read through its weight
    map (only the shards holding ``mtp.*`` tensors are opened); otherwise every
    ``*.safetensors`` in it (but ``mtp.safetensors``) is read. Loading is lazy:
    only the head's tensors are ever read.
    """
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / "model.safetensors.index.json").is_file():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = sorted({path / shard for key, shard in index["weight_map"].items()
                        if _MTP_KEY.search(key)})
    elif path.is_dir():
        files = [Path(f) for f in sorted(glob.glob(str(path / "*.safetensors")))
                 if Path(f).name != HEAD_FILE]
    else:
        raise ModelError(f"no checkpoint at {path}: pass a checkpoint directory or a "
                         ".safetensors file holding the mtp.* tensors")
    tensors = {}
    for file in files:
        for key, value in mx.load(str(file)).items():
            if (m := _MTP_KEY.search(key)) is not None:
                tensors[m.group(1)] = value
    return tensors


def from_checkpoint(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint-convention ``mtp.*`` tensors (prefix removed) -> :class:`MTPModule` names.

    Shifts the zero-centred norm weights by +1 and stacks routed experts into
    ``switch_mlp`` (per-expert tensors, or the fused ``gate_up_proj`` split in two).
    """
    out, experts = {}, {}
    for key, value in tensors.items():
        if m := re.match(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
                         r"\.weight$", key):
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
            continue
        if m := re.match(r"layers\.(\d+)\.mlp\.experts\.gate_up_proj$", key):
            half = value.shape[-2] // 2
            prefix = f"layers.{m.group(1)}.mlp.switch_mlp"
            out[f"{prefix}.gate_proj.weight"] = value[..., :half, :]
            out[f"{prefix}.up_proj.weight"] = value[..., half:, :]
            continue
        if m := re.match(r"layers\.(\d+)\.mlp\.experts\.down_proj$", key):
            out[f"layers.{m.group(1)}.mlp.switch_mlp.down_proj.weight"] = value
            continue
        if value.ndim == 1 and (key in _HEAD_NORMS or key.endswith(_CENTRED_NORMS)):
            value = value + 1.0
        out[key] = value
    for (layer, name), per_expert in experts.items():
        if sorted(per_expert) != list(range(len(per_expert))):
            raise ModelError(f"mtp layer {layer}: experts of {name} are not numbered 0..n-1")
        out[f"layers.{layer}.mlp.switch_mlp.{name}.weight"] = mx.stack(
            [per_expert[e] for e in range(len(per_expert))])
    return out


def _layer_count(weights: dict[str, mx.array]) -> int:
    layers = {int(m.group(1)) for k in weights if (m := re.match(r"layers\.(\d+)\.", k))}
    if layers != set(range(len(layers))) or not layers:
        raise ModelError(f"the MTP weights have decoder layers {sorted(layers)}; expected 0..n-1")
    return len(layers)


def _quantize(module: MTPModule, quantization: dict, weights: Optional[dict] = None,
              predicate=None) -> None:
    """Quantizes ``module``'s linear layers as ``quantization`` says (in place).

    With ``weights`` (loading), exactly the layers whose ``scales`` are present,
    with their recorded per-layer settings; otherwise (extracting) every layer
    whose input width the group size divides, as mlx-lm's ``quantize_model``
    does, letting the model's ``quant_predicate`` override per layer.
    """
    group_size, bits = quantization["group_size"], quantization["bits"]
    per_layer = quantization.get("layers", {})

    def chosen(path, m):
        if not hasattr(m, "to_quantized"):
            return False
        if weights is not None:
            return per_layer.get(path, True) if f"{path}.scales" in weights else False
        if m.weight.shape[-1] % group_size:
            return False
        params = predicate(path, m) if predicate is not None else True
        if isinstance(params, dict):
            per_layer[path] = params
        return params

    nn.quantize(module, group_size=group_size, bits=bits,
                mode=quantization.get("mode", "affine"), class_predicate=chosen)
    quantization["layers"] = per_layer


def _module_for(model: nn.Module, weights: dict[str, mx.array],
                quantization: Optional[dict]) -> MTPHead:
    """A head for ``model`` holding ``weights`` (mlx names), quantized as recorded."""
    head = MTPHead.build(model, num_layers=_layer_count(weights))
    if quantization:
        _quantize(head.module, dict(quantization), weights=weights)
    try:
        head.module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelError(f"the MTP weights do not fit this model ({e}); was the head "
                         "extracted for another model or size?") from e
    head.module.eval()
    mx.eval(head.module.parameters())
    return head


def read_head_file(path: Path) -> tuple[dict[str, mx.array], dict]:
    """The weights and metadata of a head file segcache wrote; ModelError if it is not one."""
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {e}") from e
    if metadata.get("segcache") != FORMAT:
        raise ModelError(f"{path} is not an MTP head file written by segcache")
    if metadata.get("version") != VERSION:
        raise ModelError(f"{path} has MTP head format {metadata.get('version')!r}; this "
                         f"segcache reads {VERSION!r}: extract the head again")
    return weights, metadata


def is_head_file(path: Path) -> bool:
    """Whether ``path`` is a safetensors file segcache wrote as an MTP head."""
    try:
        _, metadata = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError):
        return False
    return metadata.get("segcache") == FORMAT


_ATTACHED = "_segcache_mtp_head"


def attached(model: nn.Module) -> Optional[MTPHead]:
    """The head `load_head` last loaded for `model` (what ``mtp=True`` drafts with), or None."""
    return getattr(model, _ATTACHED, None)


def head_named(model: nn.Module, mtp) -> MTPHead:
    """The head `mtp=` names for `model` (`Runtime`, `stream_generate`): an MTPHead, True (the head
    `load_head` attached to the model), or a path (a model directory holding mtp.safetensors, or a
    head / checkpoint file).

    Raises:
        ValueError: no such head, or it is bound to another model.
    """
    if isinstance(mtp, MTPHead):
        if mtp.model is not model:
            raise ValueError("the MTP head is bound to another model; load it for this one")
        return mtp
    if mtp is True:
        head = attached(model)
        if head is None:
            raise ValueError("mtp=True: this model has no MTP head loaded; pass mtp=PATH (the model "
                             "directory, or the head's file) or load one with segcache.mtp.load_head")
        return head
    path = Path(mtp)
    head = load_head(model, path) if path.is_dir() else load_head(model, mtp_weights=path)
    if head is None:
        raise ValueError(f"no MTP head at {path} (no mtp.safetensors, no mtp.* tensors); "
                         "write one with `segcache mtp extract`")
    return head


def load_head(model: nn.Module, model_path=None, mtp_weights=None) -> Optional[MTPHead]:
    """The MTP head of ``model`` (see `_load_head`), also recorded on the model for ``mtp=True``."""
    head = _load_head(model, model_path, mtp_weights)
    if head is not None:
        object.__setattr__(model, _ATTACHED, head)  # a plain attribute: the module tree is unchanged
        head.for_drafting().identity  # made at load, so no request's first token pays for them
    return head


def _load_head(model: nn.Module, model_path=None, mtp_weights=None) -> Optional[MTPHead]:
    """The MTP head of ``model``, or None when there is none.

    Looks, in order: at ``mtp_weights`` (a head file segcache wrote, or an original
    checkpoint's directory or safetensors file) when given; else in ``model_path``
    at ``mtp.safetensors``, then at ``mtp.*`` tensors of the directory's own
    safetensors (an original checkpoint loaded as it is).

    Raises:
        ModelError: ``mtp_weights`` holds no head, or the head does not fit the model.
        UnsupportedModelError: the model's family has no known MTP head.
    """
    if mtp_weights is not None:
        source = Path(mtp_weights)
        if source.is_file() and is_head_file(source):
            return _from_head_file(model, source)
        tensors = checkpoint_tensors(source)
        if not tensors:
            raise ModelError(f"no mtp.* tensors in {source}")
        return _module_for(model, from_checkpoint(tensors), None)
    if model_path is None:
        return None
    directory = Path(model_path)
    if (directory / HEAD_FILE).is_file():
        return _from_head_file(model, directory / HEAD_FILE)
    tensors = checkpoint_tensors(directory) if directory.is_dir() else {}
    return _module_for(model, from_checkpoint(tensors), None) if tensors else None


def _from_head_file(model: nn.Module, path: Path) -> MTPHead:
    weights, metadata = read_head_file(path)
    quantization = json.loads(metadata.get("quantization") or "null")
    return _module_for(model, weights, quantization)


def save_head(head: MTPHead, path: Path, *, quantization: Optional[dict] = None,
              source: str = "") -> None:
    """Writes ``head`` as a segcache head file (what :func:`load_head` reads)."""
    weights = dict(tree_flatten(head.module.parameters()))
    metadata = {
        "format": "mlx",
        "segcache": FORMAT,
        "version": VERSION,
        "model_type": str(getattr(head.model, "model_type", "")),
        "layers": str(head.num_layers),
        "quantization": json.dumps(quantization) if quantization else "",
        "source": source,
    }
    mx.save_safetensors(str(path), weights, metadata=metadata)


def extract(checkpoint: Path, model_dir: Path, *, bits: Optional[int] = None,
            group_size: Optional[int] = None, mode: Optional[str] = None) -> dict:
    """Writes the checkpoint's MTP head into an mlx-lm model directory, quantized like it.

    Args:
        checkpoint: The original checkpoint (directory, or a safetensors file).
        model_dir: An mlx-lm conversion of the same model (``mlx_lm.convert``).
        bits: Quantization bits; default: the model's (``config.json``), float if
            the model is not quantized.
        group_size: Quantization group size; default: the model's, else 64.
        mode: Quantization mode; default: the model's, else ``affine``.

    Returns:
        What was written: path, layers, parameters, quantization, dtype.

    Raises:
        ModelError: no head in the checkpoint, or it does not fit the model.
    """
    checkpoint, model_dir = Path(checkpoint), Path(model_dir)
    try:
        model, config = load_model(model_dir, lazy=True)
    except (FileNotFoundError, ValueError) as e:
        raise ModelError(f"cannot load the model at {model_dir}: {e}") from e
    tensors = checkpoint_tensors(checkpoint)
    if not tensors:
        raise ModelError(f"no mtp.* tensors in {checkpoint}; is it the original checkpoint "
                         "(mlx-lm conversions drop them)?")
    source_config = checkpoint / "config.json" if checkpoint.is_dir() else None
    if source_config is not None and source_config.is_file():
        expected = num_mtp_layers(json.loads(source_config.read_text()))
        found = _layer_count(from_checkpoint(tensors))
        if expected and expected != found:
            raise ModelError(f"{checkpoint}: config.json says {expected} MTP layer(s), the "
                             f"weights hold {found}")
    weights = from_checkpoint(tensors)
    head = _module_for(model, weights, None)
    # the conversion's float dtype (its norms stay unquantized)
    dtype = _text_parts(model)[1].norm.weight.dtype
    head.module.set_dtype(dtype)
    model_q = config.get("quantization") or {}
    quantization = None
    if bits or model_q:
        quantization = {"group_size": group_size or model_q.get("group_size", 64),
                        "bits": bits or model_q["bits"],
                        "mode": mode or model_q.get("mode", "affine")}
        _quantize(head.module, quantization, predicate=getattr(model, "quant_predicate", None))
    destination = model_dir / HEAD_FILE
    save_head(head, destination, quantization=quantization,
              source=f"extracted from {checkpoint.name}")
    return {"path": str(destination), "layers": head.num_layers,
            "parameters": sum(v.size for _, v in tree_flatten(head.module.parameters())),
            "quantization": quantization, "dtype": str(dtype)}


def head_for(model: nn.Module, model_path, mtp_weights=None) -> MTPHead:
    """The head `--mtp` drafts with: from ``mtp_weights`` when given, else from the model's
    directory (a Hugging Face id resolves to its local snapshot).

    Raises:
        ModelError: no head there (saying how to get one), or it does not fit the model.
        UnsupportedModelError: the model's family has no known MTP head.
    """
    _text_parts(model)  # an unsupported family says so before any file is read
    directory = Path(model_path)
    if mtp_weights is None and not directory.is_dir():
        try:
            directory = hf_repo_to_path(str(model_path))
        except Exception:  # not a cached repo: no directory to look in
            pass
    head = load_head(model, directory, mtp_weights)
    if head is None:
        raise ModelError(f"no MTP head in {model_path} (no {HEAD_FILE}, no mtp.* tensors): mlx-lm "
                         "conversions drop it; write one with `segcache mtp extract --from "
                         "ORIGINAL_CHECKPOINT --to MODEL_DIR`, or pass --mtp-weights")
    return head
