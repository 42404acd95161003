"""The prefix store of one rank: its own directory, its own remote key space.

    <store>/rank-0-of-2/   data.mdb ...     rank 0's slice of every prefix
    <store>/rank-1-of-2/   data.mdb ...     rank 1's

Records are keyed by an identity that names the rank's `Shard`
(store/identity.py), so even a store given to the wrong rank, or a
single-process store, never serves a record to a rank; the directories keep
the deployments apart on disk as well, and the remote namespace gets the
rank's directory name so each rank has its own key space on a shared
Redis/Valkey.
"""

from __future__ import annotations

import os

from ..errors import StoreError
from ..store import open_store
from .shard import Shard

DEFAULT_NAMESPACE = b"segcache:1:"  # open_store's default remote namespace


def rank_path(path, shard: Shard | None) -> str:
    """Where this rank's store lives under the deployment's store directory `path`."""
    return str(path) if shard is None else os.path.join(str(path), shard.directory)


def open_rank_store(path, shard: Shard | None, **options):
    """`open_store` for one rank of a deployment (or the whole store for a single process).

    Args:
        path: the deployment's store directory; each rank opens its own
            subdirectory `rank-<r>-of-<n>` (created, mode 0700).
        shard: this rank's `Shard` (None: a single process, which opens `path` itself).
        **options: as for `segcache.open_store`; a `remote_namespace` gets the
            rank's directory name appended.

    Raises:
        StoreError: `path` holds a single-process store (data.mdb), as well as
            everything `open_store` raises.
    """
    if shard is None:
        return open_store(path, **options)
    path = str(path)
    if os.path.exists(os.path.join(path, "data.mdb")):
        raise StoreError(
            f"{path} holds a single-process prefix store; a distributed deployment keeps one store per rank "
            f"under its directory ({shard.directory}/ ...). Give the deployment a new directory"
        )
    if not os.path.isdir(path):
        try:
            os.makedirs(path, mode=0o700)
        except OSError as exc:
            if not os.path.isdir(path):  # another rank made it first: fine
                raise StoreError(f"cannot create the prefix store directory {path}: {exc}") from None
    namespace = options.pop("remote_namespace", DEFAULT_NAMESPACE)
    namespace = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return open_store(rank_path(path, shard), remote_namespace=namespace + shard.directory.encode() + b":", **options)
