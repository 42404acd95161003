"""segcache across the ranks of an `mx.distributed` group (tensor or pipeline parallel).

    shard.py      Shard: the slice a rank holds; load(): mlx-lm's sharded_load
    channel.py    Channel: a few words per step between ranks (broadcast, share, check)
    lockstep.py   lockstep(): a step every rank runs, or none does
    store.py      open_rank_store(): each rank's own prefix store (rank-<r>-of-<n>)

`segcache serve` across ranks (Group, GroupScheduler) is part of the server:
serve/ranks.py. See docs/distributed.md.
"""

from .channel import Channel, ChannelStats, Step, Verdict, fingerprint
from .lockstep import lockstep
from .shard import Shard, load, shard_of

__all__ = [
    "Channel",
    "ChannelStats",
    "Shard",
    "Step",
    "Verdict",
    "fingerprint",
    "load",
    "lockstep",
    "open_rank_store",
    "rank_path",
    "shard_of",
]


def __getattr__(name):
    # store.py imports segcache.store, whose identity imports shard.py from here: load it late
    if name in ("open_rank_store", "rank_path"):
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module 'segcache.distributed' has no attribute {name!r}")
