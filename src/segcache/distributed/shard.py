"""Which slice of a model this rank holds, and loading it the way mlx-lm does.

mlx-lm shards a model in one of two ways (`mlx_lm.utils.sharded_load`):

    tensor     `model.shard(group)`: every layer on every rank, each holding a
               slice of the heads (attention, Gated DeltaNet heads and their conv
               channels) and of the MLP; partial outputs are summed (`all_sum`)
    pipeline   `model.model.pipeline(group)`: each rank runs a contiguous run of
               layers (rank 0 the last ones) and passes the hidden state on
               (`send` / `recv_like`), then `all_gather`s the final one

A `Shard` names what one rank holds. It goes into every prefix-store identity
(`store/identity.py`), so a rank never loads another rank's slice or a
single-process record, and it names the rank's store directory.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError

PARALLEL = ("tensor", "pipeline")


@dataclass(frozen=True)
class Shard:
    """The slice of a model one rank holds.

    Attributes:
        parallel: "tensor" (heads split over the ranks) or "pipeline" (layers split).
        rank: this rank, 0..size-1.
        size: ranks in the group (the world size of the deployment).
        layers: (start, end, total): the model layers this rank runs, [start, end)
            of `total` (every layer under tensor parallelism).
    """

    parallel: str
    rank: int
    size: int
    layers: tuple[int, int, int]

    def __post_init__(self):
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")
        start, end, total = self.layers
        if not 0 <= start < end <= total:
            raise ValueError(f"layers [{start}, {end}) of {total} is not a run of layers")

    @property
    def directory(self) -> str:
        """This rank's store directory under the deployment's store: "rank-<r>-of-<n>"."""
        return f"rank-{self.rank}-of-{self.size}"

    def describe(self) -> dict:
        """Plain data for the store identity and for logs."""
        return {"parallel": self.parallel, "rank": self.rank, "size": self.size, "layers": list(self.layers)}


def _pipelined(model):
    """The inner module that `pipeline()` split (mlx-lm's PipelineMixin), or None."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and getattr(inner, "pipeline_size", 1) > 1 else None


def _tensor_group(model):
    """The group of the first tensor-parallel module of `model`, or None."""
    sharded = (
        nn.AllToShardedLinear, nn.ShardedToAllLinear, nn.QuantizedAllToShardedLinear, nn.QuantizedShardedToAllLinear
    )
    for _, module in model.named_modules():
        group = getattr(module, "sharding_group", None)
        if group is None and isinstance(module, sharded):
            group = module.group
        if group is not None and group.size() > 1:
            return group
    return None


def shard_of(model) -> Shard | None:
    """The slice of the model this process holds, read off the model; None if it holds all of it.

    Works on any model mlx-lm's `sharded_load` (or the model's own `shard()` /
    `model.pipeline()`) prepared.

    Raises:
        UnsupportedModelError: the model is split both ways at once (not supported).
    """
    inner = _pipelined(model)
    group = _tensor_group(model)
    if inner is not None and group is not None:
        raise UnsupportedModelError(
            "the model is split both by pipeline and by tensor parallelism; segcache supports one kind "
            "per deployment: load it with pipeline=True or without"
        )
    if inner is not None:
        return Shard("pipeline", inner.pipeline_rank, inner.pipeline_size,
                     (inner.start_idx, inner.end_idx, _total_layers(model, inner)))
    if group is not None:
        n = len(model.layers)
        return Shard("tensor", group.rank(), group.size(), (0, n, n))
    return None


def _total_layers(model, inner) -> int:
    """The model's layer count before `pipeline()` cut it (from its config)."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None), getattr(inner, "args", None)):
        if isinstance(source, dict):
            n = source.get("num_hidden_layers")
        else:
            n = getattr(source, "num_hidden_layers", None)
        if isinstance(n, int) and n >= inner.end_idx:
            return n
    return inner.end_idx  # rank 0 holds the last layers: its end is the total


def load(path, *, pipeline: bool = False, group: mx.distributed.Group | None = None, tokenizer_config=None):
    """Load a model directory sharded over `group` as mlx-lm's server does.

    Tensor parallel by default (the model's `shard()`), pipeline parallel with
    `pipeline=True` (the model's `model.pipeline()`; mlx-lm then reads only the
    weight files of this rank's layers, which needs `model.safetensors.index.json`).
    A group of one loads the whole model with `mlx_lm.load`.

    Args:
        path: a local model directory (or a Hugging Face repo id mlx-lm can fetch).
        pipeline: split the layers instead of the heads.
        group: the distributed group (default: `mx.distributed.init()`).
        tokenizer_config: passed to mlx-lm's tokenizer loader.

    Returns:
        (model, tokenizer, shard): `shard` is None for a group of one.

    Raises:
        UnsupportedModelError: the model cannot be split that way (e.g. llama has
            no `pipeline()`, qwen3_next no `shard()`).
    """
    from mlx_lm.utils import load as mlx_load
    from mlx_lm.utils import sharded_load

    group = group or mx.distributed.init()
    if group.size() == 1:
        model, tokenizer = mlx_load(str(path), tokenizer_config=tokenizer_config)
        return model, tokenizer, None
    try:
        model, tokenizer = sharded_load(
            str(path),
            pipeline_group=group if pipeline else None,
            tensor_group=None if pipeline else group,
            tokenizer_config=tokenizer_config,
        )
    except ValueError as exc:
        if "does not support" not in str(exc):
            raise
        other = "without --pipeline (tensor parallel)" if pipeline else "with --pipeline"
        raise UnsupportedModelError(f"{path}: {exc}; try {other}") from None
    return model, tokenizer, shard_of(model)
