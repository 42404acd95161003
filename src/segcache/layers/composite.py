"""`CacheList` as a composite segment: its children are segments, and it is one to the runtime.

falcon_h1 gives each decoder layer `CacheList(ArraysCache(2), KVCache())`:
the Mamba mixer and the attention side by side, fed the same tokens. Every
branch operation goes to every child; the children hold the same number of
tokens and the same marks (checked). Children may be composites themselves.

For the prefix store a composite with any "checkpoint" child is a
checkpoint kind: it exports every child under "<child>.<name>", a "pages"
child as its committed rows (so a checkpoint of such a composite holds its
K/V rows, not only a summary). A composite of "pages" children only is a
"pages" kind.
"""

from __future__ import annotations

from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import CacheList

from ..errors import BranchError, InvariantError, UnsupportedOperationError
from .protocol import CHECKPOINT, PAGES


class CompositeLayer(CacheList):
    """mlx-lm's `CacheList` whose children are segcache layers."""

    replaced_by = None  # CacheList has no to_quantized: never replaced (layers.compat.MlxCompat)
    kv_switches = kv_refused = False  # kv_bits leaves a composite as it is (layers.compat.MlxCompat)
    takes_trees = False  # no tree verify over children yet (layers/tree.py): chains

    def kv_form(self) -> None:
        return None

    def __init__(self, *children):
        super().__init__(*children)
        if not children:
            raise ValueError("a CompositeLayer needs at least one child")

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    @property
    def committed_offset(self) -> int:
        return self.caches[0].committed_offset

    def branch_offsets(self) -> list[int]:
        return self.caches[0].branch_offsets()

    def fork(self) -> None:
        for c in self.caches:
            c.fork()

    def commit(self, n: int) -> None:
        for c in self.caches:
            c.commit(n)

    def rollback(self) -> None:
        for c in self.caches:
            c.rollback()

    def savepoint(self):
        return tuple(c.savepoint() for c in self.caches)

    def restore(self, point) -> None:
        for c, p in zip(self.caches, point):
            c.restore(p)

    def clone(self) -> "CompositeLayer":
        return CompositeLayer(*(c.clone() for c in self.caches))

    # -- the rest of mlx-lm's cache protocol (layers.compat) -------------------------

    def take_trim(self) -> int | None:
        """The lowest offset a trim of any child left since the last call (None if none)."""
        lows = [low for c in self.caches if (low := c.take_trim()) is not None]
        return min(lows) if lows else None

    def peek_trim(self) -> int | None:
        lows = [low for c in self.caches if (low := c.peek_trim()) is not None]
        return min(lows) if lows else None

    @classmethod
    def merge(cls, caches) -> "BatchCompositeLayer":
        """mlx-lm's `CacheList.merge` (BatchGenerator): each child merged by its own kind.

        Raises:
            UnsupportedOperationError: the caches are not composites of one shape, or a
                child's kind refuses (its error says why); nothing changed.
            BranchError: a child has an open branch.
        """
        shapes = {tuple(type(c).__name__ for c in x.caches) if type(x) is cls else None for x in caches}
        if len(shapes) != 1 or None in shapes:
            raise UnsupportedOperationError(
                f"CompositeLayer.merge() of {[type(x).__name__ for x in caches]}: merge composites of one shape"
            )
        return BatchCompositeLayer(
            *(type(first).merge([x.caches[i] for x in caches]) for i, first in enumerate(caches[0].caches))
        )

    @classmethod
    def from_state(cls, state) -> "CompositeLayer":
        """A composite of the saved children (mlx-lm's `load_prompt_cache` calls this)."""
        children = []
        for child_state, name in state:
            kind = vars(mlx_cache).get(name)
            if kind is None or not hasattr(kind, "take_trim"):
                raise ValueError(f"load_prompt_cache: a CompositeLayer child of class {name!r} is not a segcache layer")
            children.append(kind.from_state(child_state))
        layer = cls(*children)
        layer.check()
        return layer

    # -- persistence protocol (layers.protocol) ------------------------------------

    @property
    def resumes_from(self) -> str:
        return CHECKPOINT if any(c.resumes_from == CHECKPOINT for c in self.caches) else PAGES

    def layout(self) -> list:
        return ["list", [c.layout() for c in self.caches]]

    def export_rows(self, start: int, end: int, *, share: bool = False) -> dict:
        return {f"{i}.{k}": a for i, c in enumerate(self.caches)
                for k, a in c.export_rows(start, end, share=share).items()}

    def export_state(self) -> tuple[dict, dict]:
        arrays, meta = {}, {}
        for i, c in enumerate(self.caches):
            if c.resumes_from == PAGES:
                got = c.export_rows(0, self.committed_offset) if self.committed_offset else {}
                m = {}
            else:
                got, m = c.export_state()
            arrays.update({f"{i}.{k}": a for k, a in got.items()})
            meta[str(i)] = m
        return arrays, meta

    def _split(self, arrays) -> list[dict]:
        parts = [{} for _ in self.caches]
        for name, a in arrays.items():
            i, _, rest = name.partition(".")
            if not i.isdigit() or int(i) >= len(self.caches) or not rest:
                raise ValueError(f"array {name!r} names no child of this composite")
            parts[int(i)][rest] = a
        return parts

    def spec(self, probe, tokens: int) -> dict:
        out = {}
        for i, (c, sub) in enumerate(zip(self.caches, self._split(probe))):
            out.update({f"{i}.{k}": e for k, e in c.spec(sub, tokens).items()})
        return out

    def state_from(self, arrays, meta, tokens: int) -> tuple:
        """One `load` argument tuple per child (PAGES children of a checkpoint get one chunk each)."""
        out = []
        for i, (c, sub) in enumerate(zip(self.caches, self._split(arrays))):
            if self.resumes_from == CHECKPOINT and c.resumes_from == PAGES:
                sub = {k: [a] for k, a in sub.items()}
            out.append(c.state_from(sub, (meta or {}).get(str(i), {}), tokens))
        return tuple(out)

    def load(self, *states) -> None:
        """Load every child, all or nothing (children's `load` rebind attributes only)."""
        if self.caches[0].branch_offsets():
            raise BranchError("load() with an open branch: commit or roll it back first")
        if len(states) != len(self.caches):
            raise ValueError(f"{len(states)} child states for {len(self.caches)} children")
        saved = [dict(vars(c)) for c in self.caches]
        try:
            for c, s in zip(self.caches, states):
                c.load(*s)
        except BaseException:
            for c, attrs in zip(self.caches, saved):
                vars(c).clear()
                vars(c).update(attrs)
            raise

    def check(self) -> None:
        for i, c in enumerate(self.caches):
            try:
                c.check()
            except InvariantError as exc:
                raise InvariantError(f"child {i}: {exc}") from None
            if c.offset != self.offset or c.branch_offsets() != self.branch_offsets():
                raise InvariantError(
                    f"child {i} holds {c.offset} tokens with branches at {c.branch_offsets()}; "
                    f"child 0 holds {self.offset} with branches at {self.branch_offsets()}"
                )


class BatchCompositeLayer(CacheList):
    """What `CompositeLayer.merge` makes: mlx-lm's `CacheList` of batched children, whose
    `extract(i)` gives row i back as a `CompositeLayer` (mlx-lm's gives a `CacheList`).
    `filter`, `extend`, `prepare`, `finalize` go to every child (mlx-lm's `CacheList`)."""

    def extract(self, idx: int) -> CompositeLayer:
        return CompositeLayer(*(c.extract(idx) for c in self.caches))
