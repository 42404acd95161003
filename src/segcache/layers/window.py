"""Sliding-window attention segment: mlx-lm's ring buffer plus snapshots.

The ring overwrites its oldest entries in place, so a branch cannot share it
by offset alone. `fork` keeps the pre-branch ring as new array objects over
the same data (free until the first in-place write, which then copies the
ring once: at most `max_size` tokens, never the context) and records the K/V
rows the branch appends. `commit(n)` restores the snapshot and re-appends the
first n recorded rows in the same chunks, which reproduces the exact layout
mlx-lm would have reached feeding those chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from ..errors import BranchError, InvariantError, UnsupportedOperationError
from .compat import MlxCompat, QuantizeRefused
from .protocol import CHECKPOINT
from .snapshots import SnapshotBranches


@dataclass
class _WindowMark:
    keys: mx.array | None  # ring before the branch; own array objects, never written
    values: mx.array | None
    offset: int
    idx: int
    # K/V the branch appended, one (keys, values) per update call, in call order.
    records: list[tuple[mx.array, mx.array]] = field(default_factory=list)

    @property
    def appended(self) -> int:
        return sum(k.shape[2] for k, _ in self.records)


def _view(a: mx.array | None) -> mx.array | None:
    return None if a is None else a[...]


class WindowLayer(MlxCompat, QuantizeRefused, SnapshotBranches, RotatingKVCache):
    """mlx-lm's `RotatingKVCache` (same ring layout, same logits) plus a branch stack."""

    def __init__(self, max_size: int, keep: int = 0):
        super().__init__(max_size=max_size, keep=keep)
        # marks[i]: the ring as it was when open branch i began, and what i appended.
        self.marks: list[_WindowMark] = []

    def update_and_fetch(self, keys, values):
        if self.marks:
            self.marks[-1].records.append((keys, values))
        return super().update_and_fetch(keys, values)

    def _snapshot(self) -> _WindowMark:
        return _WindowMark(_view(self.keys), _view(self.values), self.offset, self._idx)

    def _commit_prefix(self, mark: _WindowMark, n: int) -> None:
        self._restore(mark)
        for k, v in _first_tokens(mark.records, n):
            self.update_and_fetch(k, v)  # records into the enclosing branch, if any

    def _restore(self, mark: _WindowMark) -> None:
        self.keys, self.values = mark.keys, mark.values
        self.offset, self._idx = mark.offset, mark.idx

    def clone(self) -> "WindowLayer":
        """An independent layer holding the committed window (shares data until a write)."""
        other = WindowLayer(self.max_size, self.keep)
        if self.marks:
            base = self.marks[0]
            keys, values, other.offset, other._idx = base.keys, base.values, base.offset, base.idx
        else:
            keys, values, other.offset, other._idx = self.keys, self.values, self.offset, self._idx
        other.keys, other.values = _view(keys), _view(values)
        return other

    # -- the rest of mlx-lm's cache protocol (layers.compat) -------------------------

    @classmethod
    def merge(cls, caches):
        """mlx-lm's `RotatingKVCache.merge`: a batched layer with one row per cache's committed window.

        Returns a `segcache.batch.window.BatchWindowLayer` (per-row lengths, no
        left padding); its `extract(i)` gives row i back as a WindowLayer.

        Raises:
            ValueError: windows of different sizes.
            UnsupportedModelError: a cache keeps attention sinks (keep > 0).
        """
        from ..batch.window import BatchWindowLayer

        return BatchWindowLayer.merge(caches)

    @property
    def state(self):
        """mlx-lm's (keys, values, offset, keep, max_size, idx), of the committed ring."""
        if self.marks:
            m = self.marks[0]
            return m.keys, m.values, m.offset, self.keep, self.max_size, m.idx
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v) -> None:
        if self.marks:
            raise BranchError("setting state with an open branch: commit or roll it back first")
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v

    @classmethod
    def from_state(cls, state) -> "WindowLayer":
        """A layer holding `state` (mlx-lm's `load_prompt_cache` calls this)."""
        layer = cls(max_size=state[4], keep=state[3])
        layer.state = state
        return layer._checked()

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens, as mlx-lm's `RotatingKVCache.trim`, while the ring has not wrapped.

        Inside a branch the branch's records lose their last `n` rows too, so a
        full commit keeps exactly the ring mlx-lm's trim leaves and a partial
        commit re-appends only rows that were kept.

        Raises:
            UnsupportedOperationError: the ring has wrapped (`is_trimmable()` is
                False: the trimmed positions' predecessors are overwritten).
            BranchError: the trim would reach below the innermost open branch.
            Nothing changed in either case.
        """
        n = min(self.offset, n)
        if not self.is_trimmable():
            raise UnsupportedOperationError(
                f"trim({n}) on a sliding window of {self.max_size} that holds {self.offset} tokens: the ring has "
                "wrapped, so earlier tokens are overwritten (is_trimmable() is False, as in mlx-lm)"
            )
        if self.marks and n > self.offset - self.marks[-1].offset:
            raise BranchError(
                f"trim({n}) reaches below the innermost open branch (it holds "
                f"{self.offset - self.marks[-1].offset} tokens): roll the branch back instead"
            )
        super().trim(n)
        if self.marks:
            mark = self.marks[-1]
            mark.records = _first_tokens(mark.records, mark.appended - n)
        self._note_trim()
        return n

    # -- persistence protocol (layers.protocol) ------------------------------------

    resumes_from = CHECKPOINT

    def layout(self) -> list:
        return ["window", self.max_size, self.keep]

    def export_state(self) -> tuple[dict, dict]:
        """The committed ring in its exact layout (slots and rotation index), as copies.

        A later step attends exactly as mlx-lm would only from that layout.
        The copies own their data: they never pin or alias the live ring.
        """
        if self.marks:
            m = self.marks[0]
            keys, values, idx = m.keys, m.values, m.idx
        else:
            keys, values, idx = self.keys, self.values, self._idx
        if keys is None:
            return {}, {"idx": 0}
        return {"k": keys * 1, "v": values * 1}, {"idx": int(idx)}

    def spec(self, probe, tokens: int) -> dict:
        # After an S-token step the ring holds up to max_size + S - 1 slots (S <= tokens).
        ring = range(1, self.max_size + tokens)
        return {name: (dtype, (*shape[:2], ring, *shape[3:])) for name, (dtype, shape) in probe.items()}

    def state_from(self, arrays, meta, tokens: int) -> tuple:
        keys, values, idx = arrays.get("k"), arrays.get("v"), meta.get("idx")
        if tokens == 0 and keys is None and values is None:
            return None, None, 0, 0
        ok = (
            keys is not None and values is not None and keys.ndim == 4 and keys.shape[:3] == values.shape[:3]
            and isinstance(idx, int) and not isinstance(idx, bool) and 0 <= idx <= keys.shape[2]
            and tokens >= min(idx, keys.shape[2]) and tokens > 0
        )
        if not ok:
            raise ValueError(f"inconsistent ring snapshot for {tokens} tokens (index {idx!r})")
        return keys[...], values[...], tokens, idx  # own array objects: the ring is written in place

    def load(self, keys: mx.array | None, values: mx.array | None, offset: int, idx: int) -> None:
        """Replace the ring by an exported one taken after `offset` tokens.

        Raises:
            BranchError: a branch is open.
            ValueError: the snapshot is inconsistent (what `check()` would reject).
        """
        if self.marks:
            raise BranchError("load() with an open branch: commit or roll it back first")
        arrays = {} if keys is None else {"k": keys, "v": values}
        keys, values, offset, idx = self.state_from(arrays, {"idx": idx}, offset)
        self.keys, self.values, self.offset, self._idx = keys, values, int(offset), int(idx)

    def check(self) -> None:
        where = f"WindowLayer(offset={self.offset}, idx={self._idx}, depth={len(self.marks)})"
        if self.offset < 0 or self._idx < 0:
            raise InvariantError(f"{where}: negative offset or ring index")
        if self.keys is not None:
            if self.keys.shape[:3] != self.values.shape[:3] or self._idx > self.keys.shape[2]:
                raise InvariantError(f"{where}: ring shapes {self.keys.shape} do not hold the index")
        elif self.offset != 0:
            raise InvariantError(f"{where}: tokens counted but no ring")
        self._check_marks(where)


def _first_tokens(chunks, n):
    """The chunks cut to their first n tokens in total, keeping chunk boundaries."""
    out = []
    for k, v in chunks:
        if n <= 0:
            break
        take = min(n, k.shape[2])
        out.append((k[..., :take, :], v[..., :take, :]) if take < k.shape[2] else (k, v))
        n -= take
    return out
