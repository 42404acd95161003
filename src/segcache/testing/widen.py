"""A wide copy of a small qwen3_5 target: the same function at the cost of a large model.

The shipped 3.5M target makes speculative decoding look worse than it is: a verify of k
positions costs far more than k times nothing, where a real model's one-token forward is
memory-bound and a verify of k positions costs little more than one. `widen_target` writes a
checkpoint that computes exactly the source's function but costs like a ~155M model:

  * every MLP gets extra neurons up to `intermediate_size`: random gate/up rows, zero
    down_proj columns, so they add exact zeros;
  * layers of the same kinds (the `full_attention_interval` pattern: Gated DeltaNet and
    full attention) are appended up to `layers`, with random weights but zero output
    projections (o_proj, out_proj, down_proj), so the residual stream passes unchanged;
  * the MTP head (mtp.safetensors) gets the same extra MLP neurons, since its decoder layer
    is built at the target's intermediate size.

Appended layers go after the source's, so a drafter tapping layer i (DFlash) reads the
same state, and the final norm sees the same residual stream. Random tensors are drawn
with the mean and spread of the source tensor they stand beside (the same layer kind's),
so their activations stay finite: a zero projection of an inf would be a NaN.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelError

# Bumped when the builder draws or lays out other weights: it keys the benches' cache.
WIDEN_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
HEAD_FILE = "mtp.safetensors"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")
OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")
_LAYER_KEY = re.compile(r"^(.*?layers\.)(\d+)\.(.+)$")


def widen_target(source_dir, out_dir, *, layers: int = 16, intermediate_size: int = 12288,
                 seed: int = 0) -> Path:
    """Writes a widened copy of the qwen3_5 checkpoint at `source_dir` into `out_dir`.

    Args:
        source_dir: an mlx-lm qwen3_5 model directory (config.json, model*.safetensors;
            mtp.safetensors and tokenizer files are carried along when present).
        out_dir: where to write; created, and its files of the same names replaced.
        layers: decoder layers of the result, at least the source's.
        intermediate_size: MLP width of the result, at least the source's.
        seed: what the random weights are drawn from (same seed, same bytes).

    Returns:
        `out_dir` as a Path.

    Raises:
        ModelError: the source is not a dense qwen3_5 checkpoint with float weights, or
            `layers` or `intermediate_size` is below the source's.
    """
    source, out = Path(source_dir), Path(out_dir)
    config = _read_config(source)
    old_layers, old_width = config["num_hidden_layers"], config["intermediate_size"]
    if layers < old_layers or intermediate_size < old_width:
        raise ModelError(f"widen to {layers} layers, MLP {intermediate_size}: the source has {old_layers} layers, "
                         f"MLP {old_width}; a widening only adds")
    weights = _read_weights(source)
    prefix = _layers_prefix(weights)
    wide = _widened_mlps(weights, intermediate_size, seed, "model")
    interval = config.get("full_attention_interval", 4)
    for index in range(old_layers, layers):
        template = _template_layer(index, interval, old_layers)
        wide.update(_appended_layer(weights, prefix, template, index, intermediate_size, seed))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / WEIGHTS_FILE), wide, metadata={"format": "mlx"})
    if (source / HEAD_FILE).is_file():
        _widen_head(source / HEAD_FILE, out / HEAD_FILE, intermediate_size, seed)
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    config.update(num_hidden_layers=layers, intermediate_size=intermediate_size)
    if "layer_types" in config:  # Hugging Face configs spell the pattern out: extend it alike
        config["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                 for i in range(layers)]
    config["segcache_widened"] = {"source": str(source), "source_sha256": weights_digest(source), "seed": seed,
                                  "layers": layers, "intermediate_size": intermediate_size,
                                  "source_layers": old_layers, "source_intermediate_size": old_width,
                                  "version": WIDEN_VERSION}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def weights_digest(source_dir) -> str:
    """SHA-256 over the checkpoint's config.json and safetensors files (what a cache is keyed by)."""
    digest = hashlib.sha256()
    source = Path(source_dir)
    for path in [source / "config.json", *sorted(source.glob("*.safetensors"))]:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _read_config(source: Path) -> dict:
    where = source / "config.json"
    if not where.is_file():
        raise ModelError(f"{source}: no config.json; widen_target reads an mlx-lm model directory")
    config = json.loads(where.read_text())
    if config.get("model_type") != "qwen3_5" or "text_config" in config or config.get("num_experts"):
        raise ModelError(f"{where}: widen_target builds on a dense text-only qwen3_5 config, not "
                         f"model_type {config.get('model_type')!r}")
    if "quantization" in config:
        raise ModelError(f"{where}: a quantized checkpoint; widen the float one, then quantize")
    return config


def _read_weights(source: Path) -> dict[str, mx.array]:
    files = sorted(p for p in source.glob("model*.safetensors"))
    if not files:
        raise ModelError(f"{source}: no model*.safetensors weights")
    weights: dict[str, mx.array] = {}
    for path in files:
        weights.update(mx.load(str(path)))
    return weights


def _layers_prefix(weights: dict[str, mx.array]) -> str:
    """The prefix of the decoder layers' names ("language_model.model.layers." as mlx-lm saves)."""
    for name in weights:
        if m := _LAYER_KEY.match(name):
            return m.group(1)
    raise ModelError("the checkpoint holds no decoder layers")


def _template_layer(index: int, interval: int, source_layers: int) -> int:
    """The last source layer of the kind layer `index` has (full attention every `interval`-th)."""
    kind = (index + 1) % interval == 0
    for candidate in range(source_layers - 1, -1, -1):
        if ((candidate + 1) % interval == 0) == kind:
            return candidate
    raise ModelError(f"the source has no {'full-attention' if kind else 'linear-attention'} layer to copy "
                     f"the kind of layer {index} from")


def _draw(like: mx.array, shape: tuple[int, ...], seed: int, name: str) -> mx.array:
    """Normal values of `like`'s mean and spread, from a key of (seed, name): no draw depends on
    another's order, so adding a tensor changes no other one."""
    tag = hashlib.blake2b(f"{seed}|{name}".encode(), digest_size=8).digest()
    key = mx.random.key(int.from_bytes(tag, "little") >> 1)
    values = like.astype(mx.float32)
    mean, spread = mx.mean(values), mx.sqrt(mx.var(values))
    return (mean + spread * mx.random.normal(shape, key=key)).astype(like.dtype)


def _widen_mlp(gate: mx.array, up: mx.array, down: mx.array, width: int, seed: int,
               name: str) -> tuple[mx.array, mx.array, mx.array]:
    """gate/up with random rows, down with zero columns, up to `width` neurons."""
    extra = width - gate.shape[0]
    if extra == 0:
        return gate, up, down
    rows = (extra, gate.shape[1])
    gate = mx.concatenate([gate, _draw(gate, rows, seed, f"{name}.gate_proj")], axis=0)
    up = mx.concatenate([up, _draw(up, rows, seed, f"{name}.up_proj")], axis=0)
    down = mx.concatenate([down, mx.zeros((down.shape[0], extra), dtype=down.dtype)], axis=1)
    return gate, up, down


def _widened_mlps(weights: dict[str, mx.array], width: int, seed: int, tag: str) -> dict[str, mx.array]:
    """`weights` with every `*.mlp.gate_proj/up_proj/down_proj` trio widened to `width`."""
    out = dict(weights)
    for name in weights:
        if not name.endswith(".mlp.gate_proj.weight"):
            continue
        base = name[: -len(".gate_proj.weight")]
        names = [f"{base}.{p}_proj.weight" for p in ("gate", "up", "down")]
        if weights[names[0]].dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise ModelError(f"{names[0]} is {weights[names[0]].dtype}: widen float weights")
        trio = _widen_mlp(*(weights[n] for n in names), width, seed, f"{tag}.{base}")
        out.update(zip(names, trio))
    return out


def _appended_layer(weights: dict[str, mx.array], prefix: str, template: int, index: int, width: int,
                    seed: int) -> dict[str, mx.array]:
    """Layer `index`: layer `template`'s tensors redrawn, its output projections zero, MLP at `width`."""
    start = f"{prefix}{template}."
    layer = {}
    for name, value in weights.items():
        if not name.startswith(start):
            continue
        part = name[len(start):]
        new = f"{prefix}{index}.{part}"
        if part.startswith("mlp."):
            shape = (width, value.shape[1]) if part != "mlp.down_proj.weight" else (value.shape[0], width)
        else:
            shape = value.shape
        if part in OUTPUT_PROJECTIONS:
            layer[new] = mx.zeros(shape, dtype=value.dtype)
        else:
            layer[new] = _draw(value, shape, seed, f"model.{new}")
    return layer


def _widen_head(source: Path, out: Path, width: int, seed: int) -> None:
    """The MTP head file with its MLP widened like the target's (its metadata kept, its source noted)."""
    weights, metadata = mx.load(str(source), return_metadata=True)
    wide = _widened_mlps(weights, width, seed, "mtp")
    metadata = dict(metadata, source=f"{metadata.get('source', '')}; MLP widened to {width} (seed {seed})")
    mx.save_safetensors(str(out), wide, metadata=metadata)


def quantize_target(source_dir, out_dir, *, bits: int = 4, group_size: int = 64) -> Path:
    """Writes an affine-quantized copy of the mlx-lm model at `source_dir` (mlx-lm's own
    `quantize_model`, as `mlx_lm.convert -q` does), its MTP head quantized alike when it has one.

    Raises:
        ModelError: the source is quantized already, or does not load.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, quantize_model

    from ..mtp import load_head, save_head

    source, out = Path(source_dir), Path(out_dir)
    config = json.loads((source / "config.json").read_text())
    if "quantization" in config:
        raise ModelError(f"{source}: quantized already")
    try:
        model, _ = load_model(source)
    except (FileNotFoundError, ValueError) as exc:
        raise ModelError(f"cannot load the model at {source}: {exc}") from exc
    head = load_head(model, source) if (source / HEAD_FILE).is_file() else None  # before: it reads float weights
    model, config = quantize_model(model, config, group_size, bits)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / WEIGHTS_FILE), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    if head is not None:
        quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}
        nn.quantize(head.module, group_size=group_size, bits=bits,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
        save_head(head, out / HEAD_FILE, quantization=quantization, source=f"{source.name}'s head, {bits}-bit")
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
