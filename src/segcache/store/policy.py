"""The eviction order shared by the RAM and disk tiers.

Both tiers keep what saves the most recompute per byte and break ties by
recency. Utility is bucketed by powers of four so that recency decides among
records of similar worth instead of a small cost difference (a prefill timed on
a busy machine) pinning a stale record.
Every input is clamped to a finite value here, so a NaN or infinite cost (a
caller's bug, or a damaged index entry) can never break the sort order.
"""

from __future__ import annotations

import math

_MAX_BUCKET = 1_000
_UNKNOWN = -1_000  # cost unknown, zero or not a number: first to go


def safe_cost(cost) -> float:
    """Return cost as finite seconds >= 0 (NaN, negative and non-numbers -> 0, +inf -> 1e9)."""
    try:
        c = float(cost)
    except (TypeError, ValueError):
        return 0.0
    if c != c or c <= 0.0:
        return 0.0
    return min(c, 1e9)


def utility_bucket(cost: float, nbytes: int) -> int:
    """Return log4 of seconds saved per MiB, floored; higher is more worth keeping."""
    per_mib = safe_cost(cost) / max(int(nbytes), 1) * (1 << 20)
    if per_mib <= 0.0:
        return _UNKNOWN
    return max(_UNKNOWN + 1, min(_MAX_BUCKET, math.floor(math.log2(per_mib) / 2)))


def eviction_key(cost: float, nbytes: int, last_use: float) -> tuple[int, float]:
    """Sort key: records with the smallest key are evicted first."""
    lu = float(last_use)
    return (utility_bucket(cost, nbytes), lu if math.isfinite(lu) else 0.0)
