"""Automatic prefix cache: how a Runtime's state maps onto prefix-store records.

P = page_tokens, t = the prompt, I = the identity (model, layout, page size, salt):

    c_0 = root_key(I)                  c_j = chain_key(c_{j-1}, t[(j-1)P : jP], I)

    "pg" + c_j                         page j: K/V of every full-attention layer for
                                       t[(j-1)P : jP], stored once for every prompt
                                       that starts with those jP tokens
    "ck" + chain_key(c_j, t[jP:r], I)  checkpoint after r tokens (j = r // P): the
                                       K/V tail t[jP:r], window rings, conv tails and
                                       SSM states, and the logits of position r-1
    "nd" + c_j                         node at boundary jP: the continuations (<= P
                                       tokens) of published prompts past jP, and the
                                       tails of the checkpoints under c_j

      page 1      page 2      page 3
    |-----------|-----------|--------.....      prompt A, published (length LA)
    |-----------|-----------|-----x~~~~~~~~     prompt B diverges at b inside page 3
                            ^c_2  ^b     ^LA
    nd(c_2) = conts [A[2P:LA]]  ckpts [A[2P:LA]]        after A
            = conts [B[2P:3P], A[2P:LA]]  ckpts [A[2P:b], B[2P:..], A[2P:LA]]  after B

A prefill walks the pages it has (c_1, c_2, ...), then reads the nodes from the
deepest boundary down to find the longest prefix it can resume: for models with
sliding-window or recurrent layers ("stateful"), a checkpoint; for pure
full-attention models, any position whose K/V some page or checkpoint tail holds.
The deepest node also tells where the prompt leaves a published one (b above):
a stateful prefill stops there once to take a checkpoint, so every later prompt
through b resumes from it (the "branch point").

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

import mlx.core as mx
import numpy as np

from ..errors import BranchError, StoreError, StoreWarning  # noqa: F401  (StoreWarning: re-exported)
from ..layers import KVLayer, RecurrentLayer, WindowLayer
from .identity import model_identity
from .keys import chain_key, root_key
from .record import Record

APC_VERSION = 1  # record schema below; part of the identity, so a change is a miss
PAGE, CKPT, NODE = b"pg", b"ck", b"nd"
MAX_CONTS = 32  # continuations kept per node (newest first); older ones only lose branch-point hints
MAX_CKPTS = 64  # checkpoint tails kept per node (newest first)
DEFAULT_SPT = 1e-3  # seconds per token assumed before any prefill was timed
POLICIES = ("auto", "grid")  # "grid": checkpoints only on the page grid (bench baseline)


class _Miss(Exception):
    """A record is absent or does not fit the runtime: resume from less."""


# -- binding a runtime to a store -------------------------------------------------


def _kind(layer) -> str:
    if isinstance(layer, KVLayer):
        return "kv"
    if isinstance(layer, WindowLayer):
        return "window"
    if isinstance(layer, RecurrentLayer):
        return "recurrent"
    raise StoreError(f"the prefix cache does not know layer type {type(layer).__name__}")


def _layout(layer) -> list:
    if isinstance(layer, WindowLayer):
        return ["window", layer.max_size, layer.keep]
    if isinstance(layer, RecurrentLayer):
        return ["recurrent", layer.conv_tail]
    return [_kind(layer)]


@dataclass
class Binding:
    """What a runtime (and its clones) remember about the prefix cache.

    Attributes:
        identity: 32-byte identity (model identity + runtime layout + APC schema).
        page_tokens, salt: the store settings the identity was derived for.
        kinds: per layer "kv", "window" or "recurrent".
        spt: seconds per token measured by the last prefill that computed tokens.
    """

    identity: bytes
    page_tokens: int
    salt: object
    kinds: list[str]
    spt: float = DEFAULT_SPT

    @property
    def stateful(self) -> bool:
        """True if some layer can only resume from a checkpoint (window or recurrent)."""
        return any(k != "kv" for k in self.kinds)


# id(model) -> (weak reference, {(page_tokens, salt): model identity}). Sampling the
# weights costs ~10-20 ms per call, as much as a whole warm prefill, so every
# Runtime on one model object shares one computation. Call `forget(model)` after
# changing a model's weights in place.
_IDENTITIES: dict[int, tuple[weakref.ref, dict]] = {}


def forget(model) -> None:
    """Drop the cached identity of `model` (after loading other weights into it)."""
    _IDENTITIES.pop(id(model), None)


def _model_identity(model, page_tokens: int, salt) -> bytes:
    entry = _IDENTITIES.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = _IDENTITIES[id(model)] = (weakref.ref(model, lambda _, k=id(model): _IDENTITIES.pop(k, None)), {})
    key = (page_tokens, salt)
    if key not in entry[1]:
        entry[1][key] = model_identity(model, page_tokens=page_tokens, salt=salt)
    return entry[1][key]


def bind(rt) -> Binding:
    """The runtime's binding to its store; the model identity is computed once per model."""
    store = rt.store
    b = rt._apc
    if b is not None and b.page_tokens == store.page_tokens and b.salt == store.salt:
        return b
    base = _model_identity(rt.model, store.page_tokens, store.salt)
    desc = json.dumps({"apc": APC_VERSION, "layers": [_layout(layer) for layer in rt.cache]}, sort_keys=True)
    ident = hashlib.blake2b(base + desc.encode(), digest_size=32, person=b"segcache.apc.1").digest()
    rt._apc = Binding(ident, store.page_tokens, store.salt, [_kind(layer) for layer in rt.cache])
    return rt._apc


# -- nodes ---------------------------------------------------------------------------


@dataclass
class Node:
    """Continuations past one page boundary and the checkpoint tails under it (newest first).

    Invariant: no continuation is a prefix of another; every sequence is < P+1 tokens.
    """

    conts: list[list[int]] = field(default_factory=list)
    ckpts: list[list[int]] = field(default_factory=list)

    def record(self, cost: float) -> Record:
        seqs = [t for s in self.conts + self.ckpts for t in s]
        arrays = {"seqs": mx.array(np.asarray(seqs, dtype=np.uint32))}
        meta = {"conts": [len(s) for s in self.conts], "ckpts": [len(s) for s in self.ckpts]}
        return Record("node", 0, arrays, meta, cost)

    @staticmethod
    def parse(rec: Record, page_tokens: int) -> "Node":
        try:
            lens_c, lens_k = list(rec.meta["conts"]), list(rec.meta["ckpts"])
            seqs = np.asarray(rec.arrays["seqs"]).tolist()
        except (KeyError, TypeError, ValueError):
            raise _Miss("node record lacks its fields") from None
        lens = lens_c + lens_k
        if rec.kind != "node" or sum(lens) != len(seqs) or any(not 0 <= n <= page_tokens for n in lens):
            raise _Miss("node record is inconsistent")
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


# -- the plan of a prefill ----------------------------------------------------------


@dataclass
class Plan:
    """Where a prefill resumes and what it loads.

    Attributes:
        resume: tokens restored from the store (0: nothing to load).
        kv: the K/V sources in position order: (record, first n tokens of it).
        ckpt: the checkpoint the stateful layers (and the logits, at resume == len) come from.
        branch: a position to checkpoint on the way (resume < branch < len), or None.
    """

    resume: int = 0
    kv: list[tuple[Record, int]] = field(default_factory=list)
    ckpt: Record | None = None
    branch: int | None = None


class _Index:
    """Keys of one prompt under one identity, and cached node reads (one prefill or publish)."""

    def __init__(self, store, b: Binding, ids: list[int]):
        self.store, self.b, self.ids = store, b, ids
        self.P = b.page_tokens
        self.chain = [root_key(b.identity)]
        for j in range(1, len(ids) // self.P + 1):
            self.chain.append(chain_key(self.chain[-1], ids[(j - 1) * self.P : j * self.P], b.identity))
        self._nodes: dict[int, Node] = {}

    def page_key(self, j: int) -> bytes:
        return PAGE + self.chain[j]

    def ckpt_key(self, r: int) -> bytes:
        j = r // self.P
        return CKPT + chain_key(self.chain[j], self.ids[j * self.P : r], self.b.identity)

    def node_key(self, j: int) -> bytes:
        return NODE + self.chain[j]

    def node(self, j: int) -> Node:
        if j not in self._nodes:
            rec = self.store.get(self.node_key(j), count=False)
            try:
                self._nodes[j] = Node() if rec is None else Node.parse(rec, self.P)
            except _Miss:
                self._nodes[j] = Node()
        return self._nodes[j]

    def rem(self, j: int, end: int) -> list[int]:
        """The prompt's tokens in page j+1, cut at `end`."""
        return self.ids[j * self.P : min(end, (j + 1) * self.P)]


def _check_ckpt(rec: Record | None, r: int, b: Binding, need_logits: bool) -> Record:
    if rec is None or rec.kind != "ckpt" or rec.meta.get("length") != r:
        raise _Miss(f"no checkpoint at {r}")
    if need_logits and "logits" not in rec.arrays:
        raise _Miss(f"checkpoint at {r} has no logits")
    tail = r % b.page_tokens
    for i, k in enumerate(b.kinds):
        names = {"kv": ("k", "v") if tail else (), "window": ("wk", "wv"), "recurrent": ("rc", "rs")}[k]
        if any(f"{n}{i}" not in rec.arrays for n in names):
            raise _Miss(f"checkpoint at {r} lacks layer {i}")
        if k == "kv" and tail and rec.arrays[f"k{i}"].shape[2] != tail:
            raise _Miss(f"checkpoint at {r}: layer {i} tail is not {tail} tokens")
    return rec


def lookup(store, b: Binding, ids: list[int], held: int) -> Plan:
    """The longest prefix of `ids` the store can restore (longer than `held`), and a branch point.

    Raises:
        _Miss, StoreError, lmdb.Error: the caller treats any failure as a miss.
    """
    L, P = len(ids), b.page_tokens
    ix = _Index(store, b, ids)
    m = L // P
    j_max = 0
    if "kv" in b.kinds:
        while j_max < m and store.contains(ix.page_key(j_max + 1)):
            j_max += 1
    else:
        j_max = m
    plan = Plan()

    # Exact checkpoints, deepest boundary first; they are the only way back for stateful layers.
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
                plan.ckpt = _check_ckpt(store.get(ix.ckpt_key(r), count=False), r, b, need_logits=r == L)
                plan.resume = r
                break
            except _Miss:
                continue

    if not b.stateful and plan.resume < L:
        # Full attention only: any position whose K/V a page or a tail holds will do,
        # short of the last token (its logits must be computed, unless checkpointed).
        rem = ix.rem(j_max, L)
        d, src = 0, None
        for c in ix.node(j_max).conts:
            n = _common(c, rem)
            if n > d:
                d, src = n, c
        tail = None
        if d:
            key = (PAGE if len(src) == P else CKPT) + chain_key(ix.chain[j_max], src, b.identity)
            tail = store.get(key, count=False)
            if tail is None:  # evicted or dropped: the pages alone still serve
                d = 0
        r = min(j_max * P + d, L - 1)
        if r > max(plan.resume, held):
            plan.ckpt, plan.resume = None, r
            plan.kv = _kv_sources(ix, r, tail if r > j_max * P else None)
            return plan

    if plan.resume:
        plan.kv = _kv_sources(ix, plan.resume, plan.ckpt)

    if b.stateful:
        # Where this prompt leaves a published one inside the page after the last shared one.
        rem = ix.rem(j_max, L)
        for c in ix.node(j_max).conts:
            n = _common(c, rem)
            if n < len(c) and n < len(rem) and (n or j_max):
                pos = j_max * P + n
                if max(plan.resume, held) < pos < L and (plan.branch is None or pos > plan.branch):
                    plan.branch = pos
    return plan


def _kv_sources(ix: _Index, r: int, tail: Record | None) -> list[tuple[Record, int]]:
    """Pages 1..r//P whole, then r % P tokens from `tail` (or from page r//P + 1)."""
    if "kv" not in ix.b.kinds:
        return []
    P = ix.P
    out = []
    for j in range(1, r // P + 1):
        rec = ix.store.get(ix.page_key(j), count=False)
        if rec is None or rec.kind != "page":
            raise _Miss(f"page {j} left the store")
        out.append((rec, P))
    n = r % P
    if n:
        if tail is None:
            if r // P + 1 >= len(ix.chain):
                raise _Miss("no source for the K/V tail")
            tail = ix.store.get(ix.page_key(r // P + 1), count=False)
            if tail is None:
                raise _Miss("no source for the K/V tail")
        out.append((tail, n))
    for rec, n in out:
        for i, k in enumerate(ix.b.kinds):
            if k == "kv" and (f"k{i}" not in rec.arrays or rec.arrays[f"k{i}"].shape[2] < n):
                raise _Miss(f"a K/V record lacks {n} tokens of layer {i}")
    return out


def load(rt, plan: Plan, b: Binding) -> None:
    """Replace the runtime's state by the plan's prefix; all or nothing.

    Raises:
        _Miss: the records do not fit the runtime (nothing was changed).
    """
    r = plan.resume
    states = []
    for i, (layer, k) in enumerate(zip(rt.cache, b.kinds)):
        if k == "kv":
            ks = [rec.arrays[f"k{i}"][..., :n, :] for rec, n in plan.kv]
            vs = [rec.arrays[f"v{i}"][..., :n, :] for rec, n in plan.kv]
            keys = mx.concatenate(ks, axis=2) if len(ks) > 1 else ks[0] * 1
            values = mx.concatenate(vs, axis=2) if len(vs) > 1 else vs[0] * 1
            if keys.ndim != 4 or keys.shape[2] != r or keys.shape[:3] != values.shape[:3]:
                raise _Miss(f"layer {i}: K/V of shape {keys.shape} for {r} tokens")
            states.append((keys, values))
        elif k == "window":
            wk, wv = plan.ckpt.arrays[f"wk{i}"], plan.ckpt.arrays[f"wv{i}"]
            win = {w[0]: w[1:] for w in plan.ckpt.meta.get("windows", [])}
            if i not in win or win[i][0] != r or wk.ndim != 4 or wk.shape[:3] != wv.shape[:3] or not 0 <= win[i][1] <= wk.shape[2]:
                raise _Miss(f"layer {i}: window snapshot does not fit")
            states.append((wk * 1, wv * 1, r, win[i][1]))  # the ring is written in place: own copy
        else:
            conv, state = plan.ckpt.arrays[f"rc{i}"], plan.ckpt.arrays[f"rs{i}"]
            if conv.ndim != 3 or conv.shape[1] != layer.conv_tail:
                raise _Miss(f"layer {i}: conv tail of shape {conv.shape}")
            states.append((conv, state, r))
    mx.eval([a for s in states for a in s if isinstance(a, mx.array)])
    for layer, s in zip(rt.cache, states):
        layer.load(*s)


# -- publishing ----------------------------------------------------------------------


@dataclass
class Snapshot:
    """Stateful layers (and logits) at one position, taken while computing."""

    length: int
    layers: dict[int, tuple]
    logits: mx.array | None


def take_snapshot(rt, b: Binding, logits: mx.array | None) -> Snapshot:
    """The committed window rings and recurrent states of `rt` right now."""
    layers = {i: layer.snapshot() for i, (layer, k) in enumerate(zip(rt.cache, b.kinds)) if k != "kv"}
    return Snapshot(rt.committed_offset, layers, logits)


def publish(rt, b: Binding, ids: list[int], snaps: list[Snapshot]) -> int:
    """Store pages, the checkpoints in `snaps` and the node updates for prompt `ids`.

    `ids` are the committed tokens; every snapshot is at a position <= len(ids).
    Returns the number of records written.
    """
    store, P, spt = rt.store, b.page_tokens, b.spt
    N = len(ids)
    ix = _Index(store, b, ids)
    written = 0
    kv_layers = [(i, layer) for i, (layer, k) in enumerate(zip(rt.cache, b.kinds)) if k == "kv"]
    for j in range(1, N // P + 1):
        key = ix.page_key(j)
        if kv_layers and not store.contains(key):
            arrays = {}
            for i, layer in kv_layers:
                arrays[f"k{i}"], arrays[f"v{i}"] = layer.export_pages((j - 1) * P, j * P)
            store.put(key, Record("page", P, arrays, {"start": (j - 1) * P}, P * spt))
            written += 1
    tails: dict[int, list[list[int]]] = {}
    for snap in snaps:
        r = snap.length
        j, n = divmod(r, P)
        if r == 0 or (not b.stateful and n == 0 and snap.logits is None):
            continue  # nothing a page does not already give
        key = ix.ckpt_key(r)
        tails.setdefault(j, []).append(ids[j * P : r])
        if store.contains(key) and (snap.logits is None or "logits" in (store.get(key, count=False) or Record("", 0)).arrays):
            continue
        arrays, windows = {}, []
        for i, layer in kv_layers:
            if n:
                arrays[f"k{i}"], arrays[f"v{i}"] = layer.export_pages(j * P, r)
        for i, s in snap.layers.items():
            if b.kinds[i] == "window":
                arrays[f"wk{i}"], arrays[f"wv{i}"] = s[0], s[1]
                windows.append([i, s[2], s[3]])
            else:
                arrays[f"rc{i}"], arrays[f"rs{i}"] = s[0], s[1]
        if snap.logits is not None:
            arrays["logits"] = snap.logits
        saved = (r if b.stateful else n) * spt
        store.put(key, Record("ckpt", r, arrays, {"length": r, "tail": n, "windows": windows}, saved))
        written += 1
    for j in range(0, N // P + 1):
        node = ix.node(j)
        if node.add(ix.rem(j, N), tails.get(j, [])):
            store.put(ix.node_key(j), node.record(P * spt))
            written += 1
    return written


# -- prefill -------------------------------------------------------------------------


def _warn(store, what: str, exc: BaseException) -> None:
    if store is not None and not store.closed:
        store.note_error()
    warnings.warn(f"segcache prefix store: {what} failed ({type(exc).__name__}: {exc}); continuing without it", StoreWarning, stacklevel=4)


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


def prefill(rt, ids: list[int], *, step_size: int = 2048, policy: str = "auto", checkpoints=()) -> mx.array:
    """`Runtime.prefill`: resume from the store, compute the rest, publish. See there."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    held = check_prefill(rt, ids)
    L = len(ids)
    store = rt.store if rt.store is not None and not rt.store.closed else None
    b = plan = None
    resumed = 0  # tokens restored from the store
    if store is not None:
        try:
            b = bind(rt)
            plan = lookup(store, b, ids, held)
            if policy == "grid":
                plan.branch = None
            if plan.resume > held:
                load(rt, plan, b)
                rt._tokens = list(ids[: plan.resume])
                resumed = plan.resume
        except Exception as exc:  # any store failure is a miss, never a failed prefill
            if not isinstance(exc, _Miss):
                _warn(store, "lookup", exc)
            plan = None
    start = rt.offset
    stops = {L}
    if plan is not None and plan.branch is not None:
        stops.add(plan.branch)
    if b is not None:
        stops.update(p for p in checkpoints if isinstance(p, int) and start < p < L)
    if b is not None and policy == "grid" and b.stateful:
        stops.update(range((start // b.page_tokens + 1) * b.page_tokens, L, b.page_tokens))
    snaps: list[Snapshot] = []
    last = None
    if start == L:  # whole prompt restored from a checkpoint
        last = plan.ckpt.arrays["logits"][...]
    else:
        t0 = time.perf_counter()
        pos = start
        for stop in sorted(stops):
            while pos < stop:
                end = min(pos + step_size, stop)
                out = rt.forward(ids[pos:end])
                last = out[:, -1, :] * 1  # own buffer: do not pin the [S, vocab] logits
                mx.eval(last, [layer.state for layer in rt.cache])
                mx.clear_cache()
                pos = end
            if b is not None and stop < L:
                snaps.append(take_snapshot(rt, b, last))
        if b is not None:
            b.spt = (time.perf_counter() - t0) / (L - start)
    if store is not None:
        store.note_prefill(L, resumed)
        if b is not None and start < L:
            try:
                if policy == "grid":
                    snaps = [s for s in snaps if s.length % b.page_tokens == 0]
                    if L % b.page_tokens == 0:
                        snaps.append(take_snapshot(rt, b, last))
                else:
                    snaps.append(take_snapshot(rt, b, last))
                publish(rt, b, ids, snaps)
            except Exception as exc:
                _warn(store, "publish", exc)
    return last


def publish_runtime(rt) -> int:
    """`Runtime.publish`: store the committed tokens and state. See there."""
    if rt.store is None:
        raise StoreError("publish() on a Runtime without a store: pass store=open_store(...) to Runtime()")
    rt._sync_tokens()
    ids = rt.tokens[: rt.committed_offset]
    if None in ids:
        raise StoreError(
            "publish(): the runtime holds tokens fed without Runtime.forward, whose ids are unknown; "
            "only prompts fed through forward/prefill can be published"
        )
    if not ids or rt.store.closed:
        return 0
    try:
        b = bind(rt)
        return publish(rt, b, ids, [take_snapshot(rt, b, None)])
    except Exception as exc:
        _warn(rt.store, "publish", exc)
        return 0
