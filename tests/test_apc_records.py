"""Issue 9, defects 8 and 10: a record is served only under its own key and only if it fits.

Records are damaged the way a bad restore or a misplaced write would: arrays of
another shape or dtype under their own key, CRC-valid values moved between keys,
a page of another model with the same architecture. Every prefill must then
equal a cold computation, and nothing wrong is served.
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import contextlib
import random
import warnings

import lmdb
import mlx.core as mx
import pytest

from conftest import tiny
from segcache import Runtime, open_store
from segcache.errors import StoreWarning
from segcache.store import Record
from segcache.testing import models

P = 16


def ids(n, seed=0):
    rnd = random.Random(seed)
    return [rnd.randrange(models.VOCAB) for _ in range(n)]


def store_at(path, **kw):
    return open_store(path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=P, **kw)


def cold(model, prompt):
    return Runtime(model).prefill(prompt)


def assert_cold(got, model, prompt):
    want = cold(model, prompt)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max().item()


@contextlib.contextmanager
def tolerated():
    """Damage may be reported (StoreWarning) but must never be served."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        yield


def entries(store, kind):
    return [e.key for e in store.entries() if e.kind == kind]


def _retype(rec: Record, change) -> Record:
    arrays = {name: change(name, a) for name, a in rec.arrays.items()}
    return Record(rec.kind, rec.tokens, arrays, dict(rec.meta), rec.cost, parent=rec.parent)


DAMAGE = {
    # name -> (family, record kind, how an array changes)
    "logits of another shape": ("qwen3_5", "ckpt", lambda n, a: a[:, :32] if n == "logits" else a),
    "logits of another dtype": ("qwen3_5", "ckpt", lambda n, a: a.astype(mx.float16) if n == "logits" else a),
    "recurrent state of another shape": ("qwen3_5", "ckpt", lambda n, a: a[:, :1] if n.endswith(".state") else a),
    "page re-typed as int32": ("llama", "page", lambda n, a: a.view(mx.int32)),
    "window ring of another head count": ("gemma3_text", "ckpt", lambda n, a: a[:, :1] if n in ("0.k", "0.v", "1.k", "1.v") else a),
}


@pytest.mark.parametrize("tier", ["ram", "disk"])
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_record_that_does_not_fit_the_layout_is_never_served(tmp_path, case, tier):
    family, kind, change = DAMAGE[case]
    model, prompt = tiny(family), ids(40, seed=5)
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(prompt)
        keys = entries(store, kind)
        assert keys, f"no {kind} record was published"
        for key in keys:
            store.put(key, _retype(store.get(key, count=False), change))
        if tier == "disk":
            store.evict_ram(0)
        with tolerated():
            got = Runtime(model, store=store).prefill(prompt)
            longer = prompt + ids(5, seed=6)
            got_longer = Runtime(model, store=store).prefill(longer)
        assert_cold(got, model, prompt)
        assert_cold(got_longer, model, longer)
        store.check()


def _raw_records(path):
    """The store's LMDB environment and its records database (whatever its version suffix)."""
    env = lmdb.open(str(path), subdir=True, max_dbs=16, lock=True)
    with env.begin() as txn:
        names = [bytes(k) for k, _ in txn.cursor()]
    name = next(n for n in names if n.startswith(b"records"))
    return env, env.open_db(name)


def _swap(path, a: bytes, b: bytes):
    env, db = _raw_records(path)
    with env.begin(write=True) as txn:
        va, vb = txn.get(a, db=db), txn.get(b, db=db)
        assert va is not None and vb is not None and len(va) == len(vb), "swap needs two same-size values"
        txn.put(a, vb, db=db)
        txn.put(b, va, db=db)
    env.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_checkpoints_swapped_between_two_prompts_are_misses(tmp_path, family):
    model = tiny(family)
    one, two = ids(37, seed=7), ids(37, seed=8)  # same length: same-size checkpoints
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(one)
        ck_one = set(entries(store, "ckpt"))
        Runtime(model, store=store).prefill(two)
        (ck_two,) = set(entries(store, "ckpt")) - ck_one
        (ck_one,) = ck_one
    _swap(tmp_path, ck_one, ck_two)
    with store_at(tmp_path) as store, tolerated():
        for prompt in (one, two):
            assert_cold(Runtime(model, store=store).prefill(prompt), model, prompt)
        assert store.stats()["corrupt_dropped"] + store.stats()["errors"] >= 1
        store.check()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_page_of_another_model_with_the_same_architecture_is_a_miss(tmp_path, family):
    ours, theirs = tiny(family, seed=0), tiny(family, seed=1)
    prompt = ids(40, seed=9)
    with store_at(tmp_path) as store:
        Runtime(ours, store=store).prefill(prompt)
        mine = {e.key: e.kind for e in store.entries()}
        Runtime(theirs, store=store).prefill(prompt)
        other = {e.key: e.kind for e in store.entries() if e.key not in mine}
    env, db = _raw_records(tmp_path)
    with env.begin(write=True) as txn:  # every record of ours replaced by theirs of the same kind and size
        for key, kind in mine.items():
            value = txn.get(key, db=db)
            donor = next((txn.get(k, db=db) for k, kd in other.items() if kd == kind and len(txn.get(k, db=db)) == len(value)), None)
            if donor is not None:
                txn.put(key, donor, db=db)
    env.close()
    with store_at(tmp_path) as store, tolerated():
        longer = prompt + ids(3, seed=10)
        assert_cold(Runtime(ours, store=store).prefill(longer), ours, longer)
        assert_cold(Runtime(ours, store=store).prefill(prompt), ours, prompt)
        store.check()


BROKEN_NODES = {
    "lengths that do not add up": ({"seqs": mx.array([1, 2, 3], dtype=mx.uint32)}, {"conts": [7], "ckpts": [9]}),
    "fractional lengths": ({"seqs": mx.array([1, 2, 3], dtype=mx.uint32)}, {"conts": [1.5], "ckpts": [1.5]}),
    "lengths that are not a list": ({"seqs": mx.array([1, 2], dtype=mx.uint32)}, {"conts": {"a": 1}, "ckpts": 1}),
    "float token ids": ({"seqs": mx.array([1.0, 2.0], dtype=mx.float32)}, {"conts": [1], "ckpts": [1]}),
    "no fields": ({}, {}),
}


@pytest.mark.parametrize("case", sorted(BROKEN_NODES))
def test_a_node_that_does_not_conform_is_repaired_by_the_next_publish(tmp_path, case):
    model = tiny("qwen3_5")
    a, b = ids(40, seed=11), ids(40, seed=12)
    arrays, meta = BROKEN_NODES[case]
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(a)
        for key in entries(store, "node"):
            store.put(key, Record("node", 0, dict(arrays), dict(meta)))
        with tolerated():  # the broken node may be reported (a misplaced record) or just replaced
            Runtime(model, store=store).prefill(b)  # publishes through the broken root node
        with warnings.catch_warnings():
            warnings.simplefilter("error", StoreWarning)  # repaired: nothing left to report
            before = store.stats()["hit_tokens"]
            got = Runtime(model, store=store).prefill(b + [3])
        assert store.stats()["hit_tokens"] - before == len(b)
        assert_cold(got, model, b + [3])
