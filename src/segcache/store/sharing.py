"""A live runtime's K/V buffer shared with the store's RAM records of the same rows.

A publish copies the rows it stores (`export_rows`), so that a runtime writing on
in place neither pins them nor copies its buffer at the next write. A runtime
that nobody writes into again (a hot runtime of the server, serve/hot.py: only
its clones extend it, and a clone copies the buffer at its first write anyway)
holds those same rows in its buffer, so the copies double the conversation in
memory. `share_rows` swaps them for views of the runtime's buffer:

    runtime buffer  [ page 1 | page 2 | page 3 | tail ... | free ]
    RAM records       pg 1     pg 2     pg 3     ck(tail)          views, no bytes of their own

Only records whose bytes are equal to the runtime's rows are swapped (the RAM
tier compares them), so a record never holds other bytes than the ones it was
written with; a runtime that computed a prefix itself while another published
it leaves that record as it was. Records on disk are bytes already.
"""

from __future__ import annotations

from ..layers.protocol import PAGES
from .prompt_index import PromptKeys


def share_rows(rt) -> int:
    """Let the RAM records of `rt`'s committed tokens (pages, and checkpoint tails along them)
    hold views of its own K/V buffers where they hold equal copies.

    Returns:
        The records that now share (0 without a store, without "pages" layers, or with
        token ids unknown).
    """
    store = rt.store
    if store is None or store.closed or rt.depth:
        return 0
    cache = rt.prefix_cache()
    lay = cache.layout
    paged = lay.layers(PAGES)
    ids = rt.committed_tokens
    if not paged or not ids or None in ids:
        return 0
    ix = PromptKeys(store, lay, ids, rt.cache, rt.cache_salt)
    P, N = lay.page_tokens, len(ids)
    items = [(ix.page_key(j), _views(rt, paged, (j - 1) * P, j * P)) for j in range(1, N // P + 1)]
    for j in range(N // P + 1):
        for tail in ix.node(j).ckpts:
            r = j * P + len(tail)
            if tail and r <= N and ids[j * P : r] == tail:
                items.append((ix.ckpt_key(r), _views(rt, paged, j * P, r)))
    return store.share(items)


def _views(rt, layers: list[int], start: int, end: int) -> dict:
    """The rows [start, end) of the "pages" layers under the names a record holds them by."""
    out = {}
    for i in layers:
        out.update({f"{i}.{name}": a for name, a in rt.cache[i].export_rows(start, end, share=True).items()})
    return out
