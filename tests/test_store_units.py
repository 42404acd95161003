"""Eviction by what a resume needs (issue 33, items 1 and 4).

A full disk once held hundreds of KV pages and a handful of checkpoints: leaves
went first, and on a hybrid model the checkpoints are the leaves. Here the store
evicts units (a checkpoint and the pages only it needs) and never keeps pages
nothing can resume from; the newest prompts of a run past both budgets resume
after a restart, on a hybrid and a dense model. What is left on disk is checked
against a reference computed here from the listed entries, and resumed logits
against mlx-lm's own cache fed the prompt.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import random

import mlx.core as mx
import pytest

from conftest import tiny
from segcache import Runtime
from segcache.store import Record, open_store
from segcache.store.layout import Layout
from segcache.store.ram import footprint
from segcache.testing.statemachine import _Reference, assert_logits_close

P = 16  # page tokens


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(1, 60) for _ in range(length)] for _ in range(n)]


def resumed(model, store, ids) -> tuple[int, mx.array]:
    """(tokens the store restored, the last logits) of a fresh runtime's prefill of ids."""
    rt = Runtime(model, store=store)
    steps = rt.prefill_steps(ids)
    first = next(steps)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        logits = done.value
    return first.restored, logits


def reference_unresumable(entries) -> set[bytes]:
    """Keys no resume can use, from the listing alone: a checkpoint (or, where pages carry
    tokens, a page) with every ancestor present keeps itself and its ancestors; an index
    node lives with its parent."""
    by_key = {e.key: e for e in entries}
    parents = {e.key: e.parent for e in entries}
    live = set()
    for e in entries:
        if e.kind == "node" or e.tokens == 0:
            continue
        chain, p, ok = [e.key], parents[e.key], True
        while p is not None:
            if p not in by_key:
                ok = False
                break
            chain.append(p)
            p = parents[p]
        if ok:
            live.update(chain)
    for e in entries:
        if e.kind == "node" and (e.parent is None or e.parent in live):
            live.add(e.key)
    return set(by_key) - live


@pytest.fixture(autouse=True)
def steady_rate(monkeypatch):
    """A fixed seconds-per-token rate: on a loaded machine the first prefills' timings vary
    several-fold, which would price a few early records above the rest (cost-aware, as
    meant); here the order must follow the units and recency alone."""

    def learn(self, seconds, tokens):
        self.spt = 1e-3

    monkeypatch.setattr(Layout, "learn", learn)


def run_past_budgets(model, path, n: int, length: int):
    """Prefill n distinct prompts through a store far smaller than they need; return them.

    The disk budget keeps 7 (hybrid) to 10 (dense) of the tests' 160-token prompts and RAM one
    or two, so 20 prompts pass both at least twice over (asserted); 40 leave the same entries.

    Each prompt also checkpoints at every page (as `segcache serve --checkpoint-interval`
    does): those checkpoints share the prompt's pages with its last one, and must not
    keep old prompts' pages while the newest prompts go."""
    ps = prompts(n, length)
    with open_store(path, ram_bytes=400_000, disk_bytes=2_500_000, page_tokens=P) as s:
        for ids in ps:
            Runtime(model, store=s).prefill(ids, checkpoints=range(P, len(ids), P))
        st = s.stats()
        assert st["disk_evictions"] > 0 and st["ram_evictions"] > 0, st  # both budgets were passed
        s.check()
    return ps


def check_newest_resume(model, path, ps, newest: int, short: int = 0):
    """The newest prompts resume whole (dense: maybe `short` of the last tokens recomputed, where
    the checkpoint holding the last logits, worth one forward, went first)."""
    with open_store(path, ram_bytes=400_000, disk_bytes=2_500_000, page_tokens=P) as s:
        entries = s.entries()
        assert reference_unresumable(entries) == set()
        assert s.stats()["disk_unresumable_bytes"] == 0
        kinds = {e.kind for e in entries}
        assert "ckpt" in kinds or "page" in kinds
        for ids in ps[-newest:]:  # newest first would evict nothing either: they all fit
            got, logits = resumed(model, s, ids)
            assert got >= len(ids) - short, f"a newest prompt resumed {got} of {len(ids)} tokens"
            want = _Reference(model).logits_after([], ids)[:, -1]
            assert_logits_close(logits, want, "a resumed prompt")
        report = s.verify()
        assert report["unresumable"] == 0 and report["corrupt"] == 0


def test_hybrid_keeps_checkpoints_with_their_pages(tmp_path):
    model = tiny("qwen3_next")
    ps = run_past_budgets(model, tmp_path, 20, 160)
    with open_store(tmp_path, ram_bytes=0, disk_bytes=2_500_000, page_tokens=P) as s:
        entries = s.entries()
    pages = [e for e in entries if e.kind == "page"]
    ckpts = [e for e in entries if e.kind == "ckpt"]
    assert pages and ckpts and all(e.tokens == 0 for e in pages)  # a hybrid page resumes nothing alone
    # every page lies under some checkpoint, and every checkpoint has all its pages
    by_key = {e.key: e for e in entries}
    under = set()
    for c in ckpts:
        p = c.parent
        while p is not None:
            assert p in by_key, "a checkpoint lost a page it needs"
            under.add(p)
            p = by_key[p].parent
    assert {e.key for e in pages} <= under
    check_newest_resume(model, tmp_path, ps, 5)


def test_dense_keeps_whole_chains(tmp_path):
    model = tiny("llama")
    ps = run_past_budgets(model, tmp_path, 20, 160)
    check_newest_resume(model, tmp_path, ps, 5, short=1)


def test_unresumable_pages_go_first_and_gc_leaves_none(tmp_path):
    """Pages whose checkpoint is gone (as a crash between two flush batches leaves them) are
    evicted before any unit, and a gc leaves none, whatever its bound."""
    a = lambda i, n=4000: {"k": mx.full((n,), i % 251, dtype=mx.uint8)}  # noqa: E731
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 24) as s:
        s._disk.grace = 0.0  # no record here is on its way
        for u in range(6):  # unit u: pages p{u}.0 -> p{u}.1, checkpoint c{u} on p{u}.1
            s.put(b"p%d.0" % u, Record("page", 0, a(u), cost=1.0))
            s.put(b"p%d.1" % u, Record("page", 0, a(u), cost=1.0, parent=b"p%d.0" % u))
            s.put(b"c%d" % u, Record("ckpt", 2, a(u, 1000), cost=2.0, parent=b"p%d.1" % u))
            s.put(b"n%d" % u, Record("node", 0, a(u, 100), cost=1.0, parent=b"p%d.1" % u))
        for u in range(3):
            s.put(b"x%d" % u, Record("page", 0, a(u), cost=5.0))  # pages of a lost checkpoint
        st = s.stats()
        assert st["disk_unresumable_bytes"] > 0 and reference_unresumable(s.entries()) == {b"x0", b"x1", b"x2"}
        s.gc(st["disk_bytes"] - 1)  # one byte less: the useless pages all go, no unit needs to
        keys = {e.key for e in s.entries()}
        assert not keys & {b"x0", b"x1", b"x2"} and all(b"c%d" % u in keys for u in range(6))
        s.gc(s.stats()["disk_bytes"] // 2)  # about half: whole units, each with its pages and node
        keys = {e.key for e in s.entries()}
        for u in range(6):
            unit = {b"p%d.0" % u, b"p%d.1" % u, b"c%d" % u, b"n%d" % u}
            assert unit <= keys or not unit & keys, f"unit {u} split: {sorted(unit & keys)}"
        assert 0 < sum(b"c%d" % u in keys for u in range(6)) < 6
        assert reference_unresumable(s.entries()) == set()
        s.check()


def test_a_shared_page_stays_until_its_last_checkpoint_goes(tmp_path):
    a = lambda n: {"k": mx.zeros((n,), dtype=mx.uint8)}  # noqa: E731
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 24) as s:
        s.put(b"shared", Record("page", 0, a(8000), cost=1.0))
        s.put(b"old", Record("ckpt", 1, a(1000), cost=1.0, parent=b"shared"))
        s.put(b"new", Record("ckpt", 1, a(1000), cost=1.0, parent=b"shared"))
        s.gc(s.stats()["disk_bytes"] - 1)  # the oldest checkpoint alone: the page serves the other
        keys = {e.key for e in s.entries()}
        assert keys == {b"shared", b"new"}
        s.gc(s.stats()["disk_bytes"] - 1)  # now the unit is the checkpoint and the page
        assert s.entries() == []


def test_pages_written_before_this_change_still_resume(tmp_path):
    """Old stores: a hybrid model's pages were written with tokens = P. They still resume."""
    model = tiny("qwen3_next")
    ids = prompts(1, 80)[0]
    with open_store(tmp_path, ram_bytes=1 << 24, disk_bytes=1 << 26, page_tokens=P) as s:
        Runtime(model, store=s).prefill(ids)
        for key in [e.key for e in s.entries() if e.kind == "page"]:
            rec = s.get(key, count=False)
            s.delete(key)
            s.put(key, Record("page", P, rec.arrays, rec.meta, rec.cost, rec.parent))
    with open_store(tmp_path, ram_bytes=1 << 24, disk_bytes=1 << 26, page_tokens=P) as s:
        assert {e.tokens for e in s.entries() if e.kind == "page"} == {P}
        got, logits = resumed(model, s, ids)
        assert got == len(ids)
        assert_logits_close(logits, _Reference(model).logits_after([], ids)[:, -1], "an old store's prompt")


def test_ram_entries_stay_bounded_by_what_they_cost(tmp_path):
    """Index nodes are a few hundred bytes of arrays; what RAM holds of one costs far more
    (objects, dicts, an MLX array): the budget counts it, so entries stop growing.

    The budget holds about 75 entries (the count scales with it; each put past it costs an
    eviction and a disk write), and 6 rounds of 125 puts sample the count once it is full."""
    budget = 1 << 17
    with open_store(tmp_path, ram_bytes=budget, disk_bytes=1 << 28) as s:
        counts = []
        for i in range(750):
            s.put(b"node-%d" % i, Record("node", 0, {"seqs": mx.full((40,), i, dtype=mx.uint32)}, cost=1.0))
            if i % 125 == 124:
                counts.append(s.stats()["ram_entries"])
        rec = Record("node", 0, {"seqs": mx.zeros((40,), dtype=mx.uint32)})
        most = budget // footprint(b"node-0000", rec)
        assert max(counts) <= most and max(counts) - min(counts[1:]) <= 1, counts
        assert most < budget // rec.nbytes // 8  # the arrays alone would admit 8x as many
        s.check()


def test_a_prompts_checkpoints_along_its_pages_do_not_outlive_newer_prompts(tmp_path):
    """Checkpoints at every page of a prompt share its pages with its last one: each is worth
    its tokens over the pages it needs, not over its own few bytes, so an older prompt goes
    whole before a newer one loses anything."""

    def put_prompt(s, name: bytes):  # the shipped target's sizes: 256-token pages of 0.5 MB, states of 45 KB
        parent = None
        for j in range(1, 5):
            page = b"%s.p%d" % (name, j)
            s.put(page, Record("page", 0, {"k": mx.zeros((500_000,), dtype=mx.uint8)}, cost=1.24, parent=parent))
            s.put(b"%s.c%d" % (name, j), Record("ckpt", 256 * j, {"s": mx.zeros((45_000,), dtype=mx.uint8)},
                                                 cost=1.24 * j, parent=page))
            parent = page
        s.put(name + b".end", Record("ckpt", 1058, {"s": mx.zeros((105_000,), dtype=mx.uint8)}, cost=5.1, parent=parent))
        return {e.key for e in s.entries() if e.key.startswith(name + b".")}

    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        old = put_prompt(s, b"old")
        new = put_prompt(s, b"new")
        s.gc(sum(e.nbytes for e in s.entries() if e.key in new))
        keys = {e.key for e in s.entries()}
        assert keys == new, f"left of the old prompt {sorted(keys & old)}, lost of the new {sorted(new - keys)}"
