"""update_many: a publish's node merges in ONE write transaction, all or nothing, across processes."""

import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import multiprocessing as mp
import time

import mlx.core as mx
import numpy as np
import pytest

from conftest import tiny
from segcache import Runtime
from segcache.errors import StoreError, StoreWarning
from segcache.store import Record, open_store

PER_PROC = 10
NODES = (b"na", b"nb", b"nc")


def append(item: str):
    def fn(current: Record | None) -> Record:
        items = list(current.meta["items"]) if current is not None else []
        time.sleep(0.001)  # a slow caller widens the window a non-atomic update would lose items in
        return Record("node", 0, {}, {"items": items + [item]}, cost=0.1)

    return fn


class Counting:
    """The disk tier's LMDB environment, counting the write transactions begun on it."""

    def __init__(self, env):
        self._env, self.writes = env, 0

    def begin(self, *args, write=False, **kw):
        self.writes += bool(write)
        return self._env.begin(*args, write=write, **kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


def counting(store) -> Counting:
    env = Counting(store._disk.env)
    store._disk.env = env
    return env


def _worker(path: str, who: int, start) -> None:
    with open_store(path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        start.wait(timeout=120)  # every process opened its store: they all go at once
        for i in range(PER_PROC):
            s.update_many([(k, append(f"{who}:{i}")) for k in NODES])


def test_four_processes_updating_three_nodes_together_lose_nothing(tmp_path):
    open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26).close()
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(5)  # the four workers and this process
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), who, start)) for who in range(4)]
    for p in procs:
        p.start()
    start.wait(timeout=120)
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    want = {f"{w}:{i}" for w in range(4) for i in range(PER_PROC)}
    with open_store(tmp_path, ram_bytes=0, disk_bytes=1 << 26) as s:
        lists = [s.get(k).meta["items"] for k in NODES]
    for items in lists:
        assert len(items) == len(want) and set(items) == want, f"{len(want - set(items))} items lost"
    assert lists[0] == lists[1] == lists[2]  # one transaction each: every node saw the same order


def _state(s) -> dict:
    return {e.key: (e.kind, e.tokens, s.get(e.key).meta) for e in s.entries()}


def test_a_failing_or_malformed_merge_leaves_the_store_unchanged(tmp_path):
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        s.update_many([(b"a", append("1")), (b"b", append("1"))])
        before = _state(s)

        def boom(cur):
            raise ValueError("caller failed")

        env = counting(s)
        with pytest.raises(ValueError):
            s.update_many([(b"a", append("2")), (b"c", append("2")), (b"b", boom)])
        with pytest.raises(StoreError):
            s.update_many([(b"a", append("3")), (b"b", lambda cur: Record("node", -1))])
        with pytest.raises(StoreError):
            s.update_many([(b"a", append("4")), (b"", append("4"))])  # a bad key: refused before any transaction
        assert env.writes == 2  # both aborted
        assert _state(s) == before and not s.contains(b"c")
        s.evict_ram(0)  # and the disk agrees (RAM was not changed either)
        assert _state(s) == before
        s.check()


def test_update_many_semantics(tmp_path):
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        assert s.update_many([]) == []
        got = s.update_many([(b"a", append("x")), (b"b", lambda cur: None), (b"a", append("y"))])
        assert got[0].meta["items"] == ["x"] and got[1] is None and got[2].meta["items"] == ["x", "y"]  # a repeat sees the first
        assert not s.contains(b"b") and not s._ram.is_dirty(b"a")
        s.put(b"b", Record("node", 0, {}, {"items": ["dirty"]}))  # ours, only in RAM: written first, then read
        env = counting(s)
        got = s.update_many([(b"a", lambda cur: None), (b"b", append("z"))])
        assert got[0].meta["items"] == ["x", "y"] and got[1].meta["items"] == ["dirty", "z"]
        assert env.writes == 2  # the dirty copy's suspend, then the one update
        s.evict_ram(0)
        assert s.get(b"b").meta["items"] == ["dirty", "z"]
        s.check()


# -- publishing: one transaction, the same node records as one update per node


P = 16


def _prompts(seed: int) -> list[list[int]]:
    """Prompts that share pages, diverge inside pages, extend each other and repeat."""
    rng = np.random.default_rng(seed)
    base = rng.integers(3, 60, 3 * P + 5).tolist()
    other = base[: P + 7] + rng.integers(3, 60, 2 * P).tolist()
    return [base, base[: 2 * P + 3], other, base + rng.integers(3, 60, P).tolist(), other[: P + 2], base]


def _nodes(store) -> dict:
    out = {}
    for e in store.entries():
        if e.kind == "node":
            rec = store.get(e.key)
            out[e.key] = (np.asarray(rec.arrays["seqs"]).tolist(), rec.meta, rec.parent)  # cost: a measured rate
    return out


def _one_by_one(store):
    """The path before update_many: each node merged in its own transaction."""
    one = type(store).update_many  # the instance's is patched to this
    return lambda items: [one(store, [(k, fn)])[0] for k, fn in items]


@pytest.mark.parametrize("fam", ["llama", "qwen3_5"])
def test_a_publish_writes_the_nodes_one_update_per_node_writes_in_one_transaction(tmp_path, fam, monkeypatch):
    model = tiny(fam)
    prompts = _prompts(1)
    with open_store(tmp_path / "ref", ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=P) as ref, \
         open_store(tmp_path / "new", ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=P) as new:
        monkeypatch.setattr(ref, "update_many", _one_by_one(ref))
        env = counting(new)
        for i, ids in enumerate(prompts):
            want = Runtime(model, store=ref).prefill(ids)
            before = env.writes
            got = Runtime(model, store=new).prefill(ids)
            assert mx.array_equal(got, want).item()
            assert env.writes - before == (0 if ids in prompts[:i] else 1), f"prompt {i}: {env.writes - before} write transactions"
            assert _nodes(new) == _nodes(ref), f"prompt {i}: node records differ"
        assert {e.key for e in new.entries()} == {e.key for e in ref.entries()}
        assert new.stats()["errors"] == ref.stats()["errors"] == 0
        new.check()


def test_a_republished_prompt_begins_no_write_transaction(tmp_path):
    model, ids = tiny("qwen3_5"), _prompts(2)[0]
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=P) as s:
        rt = Runtime(model, store=s)
        rt.prefill(ids)
        env = counting(s)
        assert rt.publish() == 0 and env.writes == 0
        s.evict_ram(0)  # the nodes now come from the disk, in one read
        env.writes = 0
        assert rt.publish() == 0 and env.writes == 0


@pytest.mark.parametrize("fam", ["llama", "qwen3_5"])
def test_publishes_inside_merging_write_the_nodes_of_one_by_one_in_one_transaction(tmp_path, fam, monkeypatch):
    """A batch step's prompts (the engine's `merging` block: their publishes, no lookup between
    them): one write for all, the same records. Prompts sharing no page, so the reference's
    later prefills resume nothing either; they share the root node."""
    model = tiny(fam)
    rng = np.random.default_rng(3)
    prompts = [[60 + i] + rng.integers(3, 60, n).tolist() for i, n in enumerate((P + 3, 2 * P + 5, 3 * P, 5))]
    with open_store(tmp_path / "ref", ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=P) as ref, \
         open_store(tmp_path / "new", ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=P) as new:
        monkeypatch.setattr(ref, "update_many", _one_by_one(ref))
        want = [Runtime(model, store=ref).prefill(ids) for ids in prompts]
        env = counting(new)
        with new.merging():
            got = [Runtime(model, store=new).prefill(ids) for ids in prompts]
            assert env.writes == 0  # held: nothing merged yet
        assert env.writes == 1
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))
        assert _nodes(new) == _nodes(ref)
        assert {e.key for e in new.entries()} == {e.key for e in ref.entries()}
        assert new.stats()["errors"] == ref.stats()["errors"] == 0
        new.check()


def test_a_failed_merging_write_is_a_warned_error_and_writes_nothing(tmp_path):
    with open_store(tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 26) as s:
        s.update_many([(b"a", append("1"))])
        with pytest.warns(StoreWarning, match="publish failed"):
            with s.merging():
                s.merge_later([(b"a", append("2"))])
                s.merge_later([(b"b", lambda cur: Record("node", -1))])  # malformed: the whole write fails
        assert s.stats()["errors"] == 1
        s.evict_ram(0)
        assert s.get(b"a").meta["items"] == ["1"] and not s.contains(b"b")
        s.merge_later([(b"a", append("3"))])  # outside merging: at once
        assert s.get(b"a").meta["items"] == ["1", "3"]
        s.check()
