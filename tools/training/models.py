"""The demo models: configs, building, growing and cutting, saving and checking a saved copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import gated_delta, qwen3_5
from mlx_lm.utils import _get_classes
from tokenizers import Tokenizer

from segcache.adapters import chunked
from training.corpus import heldout_sample
from training.tokenizer import TOKENIZER_FILES


def target_config(vocab_size: int, eos_id: int) -> dict:
    """Config of the hybrid target: mlx-lm ``qwen3_5`` text model, 2 GDN + 2 attention layers."""
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def draft_config(vocab_size: int, eos_id: int) -> dict:
    """Config of the dense draft: mlx-lm ``llama``, 2 layers, hidden 192."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def build_model(config: dict) -> nn.Module:
    """Instantiates the mlx-lm model class named by ``config["model_type"]``."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters."""
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def config_summary(config: dict) -> dict:
    """The architecture fields of a model config that ``training.json`` records."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "full_attention_interval", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "vocab_size", "tie_word_embeddings")
    summary = {k: config[k] for k in keys if k in config}
    if config["model_type"] == "qwen3_5":
        n, every = config["num_hidden_layers"], config["full_attention_interval"]
        summary["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "gated_deltanet" for i in range(n)
        ]
    return summary


def dir_bytes(directory: Path) -> int:
    """Total size of the files in a model directory."""
    return sum(f.stat().st_size for f in directory.iterdir())


def save_model_dir(model: nn.Module, config: dict, tokenizer_dir: Path, directory: Path) -> None:
    """Writes an mlx-lm model directory: config, fp32 safetensors, tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)


def checkpointer(model: nn.Module, config: dict, tokenizer_dir: Path, directory: Path):
    """A ``checkpoint(step, loss)`` for the loop: the model directory plus ``step.json``."""
    def checkpoint(step, loss):
        save_model_dir(model, config, tokenizer_dir, directory)
        (directory / "step.json").write_text(json.dumps({"step": step, "loss": loss}))

    return checkpoint


def check_load_round_trip(model: nn.Module, directory: Path, vocab_size: int,
                          sample_text: str) -> None:
    """Asserts ``mlx_lm.load`` on ``directory`` reproduces weights, logits and tokenization.

    Weights and logits must be bit-identical; the loaded tokenizer must produce
    the same ids as the raw ``tokenizer.json`` the training stream was built with
    and decode them back to ``sample_text``.
    """
    loaded, tokenizer = mlx_lm.load(str(directory))
    raw_ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(sample_text).ids
    loaded_ids = tokenizer.encode(sample_text)
    assert list(loaded_ids) == raw_ids, f"{directory.name}: mlx_lm tokenizer differs from raw"
    assert tokenizer.decode(loaded_ids) == sample_text, "decode round trip failed"
    ours = dict(tree_flatten(model.parameters()))
    theirs = dict(tree_flatten(loaded.parameters()))
    assert ours.keys() == theirs.keys(), set(ours) ^ set(theirs)
    for key, value in ours.items():
        assert mx.array_equal(value, theirs[key]).item(), f"weight {key} changed on load"
    model.eval()
    x = mx.array(np.random.default_rng(0).integers(0, vocab_size, size=(2, 40)), dtype=mx.int32)
    assert mx.array_equal(model(x), loaded(x)).item(), "logits differ after reload"


def save_checked(model: nn.Module, config: dict, tokenizer_dir: Path, destination: Path,
                 vocab_size: int, out: Path) -> None:
    """Saves a trained model's directory and checks that it reloads exactly
    (:func:`check_load_round_trip` on the held-out sample of ``out``)."""
    save_model_dir(model, config, tokenizer_dir, destination)
    check_load_round_trip(model, destination, vocab_size, heldout_sample(out))


def truncate_layers(model: nn.Module, config: dict, layers: int) -> tuple[nn.Module, dict]:
    """A copy of a dense mlx-lm model keeping its first ``layers`` blocks (+ embeddings, norm)."""
    if layers == config["num_hidden_layers"]:
        return model, config
    config = dict(config, num_hidden_layers=layers)
    small = build_model(config)
    weights = dict(tree_flatten(model.parameters()))
    keep = [(k, v) for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers]
    small.load_weights(keep, strict=True)
    mx.eval(small.parameters())
    return small, config


def extend_vocab(model: nn.Module, config: dict, vocab_size: int, seed: int):
    """A copy of ``model`` whose embedding (and output) matrices have ``vocab_size`` rows.

    The old rows are kept; each new row is the mean of the old rows plus a small
    seeded perturbation, so the new tokens start as an average token.
    """
    weights = dict(tree_flatten(model.parameters()))
    key = mx.random.key(seed)
    for name, value in list(weights.items()):
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and \
                value.shape[0] < vocab_size:
            key, sub = mx.random.split(key)
            extra = vocab_size - value.shape[0]
            noise = mx.random.normal((extra, value.shape[1]), key=sub) * 0.1 * mx.std(value)
            weights[name] = mx.concatenate([value, value.mean(axis=0) + noise.astype(value.dtype)])
    config = dict(config, vocab_size=vocab_size)
    grown = build_model(config)
    grown.load_weights(list(weights.items()), strict=True)
    mx.eval(grown.parameters())
    return grown, config


def train_gdn_in_chunks() -> None:
    """Runs qwen3_5's Gated DeltaNet recurrence in chunks (matrix products) in this process.

    mlx-lm runs the recurrence off Metal as a per-token loop of small operations,
    which dominates a CPU training step. segcache's chunked form
    (segcache/adapters/chunked.py) computes the same function (within float
    rounding) with matrix products; here with its product-only triangular inverse,
    which MLX can differentiate. 4-5x less CPU per chat training step measured on
    the demo target (B=2, L=512). Only the training tools call this.
    """
    if getattr(qwen3_5.gated_delta_update, "chunked_for_training", False):
        return
    inverse = chunked._unit_lower_inverse

    def differentiable_inverse(L, products=None):
        return inverse(L, products=True)

    def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
               **unused):
        assert not unused, f"gated_delta_update options this model does not use: {unused}"
        g = gated_delta.compute_g(A_log, a, dt_bias)
        return chunked.chunked_gated_delta(q, k, v, g, mx.sigmoid(b), state, mask)

    update.chunked_for_training = True
    chunked._unit_lower_inverse = differentiable_inverse
    qwen3_5.gated_delta_update = update
