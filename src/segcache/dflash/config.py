"""A DFlash drafter's configuration, read from a published checkpoint's config.json.

The published layout (z-lab's DFlash drafters, SpecForge's training output) is a
Hugging Face style config of a Qwen3-like decoder stack plus a `dflash_config`:

    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, vocab_size, rms_norm_eps, rope_theta (or rope_parameters /
    rope_scaling), max_position_embeddings, num_target_layers, layer_types, is_causal
    dflash_config: target_layer_ids, mask_token_id, block_size, and optionally
                   input_embedding_scale, output_multiplier, final_logit_softcapping
    architectures: ["DFlashDraftModel"] or ["DFlash2DraftModel"]

A DFlash2 drafter's `dflash_config` (or the top level) adds conv_kernel_size and
conv_group_size (the grouped dynamic causal convolutions around every layer's attention
and MLP) and selector_rank and selector_top_k (its candidate selector).

`target_layer_ids` name target decoder layers whose *outputs* the drafter reads
(Hugging Face `hidden_states[i + 1]`), concatenated in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedModelError

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_2 = "DFlash2DraftModel"


@dataclass
class DFlashConfig:
    """What builds the drafter (field names as config.json spells them)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    quantization: dict | None = None
    architecture: str = ARCHITECTURE
    # DFlash2 only (0 for DFlash): positions each convolution reaches back within the block, channels
    # sharing one dynamic tap, the selector's codebook rank, the candidates it rescores per position
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    raw: dict = field(default_factory=dict, repr=False)  # the file as read (written back by `to_json`)

    @property
    def context_width(self) -> int:
        """Width of the target hidden states the drafter reads: one hidden size per tapped layer."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def dflash2(self) -> bool:
        """Whether this is a DFlash2 drafter (convolutions and a candidate selector)."""
        return self.architecture == ARCHITECTURE_2


def is_dflash(config: dict) -> bool:
    """Whether a config.json names a DFlash drafter (how `--draft-model` recognises one)."""
    archs = config.get("architectures") or []
    return ARCHITECTURE in archs or ARCHITECTURE_2 in archs or "dflash_config" in config


def parse(config: dict, where: str = "config.json") -> DFlashConfig:
    """The drafter's configuration from a published config.json's contents.

    Raises:
        UnsupportedModelError: not a DFlash config, sliding or causal layers, a field missing, or
            DFlash2 sizes that do not fit (a group size that does not divide the hidden size).
    """
    if not is_dflash(config):
        raise UnsupportedModelError(f"{where}: not a DFlash drafter (no 'dflash_config' and architectures "
                                    f"{config.get('architectures')}); pass a DFlash checkpoint directory")
    types = set(config.get("layer_types") or ["full_attention"])
    if types != {"full_attention"}:
        raise UnsupportedModelError(f"{where}: layer_types {sorted(types)}: only full_attention drafter "
                                    "layers are supported")
    if config.get("is_causal"):
        raise UnsupportedModelError(f"{where}: is_causal=true: only the bidirectional block is supported")
    dfl = config.get("dflash_config") or {}
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if rope is not None and rope.get("type", rope.get("rope_type", "default")) == "default":
        theta = rope.get("rope_theta")
        rope = None
    else:
        theta = None
    arch = ARCHITECTURE_2 if ARCHITECTURE_2 in (config.get("architectures") or []) else ARCHITECTURE
    try:
        ids = dfl.get("target_layer_ids", config.get("target_layer_ids"))
        mask = dfl.get("mask_token_id", config.get("mask_token_id"))
        if ids is None or mask is None:
            raise KeyError("dflash_config.target_layer_ids" if ids is None else "dflash_config.mask_token_id")
        cfg = DFlashConfig(
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config["num_key_value_heads"]),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=int(mask),
            block_size=int(dfl.get("block_size", config.get("block_size", 16))),
            num_target_layers=int(config.get("num_target_layers", 0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", theta if theta is not None else 10000.0)),
            rope_scaling=rope,
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            input_embedding_scale=float(dfl.get("input_embedding_scale", 1.0)),
            output_multiplier=float(dfl.get("output_multiplier", 1.0)),
            final_logit_softcapping=dfl.get("final_logit_softcapping", config.get("final_logit_softcapping")),
            quantization=config.get("quantization"),
            architecture=arch,
            raw=dict(config),
        )
        if arch == ARCHITECTURE_2:
            for name in _DFLASH2_SIZES:
                value = dfl.get(name, config.get(name))
                if value is None:
                    raise KeyError(f"dflash_config.{name} (a DFlash2 drafter's)")
                setattr(cfg, name, int(value))
    except KeyError as exc:
        raise UnsupportedModelError(f"{where}: a DFlash config without {exc.args[0]!s}") from None
    if cfg.dflash2:
        _check_dflash2(cfg, where)
    return cfg


_DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _check_dflash2(cfg: DFlashConfig, where: str) -> None:
    bad = [n for n in _DFLASH2_SIZES if getattr(cfg, n) < 1]
    if bad:
        raise UnsupportedModelError(f"{where}: DFlash2 {', '.join(f'{n}={getattr(cfg, n)}' for n in bad)}: "
                                    "each must be at least 1")
    if cfg.hidden_size % cfg.conv_group_size:
        raise UnsupportedModelError(f"{where}: DFlash2 conv_group_size {cfg.conv_group_size} does not divide "
                                    f"hidden_size {cfg.hidden_size}")
    if cfg.selector_top_k > cfg.vocab_size:
        raise UnsupportedModelError(f"{where}: DFlash2 selector_top_k {cfg.selector_top_k} exceeds the "
                                    f"vocabulary {cfg.vocab_size}")


def published(cfg: DFlashConfig) -> dict[str, Any]:
    """The config.json contents of `cfg` in the published layout (what `save` writes)."""
    out = dict(cfg.raw)
    out.update({
        "architectures": [cfg.architecture],
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "num_target_layers": cfg.num_target_layers,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                          "block_size": cfg.block_size},
    })
    if cfg.dflash2:
        out["dflash_config"].update({n: getattr(cfg, n) for n in _DFLASH2_SIZES})
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = cfg.rope_scaling
    if cfg.quantization:  # mlx-lm's block: the loader quantizes the layers it names
        out["quantization"] = cfg.quantization
    return out
