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

import time
import warnings
from dataclasses import dataclass, field
from typing import Iterable

import mlx.core as mx

from ..errors import BranchError, StoreError, StoreWarning
from ..layers.protocol import CHECKPOINT, PAGES
from ..spec import conforms
from .keys import chain_key
from .layout import layout_of
from .prompt_index import CKPT, PAGE, Node, PromptKeys, common_prefix
from .record import Record


class _Miss(Exception):
    """A record is absent or does not fit the runtime: resume from less."""


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
        self.layouts = [layer.layout() for layer in rt.cache]  # the layers this cache was made for

    def _prompt(self, rt, ids: list[int]) -> PromptKeys:
        return PromptKeys(self.store, self.layout, ids, rt.cache)

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
        # A remote tier answers the prompt's pages and nodes in one round trip; what
        # follows then reads the local tiers (a checkpoint past them may take one more).
        # The checkpoint at the prompt's end rides along: a prompt resumed whole (a retry,
        # a second host) needs it, and otherwise it costs one absent key in the same reply.
        pages = list(range(1, m + 1)) if lay.paged else []
        end = [L] if L > held else []
        store.prefetch([ix.page_key(j) for j in pages] + [ix.node_key(j) for j in range(m + 1)] + [ix.ckpt_key(r) for r in end],
                       [ix.rows_spec(P)] * len(pages) + [ix.node_spec()] * (m + 1) + [ix.ckpt_spec(r) for r in end])
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
                n = common_prefix(c, rem)
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
                n = common_prefix(c, rem)
                if n < len(c) and n < len(rem) and (n or j_max):
                    pos = j_max * P + n
                    if max(plan.resume, held) < pos < L and (plan.branch is None or pos > plan.branch):
                        plan.branch = pos
        return plan

    def _ckpt(self, ix: PromptKeys, r: int, need_logits: bool) -> Record:
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

    def _rows(self, ix: PromptKeys, r: int, tail: Record | None) -> list[tuple[Record, int]]:
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
                # row chunks in order; token axis 2 (layers.protocol)
                arrays = {name: [rec.arrays[prefix + name][..., :n, :] for rec, n in plan.rows] for name in self.layout.probe[i]}
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

    def _merge_node(self, ix: PromptKeys, j: int, cont: list[int], tails: list[list[int]]) -> int:
        """Read-modify-write node j in one store transaction (other processes extend it too)."""
        cost = self.layout.page_tokens * self.layout.spt

        def merge(current: Record | None) -> Record:
            node = Node.parse(current, ix.P)  # a node that does not conform is rewritten whole
            node.add(list(cont), tails)
            return node.record(cost, ix.parent(j))

        self.store.update(ix.node_key(j), merge)
        return 1

    def _has_logits(self, ix: PromptKeys, r: int) -> bool:
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
        return drain(self.prefill_steps(rt, ids, step_size=step_size, checkpoints=checkpoints))

    def prefill_steps(self, rt, ids: list[int], *, step_size: int, checkpoints: Iterable[int] = (),
                      plan: Plan | None = None):
        """`Runtime.prefill_steps`: `prefill` as a generator (validated now, run as it is iterated).

        `plan`: what `lookup(rt, ids, held)` returned just before, if the caller looked already.
        """
        return self._prefill(rt, ids, check_prefill(rt, ids), step_size, checkpoints, plan)

    def _prefill(self, rt, ids: list[int], held: int, step_size: int, checkpoints: Iterable[int], plan=None):
        store = self.store if not self.store.closed else None
        L, lay = len(ids), self.layout
        resumed = 0  # tokens restored from the store
        if store is not None:
            try:
                plan = self.lookup(rt, ids, held) if plan is None else plan
                if plan.resume > held:
                    rt.restore(ids[: plan.resume], self.states(rt, plan))
                    resumed = plan.resume
            except Exception as exc:  # any store failure is a miss, never a failed prefill
                if not isinstance(exc, _Miss):
                    _warn(store, "lookup", exc)
                plan = None
        start = rt.offset
        yield start  # resumed: the caller may run other work before the first forward
        stops = {L} | {p for p in self.stops(plan, start, L, checkpoints)}
        snaps: list[Snapshot] = []
        if start == L:  # whole prompt restored from a checkpoint
            last = plan.ckpt.arrays["logits"][...]
        else:
            take = None if store is None else (lambda logits: snaps.append(self.snapshot(rt, logits)))
            last, seconds = yield from feed_steps(rt, ids, start, sorted(stops), step_size, take)
            lay.spt = seconds / (L - start)
        if store is not None:
            store.note_prefill(L, resumed)
            if start < L:
                try:  # rt's own cache: kv_bits may have quantized its KV layers on the way (another layout)
                    rt.prefix_cache().publish(rt, ids, self.chosen(snaps + [self.snapshot(rt, last)]))
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
    return drain(feed_steps(rt, ids, start, stops, step_size, at_stop))[0]


def feed_steps(rt, ids: list[int], start: int, stops: list[int], step_size: int, at_stop=None):
    """`feed` as a generator: yields the tokens fed so far between two forwards (never after
    the last); returns (the last logits, seconds spent in the forwards)."""
    pos, last, seconds = start, None, 0.0
    for stop in stops:
        while pos < stop:
            if pos > start:
                yield pos
            tic = time.perf_counter()
            end = min(pos + step_size, stop)
            out = rt.forward(ids[pos:end])
            last = out[:, -1, :] * 1  # own buffer: do not pin the [S, vocab] logits
            mx.eval(last, [layer.state for layer in rt.cache])
            mx.clear_cache()
            pos = end
            if at_stop is not None and pos == stop < len(ids):
                at_stop(last)
            seconds += time.perf_counter() - tic  # not the time the caller spent between steps
    return last, seconds


def drain(steps):
    """Run a generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


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
