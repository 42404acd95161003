"""What every floor needs from the ranks of a sharded deployment, and nothing of how they talk.

    Shard / shard_of   the slice of a model this process holds (read off the model):
                       part of every prefix-store identity (store/identity.py), so a
                       rank never loads another rank's slice or a single-process record
    Agreement          how the ranks agree one prefill's resume: a prefix is a hit only
                       if every rank holds it (handed to the session's prefill; a
                       process of its own is handed None)
    fingerprint        a 64-bit digest of plain values, as the ranks compare them

mlx-lm shards a model in one of two ways (`mlx_lm.utils.sharded_load`):

    tensor     `model.shard(group)`: every layer on every rank, each holding a
               slice of the heads (attention, Gated DeltaNet heads and their conv
               channels) and of the MLP; partial outputs are summed (`all_sum`)
    pipeline   `model.model.pipeline(group)`: each rank runs a contiguous run of
               layers (rank 0 the last ones) and passes the hidden state on
               (`send` / `recv_like`), then `all_gather`s the final one

The ranks of a group must feed the same chunks (their collectives pair up by
order and shape), so a prefill resumes where every rank resumes or not at all.
Each rank looks its prompt up in its own store; then

    Agreement.resume:    every rank's (held, resume, stops) ─┬─ the same everywhere: resume there
                                                            ├─ stops differ: resume, no extra checkpoint
                                                            └─ resumes differ: every rank computes from held
    restore (each rank its own records)
    Agreement.restored:  every rank restored? ── else every rank undoes its restore and computes

Two messages per prefill, before any rank runs a forward of it. A rank whose
store lost records (evicted, deleted) makes the others compute too, and every
rank publishes again, so the group heals. The messages go over a
`segcache.distributed.Channel` (anything with its `gather` and `check`); this
module imports nothing of `segcache.distributed`, which sits above it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import mlx.nn as nn
import msgpack

from .errors import RankDivergedError, UnsupportedModelError

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


def fingerprint(*values) -> int:
    """A 64-bit digest of plain values (ints, lists of ints, strings, bytes), as a signed word."""
    h = hashlib.blake2b(msgpack.packb(values, use_bin_type=True), digest_size=8, person=b"segcache.fp.1")
    return int.from_bytes(h.digest(), "little", signed=True)


class Agreement:
    """The ranks' agreement on a prefill's resume (see the module docstring).

    Args:
        channel: the group's `segcache.distributed.Channel`.
    """

    def __init__(self, channel):
        self.channel = channel

    def resume(self, held: int, resume: int, stops: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """What every rank resumes: (tokens, stops) if every rank found the same; else (held, ()).

        Args:
            held: prompt tokens the rank's runtime holds before the prefill.
            resume: the tokens its store can restore (held when it restores nothing).
            stops: positions its prefill would checkpoint on the way (besides the caller's).

        Raises:
            RankDivergedError: the ranks hold different prefixes already (not a store
                matter: the runtimes are out of step).
        """
        rows = self.channel.gather([held, resume, fingerprint(sorted(stops))])
        if len({r[0] for r in rows}) != 1:
            raise RankDivergedError(
                f"prefill: the ranks' runtimes hold different prefixes ({[r[0] for r in rows]} tokens); "
                "every rank must run the same requests in the same order"
            )
        if len({r[1] for r in rows}) != 1:
            return held, ()  # some rank lacks the prefix: every rank computes
        if len({r[2] for r in rows}) != 1:
            return resume, ()
        return resume, tuple(stops)

    def restored(self, ok: bool) -> bool:
        """True if every rank restored what was agreed (else each undoes its restore and computes)."""
        return not self.channel.check(ok).failed


def agreement(channel) -> Agreement | None:
    """The agreement over `channel` (a runtime's `group`), or None for a process of its own."""
    return None if channel is None else Agreement(channel)
