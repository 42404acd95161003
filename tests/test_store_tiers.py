"""The prefix cache answers, the runtime computes; the three tiers answer one interface (issue 19, item 4).

* `PrefixCache.resume` changes nothing in the runtime it is asked about; the states it
  returns, loaded by the runtime, continue exactly as a cold prefill does.
* The `Resume` a prefill yields first says how many tokens came back and from which tier
  (RAM, disk, the remote, or several), read from the records the resume used, not from
  the store's counters.
* RAM, LMDB and the remote store and serve the same records through get / get_many /
  put / delete / stats, and drop a record that does not fit the layout asked for.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import random
import warnings

import mlx.core as mx
import pytest

from conftest import tiny
from segcache import Runtime, open_store
from segcache.errors import StoreWarning
from segcache.store import Record, Resume
from segcache.store.disk import DiskTier
from segcache.store.ram import RamTier
from segcache.store.remote import RemoteTier
from segcache.testing import models

P = 16


def ids(n, seed=0):
    rnd = random.Random(seed)
    return [rnd.randrange(models.VOCAB) for _ in range(n)]


def store_at(path, **kw):
    kw.setdefault("ram_bytes", 1 << 26)
    kw.setdefault("disk_bytes", 1 << 28)
    return open_store(path, page_tokens=P, **kw)


def first_and_last(steps):
    """(the first thing a prefill_steps generator yields, its return value)."""
    first = next(steps)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return first, done.value


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
def test_resume_is_passive_and_its_states_continue_as_a_cold_prefill(tmp_path, family):
    model, prompt = tiny(family), ids(40, seed=1)
    longer = prompt + ids(9, seed=2)
    want = Runtime(model).prefill(longer)
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(prompt)
        rt = Runtime(model, store=store)
        answer = rt.prefix_cache().resume(rt, longer, 0)
        assert rt.offset == 0 and rt.tokens == []  # asking changed nothing
        assert answer.restored == answer.tokens > 0 and answer.tier == "ram" and answer.states is not None
        rt.restore(longer[: answer.tokens], list(answer.states))
        got = rt.prefill(longer)  # holds the restored prefix: computes the rest only
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
        assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()


def test_the_first_yield_says_how_much_came_back_and_from_which_tier(tmp_path):
    model, prompt = tiny("llama"), ids(40, seed=3)
    with store_at(tmp_path) as store:
        first, _ = first_and_last(Runtime(model, store=store).prefill_steps(prompt))
        assert first == Resume(0, 0, "-")  # an empty store
        first, _ = first_and_last(Runtime(model, store=store).prefill_steps(prompt + [1]))
        assert first == Resume(40, 40, "ram")
        store.evict_ram(0)
        first, _ = first_and_last(Runtime(model, store=store).prefill_steps(prompt + [2]))
        assert first.restored == 40 and first.tier == "disk"
        # the pages back in RAM, the checkpoint with the tail's rows only on disk: both tiers served
        store.evict_ram(0)
        for e in store.entries():
            if e.kind == "page":
                store.get(e.key, count=False)
        first, _ = first_and_last(Runtime(model, store=store).prefill_steps(prompt + [3]))
        assert first.restored == 40 and first.tier == "ram+disk"
        # a runtime holding part of the prompt already: what it held, nothing restored
        rt = Runtime(model)
        rt.forward(prompt[:5])
        first, _ = first_and_last(rt.prefill_steps(prompt))
        assert first == Resume(5, 0, "-")
        st = store.stats()
        assert st["prefills"] == 4 and st["hits"] == 3


def test_a_resume_from_the_remote_says_remote(tmp_path, redis_server):
    model, prompt = tiny("qwen3_5"), ids(40, seed=4)
    opts = dict(remote=redis_server.url, remote_timeout=2.0)
    with store_at(tmp_path / "a", **opts) as a:
        Runtime(model, store=a).prefill(prompt)
        assert a.drain_remote()
    with store_at(tmp_path / "b", **opts) as b:  # another host: an empty disk
        first, got = first_and_last(Runtime(model, store=b).prefill_steps(prompt + [5]))
        assert first.restored == 40 and first.tier == "remote"
        first, _ = first_and_last(Runtime(model, store=b).prefill_steps(prompt + [6]))
        assert first.tier == "ram"  # the remote's records now held locally
    want = Runtime(model).prefill(prompt + [5])
    assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()


# -- one interface, three tiers -----------------------------------------------------


def rec(i: int) -> Record:
    return Record("kv", 4, {"k": mx.arange(8, dtype=mx.float32) + i, "v": mx.ones((2, 3), dtype=mx.bfloat16) * i},
                  {"i": i}, cost=0.5)


FITS = {"k": ("float32", (8,)), "v": ("bfloat16", (2, 3))}
MISFIT = {"k": ("float32", (9,)), "v": ("bfloat16", (2, 3))}


@pytest.fixture(params=["ram", "disk", "remote"])
def tier(request, tmp_path):
    if request.param == "ram":
        yield RamTier(1 << 20, lambda items: None)
    elif request.param == "disk":
        d = DiskTier(str(tmp_path / "d"), disk_bytes=1 << 24, compress=False)
        yield d
        d.close()
    else:
        server = request.getfixturevalue("redis_server")
        r = RemoteTier(server.url, timeout=2.0)
        yield r
        r.close()


def settle(tier):
    if isinstance(tier, RemoteTier):  # writes go through the writer thread
        assert tier.drain(10.0)


def test_every_tier_stores_serves_checks_and_deletes_the_same_way(tier):
    name = tier.name
    for i in range(3):
        tier.put(b"k%d" % i, rec(i))
    settle(tier)
    got = tier.get_many([b"k0", b"missing", b"k2"], [FITS, None, FITS])
    assert got[1] is None
    for i, r in ((0, got[0]), (2, got[2])):
        assert r.meta == {"i": i} and r.tokens == 4 and r.kind == "kv"
        assert mx.array_equal(r.arrays["k"], rec(i).arrays["k"]).item() and r.arrays["v"].dtype == mx.bfloat16
    assert tier.get(b"k1").meta == {"i": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        assert tier.get(b"k1", MISFIT) is None  # never served under a layout it does not fit...
    settle(tier)
    assert tier.get(b"k1") is None  # ...and dropped
    st = tier.stats()
    assert st[f"{name}_corrupt"] == 1 and st[f"{name}_reads"] >= 3, st
    assert all(k.startswith(name + "_") for k in st), st
    deleted = tier.delete(b"k0")
    assert deleted is (name != "remote")  # the remote only queues the delete
    settle(tier)
    assert tier.get(b"k0") is None and tier.get(b"k2") is not None
