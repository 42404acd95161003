"""A runtime's drafter segments in the prefix store, saved and resumed with the prompt's records.

A drafter segment (segcache/drafter_segments.py; the MTP head's cache: mtp/state.py) is one
behind the target: after r tokens it holds r - 1 pairs (K/V rows, pair p made of position
p's hidden state and token p+1) and the hidden state of position r-1 (the boundary's, what
the target's output head read there). With P tokens a page and m = (r - 1) // P:

    "dp" + D(page_key(j), t[jP])   drafter page j: rows of pairs [(j-1)P, jP)     parent: page j-1's, tokens 0
    "dc" + D(ckpt_key(r))          drafter checkpoint at r: rows of pairs [mP, r-1) parent: page m's
                                   and the boundary's hidden state               tokens r (an end)

D(k, ...) hashes the target's key with the segment's identity (the drafter's weights):
the target's keys carry the model, the layout and the isolation domain already, and
another drafter's records are other keys, so another head is a miss for its own state
while the target's records still serve. A drafter page names token jP besides the
page's tokens: pair jP-1 is made of it. A drafter resumes only where its target resumed
at a checkpoint r (the boundary state is taken only there); a target that resumes from
pages alone at another position leaves it stale (its drafter then recomputes).

Records are checked against the segment's own spec (`seg.spec(pairs, boundary)`) on the header
before decoding and on the arrays after, like the target's; a record that does not fit
is dropped and counted, and the drafter stays stale (a miss, never a wrong state).
"""

from __future__ import annotations

import hashlib

from ..spec import conforms
from .record import Record

DPAGE, DCKPT = b"dp", b"dc"
_PERSON = b"segcache.drft.1"


def _key(tag: bytes, base: bytes, identity: bytes, extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    for part in (base, identity, extra):
        h.update(len(part).to_bytes(2, "little") + part)
    return tag + h.digest()


def page_key(ix, seg, j: int) -> bytes:
    return _key(DPAGE, ix.page_key(j), seg.identity, int(ix.ids[j * ix.P]).to_bytes(4, "little"))


def ckpt_key(ix, seg, r: int) -> bytes:
    return _key(DCKPT, ix.ckpt_key(r), seg.identity)


def live(rt, length: int) -> list:
    """The runtime's drafter segments that account for exactly `length` tokens."""
    return [s for s in rt.drafters.segments if s.offset == length]


def boundaries(rt) -> dict:
    """Each live segment's boundary state at the committed end (a snapshot's share)."""
    n = rt.committed_offset
    return {s.name: s.boundary() for s in live(rt, n) if n and not rt.depth}


def puts(ix, rt, snaps, spt: float) -> list[tuple[bytes, Record]]:
    """The records of every snapshot's drafter boundaries (pages first), for segments still live
    at the runtime's committed end; what the store holds already is not written again."""
    store, P, N = ix.store, ix.P, rt.committed_offset
    out: list[tuple[bytes, Record]] = []
    for seg in live(rt, N):
        pages_done: set[int] = set()
        for snap in snaps:
            hidden = snap.drafters.get(seg.name)
            r = snap.length
            if hidden is None or not 0 < r <= N:
                continue
            m = (r - 1) // P
            for j in range(1, m + 1):
                key = page_key(ix, seg, j)
                if j in pages_done or store.contains(key):
                    continue
                parent = page_key(ix, seg, j - 1) if j > 1 else None
                out.append((key, Record("dpage", 0, seg.export_rows((j - 1) * P, j * P), {"start": (j - 1) * P},
                                        P * spt, parent=parent)))
                pages_done.add(j)
            key = ckpt_key(ix, seg, r)
            if store.contains(key):
                continue
            arrays = seg.export_rows(m * P, r - 1) if r - 1 > m * P else {}
            arrays["hidden"] = hidden
            out.append((key, Record("dckpt", r, arrays, {"length": r, "drafter": seg.name}, r * spt,
                                    parent=page_key(ix, seg, m) if m else None)))
    return out


def resume(ix, rt, r: int) -> tuple:
    """(name, `seg.load` arguments) for every segment of `rt` whose records at the checkpoint r are
    all stored and fit; the others are left out (they stay stale)."""
    out = []
    P, m = ix.P, (r - 1) // ix.P
    for seg in rt.drafters.segments:
        keys = [page_key(ix, seg, j) for j in range(1, m + 1)] + [ckpt_key(ix, seg, r)]
        specs = [seg.spec(P, boundary=False)] * m + [seg.spec(r - 1 - m * P)]
        recs = ix.find_many(keys, specs)
        if any(rec is None or not _fits(rec, spec) for rec, spec in zip(recs, specs)):
            for key, rec, spec in zip(keys, recs, specs):
                if rec is not None and not _fits(rec, spec):
                    ix.store.delete(key)  # under our key but not of this layout: never served
            continue
        *pages, ck = recs
        if ck.kind != "dckpt" or ck.tokens != r or ck.meta.get("length") != r:
            continue
        rows = [rec for rec in pages] + ([ck] if r - 1 > m * P else [])
        chunks = {name: [rec.arrays[name] for rec in rows] for name in ("k", "v")} if rows else {}
        try:
            keys_, values = seg.rows_from(chunks, r - 1)
        except ValueError:
            continue
        out.append((seg.name, (keys_, values, r - 1, ck.arrays["hidden"][...])))
    return tuple(out)


def _fits(rec: Record, spec: dict) -> bool:
    if set(rec.arrays) != set(spec):
        return False
    return all(conforms(str(a.dtype).rsplit(".", 1)[-1], tuple(a.shape), spec[n]) for n, a in rec.arrays.items())


def load(rt, states: tuple) -> list[str]:
    """Load each segment's stored state into `rt` (after `Runtime.restore` left them stale).

    Returns the names of the segments loaded. A state that does not load leaves its segment stale.
    """
    done = []
    for name, state in states:
        seg = rt.drafters.get(name)
        if seg is None:
            continue
        try:
            seg.load(*state)
        except Exception:  # a state that does not load is a miss: the segment stays stale
            continue
        done.append(name)
    return done
