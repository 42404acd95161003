"""Chained content keys: key_i = H(key_{i-1}, tokens_i, identity).

A key names a prefix, not a page: two prompts share a key exactly when they
share every token up to it and run on the same identity.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

KEY_BYTES = 32  # blake2b-256
_PERSON_ROOT = b"segcache.root.1"  # blake2b personalization (<= 16 bytes): keeps domains apart
_PERSON_CHAIN = b"segcache.key.1"
_PERSON_DOMAIN = b"segcache.dom.1"


def domain_identity(identity: bytes, salt: bytes | str | None) -> bytes:
    """The identity of one isolation domain: `identity` itself without a salt, else a hash of both.

    Every key of a prompt chains from ``root_key`` of this, so two salts share no key
    (pages, checkpoints and the index nodes alike) and the salt itself is stored nowhere.
    """
    if salt is None:
        return identity
    raw = salt.encode() if isinstance(salt, str) else bytes(salt)
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_DOMAIN)
    h.update(len(identity).to_bytes(2, "little") + identity)
    h.update(raw)
    return h.digest()


def root_key(identity: bytes) -> bytes:
    """The key of the empty prefix for one model identity."""
    return hashlib.blake2b(identity, digest_size=KEY_BYTES, person=_PERSON_ROOT).digest()


def chain_key(parent: bytes, tokens: Sequence[int] | np.ndarray, identity: bytes) -> bytes:
    """Key of ``parent``'s prefix extended by ``tokens`` (token ids < 2**32)."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_CHAIN)
    h.update(len(parent).to_bytes(2, "little") + parent)
    h.update(len(identity).to_bytes(2, "little") + identity)
    h.update(ids.astype("<u4").tobytes())
    return h.digest()


def prefix_keys(tokens: Sequence[int] | np.ndarray, identity: bytes, page_tokens: int) -> list[bytes]:
    """Keys of every whole page of tokens, in order (a trailing partial page is not keyed)."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    key, out = root_key(identity), []
    for i in range(0, len(ids) - page_tokens + 1, page_tokens):
        key = chain_key(key, ids[i : i + page_tokens], identity)
        out.append(key)
    return out
