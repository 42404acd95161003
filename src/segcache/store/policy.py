"""The eviction order shared by the RAM and disk tiers.

Both tiers keep what saves the most recompute per byte and break ties by
recency. Utility is bucketed by powers of two so that recency decides among
records of similar worth instead of a 1% cost difference pinning a stale record.
"""

from __future__ import annotations

import math


def utility_bucket(cost: float, nbytes: int) -> int:
    """Return log2 of seconds saved per MiB, floored; higher is more worth keeping."""
    per_mib = max(cost, 0.0) / max(nbytes, 1) * (1 << 20)
    if per_mib <= 0.0:
        return -1_000  # cost unknown or zero: first to go
    return math.floor(math.log2(per_mib))


def eviction_key(cost: float, nbytes: int, last_use: float) -> tuple[int, float]:
    """Sort key: records with the smallest key are evicted first."""
    return (utility_bucket(cost, nbytes), last_use)
