"""segcache across the ranks of an `mx.distributed` group (tensor or pipeline parallel).

    shard.py      load(): mlx-lm's sharded_load (the Shard it names: segcache/ranks.py)
    channel.py    Channel: a few words per step between ranks (broadcast, share, check)
    lockstep.py   lockstep(): a step every rank runs, or none does
    store.py      open_rank_store(): each rank's own prefix store (rank-<r>-of-<n>)

`segcache serve` across ranks (Group, GroupScheduler) is part of the server:
serve/ranks.py. See docs/distributed.md.
"""

from .channel import Channel, ChannelStats, Step, Verdict, fingerprint
from .lockstep import lockstep
from .shard import Shard, load, shard_of
from .store import open_rank_store, rank_path

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

