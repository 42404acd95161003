"""Loading a model sharded over the ranks the way mlx-lm does (`mlx_lm.utils.sharded_load`).

The `Shard` it names (which slice this rank holds) and `shard_of` live in
`segcache/ranks.py`, below the store that puts them into every identity; they
are re-exported here.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UnsupportedModelError
from ..ranks import PARALLEL, Shard, shard_of

__all__ = ["PARALLEL", "Shard", "load", "shard_of"]


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
