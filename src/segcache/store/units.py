"""What a resume needs: the units the RAM and disk tiers evict, and the records nothing resumes from.

Records form a forest by `parent` (a page names the page before it; a checkpoint
and an index node name the page they extend). Each record plays one role, read
from its own fields, so the tiers need to know nothing of the prefix cache:

    end      tokens > 0: a resume can stop here (a checkpoint; a page on a model whose
             every layer resumes from pages, where any chain of pages resumes)
    support  tokens == 0 and not an index record: it serves only the ends below it
             (a page on a model with checkpoint layers: alone it resumes nothing)
    index    kind "node": it lists what lies past its parent page; kept with its parent

A record is *needed* when it is an end whose ancestors are all present (a gap
below a record makes it unreachable), an ancestor of a needed end, or an index
record whose parent is needed (or that has none). Everything else is
*unresumable*: bytes no lookup can turn into a resume.

The eviction order (`Units.order`): first every unresumable record, then whole
units, least valuable first. The unit of an end that no other needed end lies
below is the end, the support ancestors no other needed end uses, and the index
records under them: what goes. Its value is the end's cost (seconds of compute it
saves) per byte of what that cost pays for, the end and every support record
above it, shared or not (`covered`), bucketed and ordered by recency as
`policy.eviction_key`. Per byte of the unit alone, a checkpoint part way along a
prompt whose pages a deeper checkpoint also needs would look worth its whole
prompt in a few kilobytes, and old prompts' checkpoints would pin their pages
while new prompts went.
Removing a unit may leave an ancestor to a single end (whose unit grows) or to
none (an end itself, on dense models, then becomes a candidate); both are
re-ranked. Records named in ``keep`` (being written, or needed by records still
on their way) are treated as ends and their units go last.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterator

from .policy import eviction_key

INDEX_KINDS = frozenset({"node"})  # records that index what lies past their parent (store.prompt_index)


@dataclass(frozen=True)
class Item:
    """What the unit rules read of one record (plain values)."""

    key: bytes
    kind: str
    tokens: int
    nbytes: int
    parent: bytes | None
    cost: float
    last_use: float

    @property
    def index(self) -> bool:
        return self.kind in INDEX_KINDS

    @property
    def end(self) -> bool:
        return self.tokens > 0 and not self.index


class Units:
    """The needed records of one tier and its eviction order.

    Args:
        items: key -> Item, every record the tier holds.
        complete: whether an end needs every ancestor present in `items` (the disk
            tier: a gap cannot be filled). False for the RAM tier, whose records'
            parents may be on disk: an absent parent ends the chain there.
        keep: keys treated as ends that go last (a record being written; a record a
            record still in RAM extends).
        elsewhere: keys held by another tier that will reach this one (a record whose
            parent is among them is not missing its parent).
    """

    def __init__(self, items: dict[bytes, Item], *, complete: bool = True, keep=frozenset(),
                 elsewhere=frozenset()):
        self.items = items
        self.keep = {k for k in keep if k in items}
        self._elsewhere = elsewhere
        self._complete = complete
        self.kids: dict[bytes, list[bytes]] = {}  # parent -> non-index children
        self.indexes: dict[bytes | None, list[bytes]] = {}  # parent -> index records under it
        for k, it in items.items():
            p = self._parent(k)
            if it.index:
                self.indexes.setdefault(p, []).append(k)
            elif p is not None:
                self.kids.setdefault(p, []).append(k)
        self.needers: dict[bytes, int] = {}  # needed record -> needed ends strictly below it
        self.needed: set[bytes] = set()
        self._reach: dict[bytes, bool] = {}
        for k, it in items.items():
            if (k in self.keep or it.end) and not it.index and (k in self.keep or self._reachable(k)):
                self._mark(k)
        for k, it in items.items():  # index records follow their parent
            if it.index and (k in self.keep or self._index_needed(k)):
                self.needed.add(k)

    def _parent(self, k: bytes) -> bytes | None:
        p = self.items[k].parent
        return None if p == k else p

    def _reachable(self, k: bytes) -> bool:
        """Whether every ancestor of k is present (or, with complete=False, the chain simply ends)."""
        path, seen = [], set()
        ok = True
        cur = k
        while True:
            if cur in self._reach:
                ok = self._reach[cur]
                break
            if cur in seen:  # a parent cycle (a damaged store): unreachable
                ok = False
                break
            seen.add(cur)
            path.append(cur)
            p = self._parent(cur)
            if p is None or p in self._elsewhere:
                break
            if p not in self.items:
                ok = not self._complete
                break
            cur = p
        for c in path:
            self._reach[c] = ok
        return ok

    def _mark(self, end: bytes) -> None:
        self.needed.add(end)
        self.needers.setdefault(end, 0)
        seen = {end}
        p = self._parent(end)
        while p is not None and p in self.items and p not in seen:
            seen.add(p)
            self.needed.add(p)
            self.needers[p] = self.needers.get(p, 0) + 1
            p = self._parent(p)

    def _index_needed(self, k: bytes) -> bool:
        p = self._parent(k)
        if p is None or p in self._elsewhere:
            return True
        if p not in self.items:
            return not self._complete
        return p in self.needed

    def unresumable(self) -> list[bytes]:
        """Keys no resume can use, least useful first."""
        return sorted((k for k in self.items if k not in self.needed), key=self._rank_one)

    def unresumable_bytes(self) -> int:
        return sum(self.items[k].nbytes for k in self.items if k not in self.needed)

    def _rank_one(self, k: bytes):
        it = self.items[k]
        return eviction_key(it.cost, it.nbytes, it.last_use)

    def unit(self, end: bytes) -> list[bytes]:
        """The end, the support ancestors only it needs, and the index records under them (deep end first)."""
        out = [end]
        p = self._parent(end)
        while (p is not None and p in self.needed and p not in self.keep and not self.items[p].end
               and self.needers.get(p, 0) == 1 and p not in out):
            out.append(p)
            p = self._parent(p)
        for k in list(out):
            out.extend(i for i in self.indexes.get(k, ()) if i in self.needed)
        return out

    def covered(self, end: bytes) -> int:
        """Bytes of what the end's cost pays for: the end and every support record above it,
        shared or not (a checkpoint's cost counts its whole prompt; a page's on a dense model,
        its own tokens)."""
        n = self.items[end].nbytes
        p, seen = self._parent(end), {end}
        while p is not None and p in self.items and p not in seen and not self.items[p].end:
            seen.add(p)
            n += self.items[p].nbytes
            p = self._parent(p)
        return n

    def _rank(self, end: bytes):
        members = self.unit(end)
        it = self.items[end]
        return (any(k in self.keep for k in members),) + eviction_key(it.cost, self.covered(end), it.last_use)

    def order(self) -> Iterator[list[bytes]]:
        """Groups of keys to delete, in order: each unresumable record alone, then units.

        The caller deletes a group before asking for the next (the ranks of the
        remaining units depend on what is gone). Index records with no parent (a
        domain's root index) come last, once nothing else is left.
        """
        for k in self.unresumable():
            yield [k]
        version: dict[bytes, int] = {}
        heap = []

        def push(e: bytes) -> None:
            version[e] = version.get(e, 0) + 1
            heapq.heappush(heap, (self._rank(e), version[e], e))

        for k in self.needed:
            if not self.items[k].index and self.needers.get(k, 0) == 0:
                push(k)
        while heap:
            _, v, e = heapq.heappop(heap)
            if version.get(e) != v or e not in self.needed:
                continue
            members = self.unit(e)
            self._drop(e, members, push)
            yield members
        roots = sorted((k for k in self.needed if self.items[k].index), key=self._rank_one)
        for k in roots:
            self.needed.discard(k)
            yield [k]

    def _drop(self, end: bytes, members: list[bytes], push) -> None:
        gone = set(members)
        self.needed.difference_update(gone)
        p = self._parent(end)
        seen = set()
        boundary = None
        while p is not None and p in self.items and p not in seen:
            seen.add(p)
            if p in self.needers:
                self.needers[p] -= 1
                if p not in gone and boundary is None:
                    boundary = p
            p = self._parent(p)
        if boundary is None or boundary not in self.needed:
            return
        left = self.needers[boundary]
        if left == 0:
            push(boundary)  # an end (or a kept record) with nothing below it now: a candidate of its own
        elif left == 1 and not self.items[boundary].end and boundary not in self.keep:
            sole = self._sole_needer(boundary)
            if sole is not None:
                push(sole)  # its unit now reaches further up: re-rank it

    def _sole_needer(self, k: bytes) -> bytes | None:
        """The one needed end below k that has no needed end below itself."""
        stack = list(self.kids.get(k, ()))
        while stack:
            c = stack.pop()
            if c not in self.needed:
                continue
            if self.needers.get(c, 0) == 0 and (self.items[c].end or c in self.keep):
                return c
            stack.extend(self.kids.get(c, ()))
        return None
