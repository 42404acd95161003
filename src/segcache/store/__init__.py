"""Persistent prefix store: a RAM tier suspended to LMDB, keyed by chained content hashes."""

from .codec import CorruptRecordError
from .identity import model_identity, weights_fingerprint
from .keys import chain_key, prefix_keys, root_key
from .record import Record
from .store import EntryInfo, PrefixStore, open_store

__all__ = [
    "CorruptRecordError",
    "EntryInfo",
    "PrefixStore",
    "Record",
    "chain_key",
    "model_identity",
    "open_store",
    "prefix_keys",
    "root_key",
    "weights_fingerprint",
]
