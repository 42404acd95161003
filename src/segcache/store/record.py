"""The unit the prefix store keeps: a few named arrays plus plain metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


@dataclass
class Record:
    """One cached item (a KV page, a recurrent checkpoint, ...).

    Attributes:
        kind: What the record holds, e.g. ``"kv"`` or ``"ckpt"``; free text, <= 64 chars.
        tokens: How many prompt tokens this record lets a caller skip. 0: it resumes
            nothing alone and is kept only for the records below it (a page of a
            model with checkpoint layers; `units.py`).
        arrays: Name -> array. Arrays are immutable, so the store keeps them as given.
        meta: Plain msgpack-able values (str, int, float, bool, None, bytes, lists, dicts).
        cost: Estimated seconds of compute the record saves; drives eviction.
        parent: Key of the record this one extends (a page's previous page), or None.
            The tiers evict a record with what only it needs (`units.py`), so
            eviction never strands the records below one.
    """

    kind: str
    tokens: int
    arrays: dict[str, mx.array] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    cost: float = 0.0
    parent: bytes | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of array data (what the RAM budget counts)."""
        return sum(a.nbytes for a in self.arrays.values())
