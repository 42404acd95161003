"""Automatic prefix cache: how a Runtime's state maps onto prefix-store records.

P = page_tokens, t = the prompt, I = the identity (model, layer layout, page size, salt):

    c_0 = root_key(I)                  c_j = chain_key(c_{j-1}, t[(j-1)P : jP], I)

    "pg" + c_j                         page j: the rows of every "pages" layer (full
                                       attention K/V) for t[(j-1)P : jP], stored once
                                       for every prompt that starts with those jP tokens
    "ck" + chain_key(c_j, t[jP:r], I)  checkpoint after r tokens (j = r // P): the rows
                                       t[jP:r] of "pages" layers, the state of every
                                       "checkpoint" layer (window rings, conv tails, SSM
                                       states), and the logits of position r-1
    "nd" + c_j                         node at boundary jP: the continuations (<= P
                                       tokens) of published prompts past jP, and the
                                       tails of the checkpoints under c_j

      page 1      page 2      page 3
    |-----------|-----------|--------.....      prompt A, published (length LA)
    |-----------|-----------|-----x~~~~~~~~     prompt B diverges at b inside page 3
                            ^c_2  ^b     ^LA
    nd(c_2) = conts [A[2P:LA]]  ckpts [A[2P:LA]]        after A
            = conts [B[2P:3P], A[2P:LA]]  ckpts [A[2P:b], B[2P:..], A[2P:LA]]  after B

A prefill walks the pages it has, then reads the nodes from the deepest boundary
down for the longest prefix it can resume: where some layer resumes only from a
checkpoint ("stateful"), a checkpoint; where every layer resumes from pages, any
position whose rows a page or a checkpoint tail holds. The deepest node also
tells where the prompt leaves a published one (b above): a stateful prefill stops
there once to take a checkpoint, so every later prompt through b resumes from it.

The cache never looks at a layer's kind: each layer answers the persistence
protocol of `segcache.layers.protocol` (how it resumes, what it exports, the
spec of its arrays, how stored arrays become its state). Every array read back
is checked against that spec, which the store applies to the record's header
before it decodes anything. Each record names the record it extends (`parent`),
so the store evicts from the deep end and never strands a record.

Every store failure inside `prefill`/`publish` (budget, corrupt record, LMDB
error, a record that does not fit the runtime) becomes a miss or a skipped
publish, counted in `stats()["errors"]` and reported as a `StoreWarning`;
generation never fails because of the store.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import mlx.core as mx
import numpy as np

from ..errors import BranchError, StoreError, StoreWarning
from ..layers.protocol import CHECKPOINT, PAGES, conforms, spec_of
from .identity import model_identity
from .keys import chain_key, root_key
from .record import Record

APC_VERSION = 2  # record schema below; part of the identity, so a change is a miss
PAGE, CKPT, NODE = b"pg", b"ck", b"nd"
MAX_CONTS = 32  # continuations kept per node (newest first); older ones only lose branch-point hints
MAX_CKPTS = 64  # checkpoint tails kept per node (newest first)
DEFAULT_SPT = 1e-3  # seconds per token assumed before any prefill was timed


class _Miss(Exception):
    """A record is absent or does not fit the runtime: resume from less."""


# -- the layout of one runtime -------------------------------------------------------


@dataclass
class Layout:
    """What the cache knows of a model's runtime layout under one store setting.

    Attributes:
        identity: 32 bytes: model identity + layer layouts + record schema.
        page_tokens: tokens per page.
        resumes: per layer, PAGES or CHECKPOINT.
        probe: per layer, the spec of what it exported after one token.
        logits: the spec entry of one position's logits.
        spt: seconds per prompt token, measured by the last prefill that computed some.
    """

    identity: bytes
    page_tokens: int
    resumes: tuple[str, ...]
    probe: tuple[dict, ...]
    logits: tuple[str, tuple]
    spt: float = DEFAULT_SPT

    @property
    def stateful(self) -> bool:
        """True if some layer resumes only from a checkpoint."""
        return CHECKPOINT in self.resumes

    @property
    def paged(self) -> bool:
        """True if some layer keeps per-token rows in pages."""
        return PAGES in self.resumes

    def layers(self, kind: str) -> list[int]:
        return [i for i, r in enumerate(self.resumes) if r == kind]


# model -> {(page_tokens, salt, layer layouts): Layout}. The identity samples the
# weights (~10-20 ms, as much as a warm prefill) and the probe runs one forward, so
# every Runtime on one model object shares them. Call `forget(model)` after
# changing a model's weights in place.
_LAYOUTS: dict[int, tuple[weakref.ref, dict]] = {}  # id(model) -> (weak ref to it, layouts); modules are unhashable


def forget(model) -> None:
    """Drop what the cache computed about `model` (after loading other weights into it)."""
    _LAYOUTS.pop(id(model), None)


def _per_model(model) -> dict:
    entry = _LAYOUTS.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = _LAYOUTS[id(model)] = (weakref.ref(model, lambda _, k=id(model): _LAYOUTS.pop(k, None)), {})
    return entry[1]


def _probe(rt) -> tuple[tuple[dict, ...], tuple[str, tuple]]:
    """Specs of every layer's exports after one token, on a fresh runtime of the same kind."""
    fresh = type(rt)(rt.model, recurrent_strategy=rt.recurrent_strategy)
    logits = fresh.forward([0])[:, -1, :]
    specs = []
    for layer in fresh.cache:
        if layer.resumes_from == PAGES:
            specs.append(spec_of(layer.export_rows(0, 1)))
        else:
            specs.append(spec_of(layer.export_state()[0]))
    return tuple(specs), next(iter(spec_of({"x": logits}).values()))


def layout_of(rt) -> Layout:
    """The runtime's layout under its store's settings (computed once per model object)."""
    store = rt.store
    layers = [layer.layout() for layer in rt.cache]
    key = (store.page_tokens, store.salt, json.dumps(layers))
    per_model = _per_model(rt.model)
    if key not in per_model:
        base = model_identity(rt.model, page_tokens=store.page_tokens, salt=store.salt)
        desc = json.dumps({"apc": APC_VERSION, "layers": layers}, sort_keys=True).encode()
        identity = hashlib.blake2b(base + desc, digest_size=32, person=b"segcache.apc.2").digest()
        probe, logits = _probe(rt)
        resumes = tuple(layer.resumes_from for layer in rt.cache)
        per_model[key] = Layout(identity, store.page_tokens, resumes, probe, logits)
    return per_model[key]


# -- nodes ---------------------------------------------------------------------------


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


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -- one prompt's keys ---------------------------------------------------------------


@dataclass
class Plan:
    """Where a prefill resumes and what it loads.

    Attributes:
        resume: tokens restored from the store (0: nothing to load).
        rows: the sources of "pages" layers in position order: (record, its first n tokens).
        ckpt: the checkpoint "checkpoint" layers (and the logits, at resume == len) come from.
        branch: a position to checkpoint on the way (resume < branch < len), or None.
    """

    resume: int = 0
    rows: list[tuple[Record, int]] = field(default_factory=list)
    ckpt: Record | None = None
    branch: int | None = None


class _Prompt:
    """Keys and specs of one prompt under one layout, and its node reads (one prefill or publish)."""

    def __init__(self, store, lay: Layout, ids: list[int], layers: list):
        self.store, self.lay, self.ids = store, lay, ids
        self.layers = layers  # the runtime's layers; only their persistence protocol is used
        self.P = lay.page_tokens
        self.chain = [root_key(lay.identity)]
        for j in range(1, len(ids) // self.P + 1):
            self.chain.append(chain_key(self.chain[-1], ids[(j - 1) * self.P : j * self.P], lay.identity))
        self._nodes: dict[int, Node] = {}

    def page_key(self, j: int) -> bytes:
        return PAGE + self.chain[j]

    def ckpt_key(self, r: int) -> bytes:
        j = r // self.P
        return CKPT + chain_key(self.chain[j], self.ids[j * self.P : r], self.lay.identity)

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


class _Unfit(_Miss):
    """A record under our key whose arrays do not fit this runtime's layout (it is dropped)."""


def _require(rec: Record | None, spec: dict, names: Iterable[str], what: str) -> Record:
    """The record if it holds `names` and every array fits `spec`.

    The store checks `spec` on a disk record's header before decoding it; this
    checks again after, which also covers records served from RAM.

    Raises:
        _Unfit: an array does not fit (a damaged or misplaced record).
        _Miss: the record is absent or lacks a name (e.g. a checkpoint without logits).
    """
    if rec is None:
        raise _Miss(f"no {what}")
    for name, a in rec.arrays.items():
        want = spec.get(name)
        if want is None or not conforms(str(a.dtype).rsplit(".", 1)[-1], tuple(a.shape), want):
            raise _Unfit(f"{what}: array {name!r} of {a.dtype} {tuple(a.shape)} does not fit this runtime")
    missing = [n for n in names if n not in rec.arrays]
    if missing:
        raise _Miss(f"{what} lacks {missing[:3]}")
    return rec


# -- the cache -----------------------------------------------------------------------


def _warn(store, what: str, exc: BaseException) -> None:
    if store is not None and not store.closed:
        store.note_error()
    warnings.warn(
        f"segcache prefix store: {what} failed ({type(exc).__name__}: {exc}); continuing without it",
        StoreWarning,
        stacklevel=4,
    )


class PrefixCache:
    """The automatic prefix cache of one runtime (shared by its clones) over its store.

    It reads the runtime only through its public surface: `store`, `model`,
    `cache` (the layers' persistence protocol), `tokens`, `committed_tokens`,
    `offset`, `committed_offset`, `depth`, `forward` and `restore`.
    """

    def __init__(self, rt):
        self.store = rt.store
        self.layout = layout_of(rt)

    def _prompt(self, rt, ids: list[int]) -> _Prompt:
        return _Prompt(self.store, self.layout, ids, rt.cache)

    # -- lookup and load --

    def lookup(self, rt, ids: list[int], held: int) -> Plan:
        """The longest prefix of `ids` the store can restore (longer than `held`), and a branch point.

        Raises:
            _Miss, StoreError, lmdb.Error: the caller treats any failure as a miss.
        """
        lay, store = self.layout, self.store
        L, P = len(ids), lay.page_tokens
        ix = self._prompt(rt, ids)
        m = L // P
        j_max = 0
        if lay.paged:
            while j_max < m and store.contains(ix.page_key(j_max + 1)):
                j_max += 1
        else:
            j_max = m
        plan = Plan()

        # Exact checkpoints, deepest boundary first: the only way back for "checkpoint" layers.
        for j in range(j_max, -1, -1):
            if plan.ckpt is not None or (j + 1) * P <= held:
                break
            rem = ix.rem(j, L)
            for s in sorted(ix.node(j).ckpts, key=len, reverse=True):
                r = j * P + len(s)
                if r <= held or r == 0:
                    break
                if len(s) > len(rem) or rem[: len(s)] != s:
                    continue
                try:
                    plan.ckpt = self._ckpt(ix, r, need_logits=r == L)
                    plan.resume = r
                    break
                except _Miss:
                    continue

        if not lay.stateful and plan.resume < L:
            # Pages only: any position whose rows a page or a tail holds will do, short
            # of the last token (its logits must be computed, unless checkpointed).
            rem = ix.rem(j_max, L)
            d, src = 0, None
            for c in ix.node(j_max).conts:
                n = _common(c, rem)
                if n > d:
                    d, src = n, c
            tail = None
            if d:
                key = (PAGE if len(src) == P else CKPT) + chain_key(ix.chain[j_max], src, lay.identity)
                spec = ix.rows_spec(len(src)) if len(src) == P else ix.ckpt_spec(j_max * P + len(src))
                try:
                    tail = self._fetch(key, spec, (), "the rows' tail")
                except _Miss:  # evicted or dropped: the pages alone still serve
                    d = 0
            r = min(j_max * P + d, L - 1)
            if r > max(plan.resume, held):
                plan.ckpt, plan.resume = None, r
                plan.rows = self._rows(ix, r, tail if r > j_max * P else None)
                return plan

        if plan.resume:
            plan.rows = self._rows(ix, plan.resume, plan.ckpt)

        if lay.stateful:
            # Where this prompt leaves a published one inside the page after the last shared one.
            rem = ix.rem(j_max, L)
            for c in ix.node(j_max).conts:
                n = _common(c, rem)
                if n < len(c) and n < len(rem) and (n or j_max):
                    pos = j_max * P + n
                    if max(plan.resume, held) < pos < L and (plan.branch is None or pos > plan.branch):
                        plan.branch = pos
        return plan

    def _ckpt(self, ix: _Prompt, r: int, need_logits: bool) -> Record:
        spec = ix.ckpt_spec(r)
        rec = self._fetch(ix.ckpt_key(r), spec, [n for n in spec if n != "logits" or need_logits], f"checkpoint at {r}")
        if rec.kind != "ckpt" or rec.tokens != r or rec.meta.get("length") != r:
            raise _Miss(f"record at the checkpoint key of {r} is not that checkpoint")
        return rec

    def _fetch(self, key: bytes, spec: dict, names, what: str) -> Record:
        return self._fit(key, self.store.get(key, count=False, expect=spec), spec, names, what)

    def _fit(self, key: bytes, rec: Record | None, spec: dict, names, what: str) -> Record:
        """`_require`, dropping (and reporting) a record that does not fit."""
        try:
            return _require(rec, spec, names, what)
        except _Unfit as exc:
            self.store.delete(key)
            _warn(self.store, "a record check", exc)
            raise

    def _rows(self, ix: _Prompt, r: int, tail: Record | None) -> list[tuple[Record, int]]:
        """Pages 1..r//P whole, then r % P tokens from `tail` (or from page r//P + 1)."""
        if not self.layout.paged:
            return []
        P = ix.P
        pages = list(range(1, r // P + 1))
        n = r % P
        if n and tail is None:
            if r // P + 1 >= len(ix.chain):
                raise _Miss("no source for the rows' tail")
            pages.append(r // P + 1)
        spec = ix.rows_spec(P)
        keys = [ix.page_key(j) for j in pages]
        recs = self.store.get_many(keys, expects=[spec] * len(pages))
        out = []
        for j, key, rec in zip(pages, keys, recs):
            self._fit(key, rec, spec, spec, f"page {j}")
            if rec.kind != "page" or rec.tokens != P:
                raise _Miss(f"record at the key of page {j} is not a page")
            out.append((rec, P))
        if n:
            if tail is None:
                out[-1] = (out[-1][0], n)
            else:
                names = ix.rows_spec(n)
                for name in names:
                    a = tail.arrays.get(name)
                    if a is None or a.shape[2] < n:
                        raise _Miss(f"the rows' tail lacks {n} tokens of {name}")
                out.append((tail, n))
        return out

    def states(self, rt, plan: Plan) -> list[tuple]:
        """Every layer's `load` arguments for the plan's prefix (validated; nothing changes).

        Raises:
            _Miss: the records do not fit the runtime.
        """
        r, out = plan.resume, []
        for i, layer in enumerate(rt.cache):
            prefix = f"{i}."
            if layer.resumes_from == PAGES:
                arrays = {}
                for name in self.layout.probe[i]:
                    parts = [rec.arrays[prefix + name][..., :n, :] for rec, n in plan.rows]
                    arrays[name] = mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
                meta = {}
            else:
                arrays = {n[len(prefix) :]: a for n, a in plan.ckpt.arrays.items() if n.startswith(prefix)}
                meta = plan.ckpt.meta.get("layers", {}).get(str(i), {})
            try:
                out.append(layer.state_from(arrays, meta, r))
            except ValueError as exc:
                raise _Miss(f"layer {i}: {exc}") from None
        return out

    # -- publishing --

    def snapshot(self, rt, logits: mx.array | None) -> "Snapshot":
        """The committed state of every "checkpoint" layer right now (taken while computing)."""
        lay = self.layout
        return Snapshot(rt.committed_offset, {i: rt.cache[i].export_state() for i in lay.layers(CHECKPOINT)}, logits)

    def publish(self, rt, ids: list[int], snaps: list["Snapshot"]) -> int:
        """Store pages, the checkpoints in `snaps` and the node updates for committed tokens `ids`.

        Every snapshot is at a position <= len(ids). Returns the number of records written.
        """
        store, lay = self.store, self.layout
        P, spt, N = lay.page_tokens, lay.spt, len(ids)
        ix = self._prompt(rt, ids)
        written = 0
        paged = lay.layers(PAGES)
        for j in range(1, N // P + 1):
            key = ix.page_key(j)
            if paged and not store.contains(key):
                arrays = self._rows_of(rt, paged, (j - 1) * P, j * P)
                store.put(key, Record("page", P, arrays, {"start": (j - 1) * P}, P * spt, parent=ix.parent(j - 1)))
                written += 1
        tails: dict[int, list[list[int]]] = {}
        for snap in snaps:
            r = snap.length
            j, n = divmod(r, P)
            if r == 0 or (not lay.stateful and n == 0 and snap.logits is None):
                continue  # nothing a page does not already give
            key = ix.ckpt_key(r)
            tails.setdefault(j, []).append(ids[j * P : r])
            if store.contains(key) and (snap.logits is None or self._has_logits(ix, r)):
                continue
            arrays = self._rows_of(rt, paged, j * P, r) if n else {}
            metas = {}
            for i, (layer_arrays, meta) in snap.layers.items():
                arrays.update({f"{i}.{name}": a for name, a in layer_arrays.items()})
                if meta:
                    metas[str(i)] = meta
            if snap.logits is not None:
                arrays["logits"] = snap.logits
            saved = (r if lay.stateful else n) * spt
            meta = {"length": r, "tail": n, "layers": metas}
            store.put(key, Record("ckpt", r, arrays, meta, saved, parent=ix.parent(j)))
            written += 1
        for j in range(0, N // P + 1):
            cont, new_tails = ix.rem(j, N), tails.get(j, [])
            if ix.node(j).add(list(cont), new_tails):  # cheap read first: most nodes are unchanged
                written += self._merge_node(ix, j, cont, new_tails)
        return written

    def _merge_node(self, ix: _Prompt, j: int, cont: list[int], tails: list[list[int]]) -> int:
        """Read-modify-write node j in one store transaction (other processes extend it too)."""
        cost = self.layout.page_tokens * self.layout.spt

        def merge(current: Record | None) -> Record:
            node = Node.parse(current, ix.P)  # a node that does not conform is rewritten whole
            node.add(list(cont), tails)
            return node.record(cost, ix.parent(j))

        self.store.update(ix.node_key(j), merge)
        return 1

    def _has_logits(self, ix: _Prompt, r: int) -> bool:
        rec = self.store.get(ix.ckpt_key(r), count=False, expect=ix.ckpt_spec(r))
        return rec is not None and "logits" in rec.arrays

    @staticmethod
    def _rows_of(rt, layers: list[int], start: int, end: int) -> dict[str, mx.array]:
        out = {}
        for i in layers:
            out.update({f"{i}.{name}": a for name, a in rt.cache[i].export_rows(start, end).items()})
        return out

    # -- the runtime's entry points --

    def prefill(self, rt, ids: list[int], *, step_size: int, checkpoints: Iterable[int] = ()) -> mx.array:
        """`Runtime.prefill`: resume from the store, compute the rest, publish. See there."""
        held = check_prefill(rt, ids)
        store = self.store if not self.store.closed else None
        L, lay = len(ids), self.layout
        plan = None
        resumed = 0  # tokens restored from the store
        if store is not None:
            try:
                plan = self.lookup(rt, ids, held)
                if plan.resume > held:
                    rt.restore(ids[: plan.resume], self.states(rt, plan))
                    resumed = plan.resume
            except Exception as exc:  # any store failure is a miss, never a failed prefill
                if not isinstance(exc, _Miss):
                    _warn(store, "lookup", exc)
                plan = None
        start = rt.offset
        stops = {L} | {p for p in self.stops(plan, start, L, checkpoints)}
        snaps: list[Snapshot] = []
        if start == L:  # whole prompt restored from a checkpoint
            last = plan.ckpt.arrays["logits"][...]
        else:
            t0 = time.perf_counter()
            take = None if store is None else (lambda logits: snaps.append(self.snapshot(rt, logits)))
            last = feed(rt, ids, start, sorted(stops), step_size, take)
            lay.spt = (time.perf_counter() - t0) / (L - start)
        if store is not None:
            store.note_prefill(L, resumed)
            if start < L:
                try:
                    self.publish(rt, ids, self.chosen(snaps + [self.snapshot(rt, last)]))
                except Exception as exc:
                    _warn(store, "publish", exc)
        return last

    def stops(self, plan: Plan | None, start: int, length: int, checkpoints: Iterable[int]) -> list[int]:
        """Positions short of the prompt's end where a prefill takes a checkpoint."""
        out = [p for p in checkpoints if isinstance(p, int) and start < p < length]
        if plan is not None and plan.branch is not None:
            out.append(plan.branch)
        return out

    def chosen(self, snaps: list["Snapshot"]) -> list["Snapshot"]:
        """The snapshots a prefill publishes (all of them; a benchmark policy may filter)."""
        return snaps

    def publish_runtime(self, rt) -> int:
        """`Runtime.publish`: store the committed tokens and state. See there."""
        ids = rt.committed_tokens
        if None in ids:
            raise StoreError(
                "publish(): the runtime holds tokens fed without Runtime.forward, whose ids are unknown; "
                "only prompts fed through forward/prefill can be published"
            )
        if not ids or self.store.closed:
            return 0
        try:
            return self.publish(rt, ids, [self.snapshot(rt, None)])
        except Exception as exc:
            _warn(self.store, "publish", exc)
            return 0


@dataclass
class Snapshot:
    """The "checkpoint" layers' exports (and the logits) at one position, taken while computing."""

    length: int
    layers: dict[int, tuple[dict, dict]]
    logits: mx.array | None


def feed(rt, ids: list[int], start: int, stops: list[int], step_size: int, at_stop=None) -> mx.array:
    """Forward ids[start:] in chunks of `step_size` ending at each stop; returns the last logits.

    `at_stop(logits)` runs at every stop short of the end (to take a checkpoint).
    """
    pos, last = start, None
    for stop in stops:
        while pos < stop:
            end = min(pos + step_size, stop)
            out = rt.forward(ids[pos:end])
            last = out[:, -1, :] * 1  # own buffer: do not pin the [S, vocab] logits
            mx.eval(last, [layer.state for layer in rt.cache])
            mx.clear_cache()
            pos = end
        if at_stop is not None and stop < len(ids):
            at_stop(last)
    return last


def check_prefill(rt, ids: list[int]) -> int:
    """Validate a prefill request; returns how many prompt tokens the runtime already holds.

    Raises:
        BranchError: a branch is open, or the runtime holds tokens that are not a
            strict prefix of the prompt.
    """
    if rt.depth:
        raise BranchError(
            f"prefill() with {rt.depth} open branch(es): commit or roll them back first "
            "(speculative tokens are never published)"
        )
    held = rt.tokens
    if len(held) >= len(ids) or held != ids[: len(held)]:
        raise BranchError(
            f"prefill() of {len(ids)} tokens on a runtime holding {len(held)} tokens that are not a "
            "strict prefix of them; pass the whole prompt (held tokens first, at least one new), "
            "or use a fresh Runtime (or a clone of one holding a prefix)"
        )
    return len(held)
