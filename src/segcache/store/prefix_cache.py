"""Automatic prefix cache: how a Runtime's state maps onto prefix-store records.

The cache answers and the runtime computes (as SGLang's `match_prefix` and
vLLM's `get_computed_blocks`): `resume` says how much of a prompt the store can
restore, with the layers' states, the tier they came from and where the
prefill should checkpoint on its way; `Runtime.prefill_steps` restores, feeds
the model and hands back `Snapshot`s, which `prefilled` / `publish` store.
Nothing here changes a runtime or runs the model.

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

A lookup walks the pages the store has, then reads the nodes from the deepest boundary
down for the longest prefix it can resume: where some layer resumes only from a
checkpoint ("stateful"), a checkpoint; where every layer resumes from pages, any
position whose rows a page or a checkpoint tail holds. The deepest node also
tells where the prompt leaves a published one (b above): a stateful prefill stops
there once to take a checkpoint (`Resume.stops`), so every later prompt through b
resumes from it.

The cache never looks at a layer's kind: each layer answers the persistence
protocol of `segcache.layers.protocol` (how it resumes, what it exports, the
spec of its arrays, how stored arrays become its state). Every array read back
is checked against that spec, which the store applies to the record's header
before it decodes anything. Each record names the record it extends (`parent`),
so the store evicts from the deep end and never strands a record.

Every store failure inside `resume`/`publish` (budget, corrupt record, LMDB
error, a record that does not fit the runtime) becomes a miss or a skipped
publish, counted in `stats()["errors"]` and reported as a `StoreWarning`;
generation never fails because of the store.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable

import mlx.core as mx

from ..errors import StoreError, StoreWarning
from ..layers.protocol import CHECKPOINT, PAGES
from ..spec import conforms
from . import drafter_records
from .keys import chain_key
from .layout import layout_of
from .prompt_index import CKPT, PAGE, Node, PromptKeys, common_prefix
from .record import Record
from .tier import joined


@dataclass(frozen=True)
class Resume:
    """What a prefill resumes from: the prefix cache's answer, and the first thing
    `Runtime.prefill_steps` yields.

    Attributes:
        tokens: prompt tokens the runtime holds once resumed (what it held before,
            or the tokens restored when the store has more).
        restored: tokens restored from the store (0: nothing was restored).
        tier: where the restored records came from: "ram", "disk", "remote", joined
            with "+" when several ("ram+disk"); "-" when nothing was restored.
        stops: positions past `tokens` and short of the prompt's end where the
            prefill takes a checkpoint on its way (where the prompt leaves a
            published one), besides the caller's own.
        states: per layer, the `load` arguments of the restored prefix; None when
            nothing is restored, and in what `prefill_steps` yields (the runtime
            consumed them).
        logits: the last position's logits [1, vocab] when the whole prompt was
            restored (nothing left to compute); else None, and None in what
            `prefill_steps` yields.
        drafters: (name, `load` arguments) of the drafter segments whose state
            the store holds at `tokens` (store/drafter_records.py); () in what
            `prefill_steps` yields.
    """

    tokens: int
    restored: int = 0
    tier: str = "-"
    stops: tuple[int, ...] = ()
    states: tuple | None = field(default=None, compare=False, repr=False)
    logits: mx.array | None = field(default=None, compare=False, repr=False)
    drafters: tuple = field(default=(), compare=False, repr=False)


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
        sources: the keys of the records in `rows` and `ckpt` (where the resume reads from).
    """

    resume: int = 0
    rows: list[tuple[Record, int]] = field(default_factory=list)
    ckpt: Record | None = None
    branch: int | None = None
    sources: list[bytes] = field(default_factory=list)


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
    if not store.closed:
        store.note_error()
    warnings.warn(
        f"segcache prefix store: {what} failed ({type(exc).__name__}: {exc}); continuing without it",
        StoreWarning,
        stacklevel=5,
    )


class PrefixCache:
    """The automatic prefix cache of one runtime (shared by its clones) over its store.

    It reads the runtime only through its public surface: `store`, `model`,
    `recurrent_strategy`, `cache_salt` (its isolation domain), `cache` (the
    layers' persistence protocol), `committed_tokens` and `committed_offset`;
    it never changes it.
    """

    def __init__(self, rt):
        self.store = rt.store
        self.layout = layout_of(rt)
        self.layouts = [layer.layout() for layer in rt.cache]  # the layers this cache was made for

    def _prompt(self, rt, ids: list[int]) -> PromptKeys:
        return PromptKeys(self.store, self.layout, ids, rt.cache, rt.cache_salt)

    # -- lookup and load --

    def lookup(self, rt, ids: list[int], held: int, logits: bool = True) -> tuple[Plan, str]:
        """The longest prefix of `ids` the store can restore (longer than `held`), and a branch
        point; and the tiers its records came from ("ram+disk", "-" when it restores nothing).
        `logits`: the caller needs the last position's logits, so a checkpoint of the whole
        prompt serves only if it holds them (a server's prefill of all but the last token does not).

        Raises:
            _Miss, StoreError, lmdb.Error: the caller treats any failure as a miss.
        """
        ix = self._prompt(rt, ids)
        plan = self._plan(ix, held, logits)
        return plan, joined(ix.tiers[k] for k in plan.sources)

    def _plan(self, ix: PromptKeys, held: int, logits: bool = True) -> Plan:
        lay, store, ids = self.layout, self.store, ix.ids
        L, P = len(ids), lay.page_tokens
        m = L // P
        # A remote tier answers the prompt's pages and nodes in one round trip; what
        # follows then reads the local tiers (a checkpoint past them may take one more).
        # The checkpoint at the prompt's end rides along: a prompt resumed whole (a retry,
        # a second host) needs it, and otherwise it costs one absent key in the same reply.
        pages = list(range(1, m + 1)) if lay.paged else []
        end = [L] if L > held else []
        ix.prefetch([ix.page_key(j) for j in pages] + [ix.node_key(j) for j in range(m + 1)] + [ix.ckpt_key(r) for r in end],
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
                    plan.ckpt = self._ckpt(ix, r, need_logits=logits and r == L)
                    plan.resume, plan.sources = r, [ix.ckpt_key(r)]
                    break
                except _Miss:
                    continue

        if not lay.stateful and plan.resume < L:
            # Pages only: any position whose rows a page or a tail holds will do, short
            # of the last token where its logits are wanted (computed, unless checkpointed).
            rem = ix.rem(j_max, L)
            d, src = 0, None
            for c in ix.node(j_max).conts:
                n = common_prefix(c, rem)
                if n > d:
                    d, src = n, c
            tail, key = None, None
            if d:
                key = (PAGE if len(src) == P else CKPT) + chain_key(ix.chain[j_max], src, ix.identity)
                spec = ix.rows_spec(len(src)) if len(src) == P else ix.ckpt_spec(j_max * P + len(src))
                try:
                    tail = self._fetch(ix, key, spec, (), "the rows' tail")
                except _Miss:  # evicted or dropped: the pages alone still serve
                    d = 0
            r = min(j_max * P + d, L - 1 if logits else L)
            if r > max(plan.resume, held):
                use_tail = tail is not None and r > j_max * P
                plan.ckpt, plan.resume = None, r
                plan.rows, plan.sources = self._rows(ix, r, tail if use_tail else None)
                plan.sources += [key] if use_tail else []
                return plan

        if plan.resume:
            plan.rows, pages = self._rows(ix, plan.resume, plan.ckpt)
            plan.sources += pages

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
        rec = self._fetch(ix, ix.ckpt_key(r), spec, [n for n in spec if n != "logits" or need_logits], f"checkpoint at {r}")
        if rec.kind != "ckpt" or rec.tokens != r or rec.meta.get("length") != r:
            raise _Miss(f"record at the checkpoint key of {r} is not that checkpoint")
        return rec

    def _fetch(self, ix: PromptKeys, key: bytes, spec: dict, names, what: str) -> Record:
        return self._fit(key, ix.find_many([key], [spec])[0], spec, names, what)

    def _fit(self, key: bytes, rec: Record | None, spec: dict, names, what: str) -> Record:
        """`_require`, dropping (and reporting) a record that does not fit."""
        try:
            return _require(rec, spec, names, what)
        except _Unfit as exc:
            self.store.delete(key)
            _warn(self.store, "a record check", exc)
            raise

    def _rows(self, ix: PromptKeys, r: int, tail: Record | None) -> tuple[list[tuple[Record, int]], list[bytes]]:
        """Pages 1..r//P whole, then r % P tokens from `tail` (or from page r//P + 1); and the pages' keys."""
        if not self.layout.paged:
            return [], []
        P = ix.P
        pages = list(range(1, r // P + 1))
        n = r % P
        if n and tail is None:
            if r // P + 1 >= len(ix.chain):
                raise _Miss("no source for the rows' tail")
            pages.append(r // P + 1)
        spec = ix.rows_spec(P)
        keys = [ix.page_key(j) for j in pages]
        recs = ix.find_many(keys, [spec] * len(pages))
        out = []
        for j, key, rec in zip(pages, keys, recs):
            self._fit(key, rec, spec, spec, f"page {j}")
            if rec.kind != "page" or rec.tokens not in (0, P):  # 0: a stateful model's page (P before)
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
        return out, keys

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
        return Snapshot(rt.committed_offset, {i: rt.cache[i].export_state() for i in lay.layers(CHECKPOINT)}, logits,
                        drafter_records.boundaries(rt))

    def capturing(self, rt, tokens: int) -> list | None:
        """The "checkpoint" layers of `rt` if the next forward of `tokens` tokens can keep all
        their states at positions inside it (their `captures`), so one forward passes several
        stops of a prefill (prefill.py); else None. None with drafter segments (their boundary
        states are taken between forwards) and with kv_bits (a layout may change mid-prompt)."""
        if rt.drafters or rt.kv_quantization is not None:
            return None
        layers = [rt.cache[i] for i in self.layout.layers(CHECKPOINT)]
        return layers if all(layer.captures(tokens) for layer in layers) else None

    def snapshot_cut(self, rt, length: int, cut: int) -> "Snapshot":
        """The snapshot at `length`, `cut` tokens into the forward that just ran past it (the
        "checkpoint" layers kept their states there: `captures`). It holds no logits: the head
        ran at that forward's last position only, and a later prompt whose prefill ends exactly
        at `length` resumes from an earlier checkpoint rather than one without them.

        Raises:
            KeyError: a layer kept no state there.
        """
        layers = {i: rt.cache[i].export_cut(cut) for i in self.layout.layers(CHECKPOINT)}
        return Snapshot(length, layers, None, {})

    def publish(self, rt, ids: list[int], snaps: list["Snapshot"]) -> int:
        """Store pages, the checkpoints in `snaps` and the node updates for committed tokens `ids`.

        Every snapshot is at a position <= len(ids). Returns the number of records written.
        """
        store, lay = self.store, self.layout
        P, spt, N = lay.page_tokens, lay.spt, len(ids)
        ix = self._prompt(rt, ids)
        paged = lay.layers(PAGES)
        # A page resumes alone only where every layer resumes from pages; on a stateful
        # model it serves the checkpoints past it, and says so (tokens 0: the store's units).
        page_tokens = 0 if lay.stateful else P
        puts: list[tuple[bytes, Record]] = []  # one publish enters the store together
        for j in range(1, N // P + 1):
            key = ix.page_key(j)
            if paged and not store.contains(key):
                arrays = self._rows_of(rt, paged, (j - 1) * P, j * P)
                puts.append((key, Record("page", page_tokens, arrays, {"start": (j - 1) * P}, P * spt, parent=ix.parent(j - 1))))
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
            saved = (r if lay.stateful else max(n, 1)) * spt  # dense: the tail, or at least the last forward
            meta = {"length": r, "tail": n, "layers": metas}
            puts.append((key, Record("ckpt", r, arrays, meta, saved, parent=ix.parent(j))))
        if rt.drafters:
            puts += drafter_records.puts(ix, rt, snaps, lay.spt)
        store.put_many(puts)
        # Every node this prompt extends is merged in ONE store transaction (other
        # processes extend them too); a node that already holds all this prompt adds
        # (read from RAM, or the disk in one read) costs no write at all.
        bounds = range(0, N // P + 1)
        ix.load_nodes(bounds)
        merges = []
        for j in bounds:
            cont, new_tails = ix.rem(j, N), tails.get(j, [])
            if ix.node(j).add(list(cont), new_tails):
                merges.append((ix.node_key(j), self._node_merge(ix, j, cont, new_tails)))
        if merges:  # inside the store's `merging` (a batch's step), with the other prompts' in one write
            store.merge_later(merges)
        return len(puts) + len(merges)

    def _node_merge(self, ix: PromptKeys, j: int, cont: list[int], tails: list[list[int]]):
        """The read-modify-write of node j: current record -> the node with this prompt's additions."""
        cost = self.layout.page_tokens * self.layout.spt

        def merge(current: Record | None) -> Record:
            node = Node.parse(current, ix.P)  # a node that does not conform is rewritten whole
            node.add(list(cont), tails)
            return node.record(cost, ix.parent(j))

        return merge

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

    def resume(self, rt, ids: list[int], held: int, logits: bool = True) -> Resume:
        """How far the store can take a prefill of `ids` on `rt`, which holds ids[:held]
        (`logits`: with the last position's logits, see `lookup`).

        Looks the prompt up and validates every layer's state (nothing in `rt`
        changes): the longest prefix the store restores past `held`, its states and
        tier, and the positions to checkpoint on the way. Any store failure is a
        miss (warned, counted in `errors`), never an error.
        """
        store, L = self.store, len(ids)
        if store.closed:
            return Resume(held)
        try:
            plan, tier = self.lookup(rt, ids, held, logits)
            start = max(plan.resume, held)
            stops = tuple(p for p in self.stops(plan, start, L) if start < p < L)
            if plan.resume <= held:
                return Resume(held, stops=stops)
            last = plan.ckpt.arrays.get("logits") if plan.resume == L and plan.ckpt is not None else None
            last = None if last is None else last[...]  # own array object
            states = tuple(self.states(rt, plan))
            drafters = drafter_records.resume(self._prompt(rt, ids), rt, plan.resume) \
                if rt.drafters and plan.ckpt is not None else ()
            return Resume(plan.resume, plan.resume, tier, stops, states, last, drafters)
        except Exception as exc:
            if not isinstance(exc, _Miss):
                _warn(store, "lookup", exc)
            return Resume(held)

    def failed(self, what: str, exc: BaseException) -> None:
        """A step of a prefill with this cache failed on the store's account: warn, count, go on without it."""
        _warn(self.store, what, exc)

    def stops(self, plan: Plan, start: int, length: int) -> list[int]:
        """Positions short of the prompt's end where a prefill takes a checkpoint (the branch point)."""
        return [] if plan.branch is None else [plan.branch]

    def prefilled(self, rt, ids: list[int], resume: Resume, snaps: list["Snapshot"], seconds: float) -> int:
        """A prefill of `ids` ran: it resumed `resume`, then computed the rest in `seconds` of
        forwards, taking `snaps`. Count it, learn the compute rate, publish the prompt.

        Returns the number of records written (0 also when the store failed: a warning).
        """
        store, L = self.store, len(ids)
        if store.closed:
            return 0
        store.note_prefill(L, resume.restored)
        if resume.tokens == L:
            return 0
        self.layout.learn(seconds, L - resume.tokens)
        try:
            return self.publish(rt, ids, self.chosen(snaps))
        except Exception as exc:
            _warn(store, "publish", exc)
            return 0

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
    drafters: dict = field(default_factory=dict)  # segment name -> its boundary state (drafter_records)
