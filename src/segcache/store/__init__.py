"""Persistent prefix store: a RAM tier suspended to LMDB, keyed by chained content hashes.

What callers use: `open_store` / `PrefixStore` (the tiers behind one key -> Record
API), and `PrefixCache` with its `Resume` and `Snapshot` (how a Runtime's
prefill maps onto records; the runtime drives it). Those three load on first
use: they need the layer kinds (and so mlx-lm), which the store's own commands
do not.
"""

import importlib

from .codec import CorruptRecordError
from .identity import model_identity, weights_fingerprint
from .keys import chain_key, prefix_keys, root_key
from .record import Record
from .store import EntryInfo, Found, PrefixStore, open_store

_LAZY = {"PrefixCache": "prefix_cache", "Resume": "prefix_cache", "Snapshot": "prefix_cache"}

__all__ = [
    "CorruptRecordError",
    "EntryInfo",
    "Found",
    "PrefixStore",
    "Record",
    "chain_key",
    "model_identity",
    "open_store",
    "prefix_keys",
    "root_key",
    "weights_fingerprint",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'segcache.store' has no attribute {name!r}")
