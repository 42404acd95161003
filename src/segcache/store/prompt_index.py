"""One prompt's keys in the prefix store, and the index nodes that list what lies past a page.

See `prefix_cache` for the key scheme. A node is small and read by every
prefill that reaches its boundary; a publish rewrites the nodes it extends in one store transaction
(`PrefixStore.update_many`) so that processes extending them at once lose nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..layers.protocol import CHECKPOINT, PAGES
from .keys import chain_key, domain_identity, root_key
from .layout import Layout
from .record import Record

PAGE, CKPT, NODE = b"pg", b"ck", b"nd"
MAX_CONTS = 32  # continuations kept per node (newest first); older ones only lose branch-point hints
MAX_CKPTS = 64  # checkpoint tails kept per node (newest first)


@dataclass
class Node:
    """Continuations past one page boundary and the checkpoint tails under it (newest first).

    Invariant: no continuation is a prefix of another; every sequence has <= P tokens.
    """

    conts: list[list[int]] = field(default_factory=list)
    ckpts: list[list[int]] = field(default_factory=list)

    def record(self, cost: float, parent: bytes | None) -> Record:
        seqs = [t for s in self.conts + self.ckpts for t in s]
        arrays = {"seqs": mx.array(np.asarray(seqs, dtype=np.uint32))}
        meta = {"conts": [len(s) for s in self.conts], "ckpts": [len(s) for s in self.ckpts]}
        return Record("node", 0, arrays, meta, cost, parent=parent)

    @staticmethod
    def parse(rec: Record | None, page_tokens: int) -> "Node":
        """The node a record holds; an empty node for None or a record that does not conform."""
        if rec is None:
            return Node()
        try:
            lens_c, lens_k = list(rec.meta["conts"]), list(rec.meta["ckpts"])
            seqs = np.asarray(rec.arrays["seqs"]).tolist()
            lens = lens_c + lens_k
            ok = rec.kind == "node" and sum(lens) == len(seqs) and all(
                isinstance(n, int) and 0 <= n <= page_tokens for n in lens
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            return Node()  # repaired by the next publish, which rewrites it whole
        out, pos = [], 0
        for n in lens:
            out.append(seqs[pos : pos + n])
            pos += n
        return Node(out[: len(lens_c)], out[len(lens_c) :])

    def add(self, cont: list[int], tails: list[list[int]]) -> bool:
        """Merge a published prompt's continuation and checkpoint tails; True if anything changed."""
        changed = False
        if cont and not any(c[: len(cont)] == cont for c in self.conts):
            # ours extends every continuation that is a prefix of it: those go
            self.conts = [cont] + [c for c in self.conts if cont[: len(c)] != c]
            del self.conts[MAX_CONTS:]
            changed = True
        for s in tails:
            if s not in self.ckpts:
                self.ckpts.insert(0, s)
                changed = True
        del self.ckpts[MAX_CKPTS:]
        return changed


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptKeys:
    """Keys and specs of one prompt under one layout, and its reads (one lookup or publish).

    Attributes:
        identity: the layout's identity in the prompt's isolation domain (`salt`); every key chains from it.
        tiers: key -> the tier ("ram", "disk", "remote") each record read by `find_many` came from.
    """

    def __init__(self, store, lay: Layout, ids: list[int], layers: list, salt: bytes | str | None = None):
        self.store, self.lay, self.ids = store, lay, ids
        self.layers = layers  # the runtime's layers; only their persistence protocol is used
        self.P = lay.page_tokens
        self.identity = domain_identity(lay.identity, salt)
        self.chain = [root_key(self.identity)]
        for j in range(1, len(ids) // self.P + 1):
            self.chain.append(chain_key(self.chain[-1], ids[(j - 1) * self.P : j * self.P], self.identity))
        self._nodes: dict[int, Node] = {}
        self._brought: set[bytes] = set()  # keys the remote sent ahead (`prefetch`), held locally since
        self.tiers: dict[bytes, str] = {}

    def prefetch(self, keys: list[bytes], specs: list[dict]) -> None:
        """Ask the remote, in one round trip, for the keys no local tier holds."""
        self._brought.update(self.store.prefetch(keys, specs))

    def find_many(self, keys: list[bytes], specs: list[dict]) -> list[Record | None]:
        """The records at keys (None where absent), noting in `tiers` where each came from."""
        out = []
        for key, found in zip(keys, self.store.find_many(keys, specs)):
            if found is not None:
                self.tiers[key] = "remote" if key in self._brought else found.tier
            out.append(None if found is None else found.record)
        return out

    def page_key(self, j: int) -> bytes:
        return PAGE + self.chain[j]

    def ckpt_key(self, r: int) -> bytes:
        j = r // self.P
        return CKPT + chain_key(self.chain[j], self.ids[j * self.P : r], self.identity)

    def node_key(self, j: int) -> bytes:
        return NODE + self.chain[j]

    def parent(self, j: int) -> bytes | None:
        """The record a record under boundary j extends: page j (None at the root or without pages)."""
        return self.page_key(j) if j and self.lay.paged else None

    def node(self, j: int) -> Node:
        if j not in self._nodes:
            rec = self.store.get(self.node_key(j), count=False, expect=self.node_spec())
            self._nodes[j] = Node.parse(rec, self.P)
        return self._nodes[j]

    def load_nodes(self, bounds) -> None:
        """Read the nodes at boundaries `bounds` not read yet, in one lookup (RAM, then one disk read)."""
        todo = [j for j in bounds if j not in self._nodes]
        if todo:
            spec = self.node_spec()
            recs = self.store.get_many([self.node_key(j) for j in todo], expects=[spec] * len(todo))
            for j, rec in zip(todo, recs):
                self._nodes[j] = Node.parse(rec, self.P)

    def rem(self, j: int, end: int) -> list[int]:
        """The prompt's tokens in page j+1, cut at `end`."""
        return self.ids[j * self.P : min(end, (j + 1) * self.P)]

    # -- what each record may hold (checked on the header before decoding) --

    def node_spec(self) -> dict:
        return {"seqs": ("uint32", (range(0, (MAX_CONTS + MAX_CKPTS) * self.P + 1),))}

    def rows_spec(self, tokens: int) -> dict:
        lay, out = self.lay, {}
        for i in lay.layers(PAGES):
            for name, entry in self.layers[i].spec(lay.probe[i], tokens).items():
                out[f"{i}.{name}"] = entry
        return out

    def ckpt_spec(self, r: int) -> dict:
        lay = self.lay
        out = self.rows_spec(r % self.P) if r % self.P else {}
        for i in lay.layers(CHECKPOINT):
            for name, entry in self.layers[i].spec(lay.probe[i], r).items():
                out[f"{i}.{name}"] = entry
        out["logits"] = lay.logits
        return out
