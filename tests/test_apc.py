import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import random
import warnings

import lmdb
import mlx.core as mx
import pytest

from conftest import tiny
from helpers import assert_snapshot_equal, snapshot
from segcache import BranchError, Runtime, StoreError, open_store
from segcache.errors import StoreWarning
from segcache.testing import models

P = 16  # page tokens: small, so 40-token prompts span pages and tails
EXACT = ["llama", "qwen3_5", "gemma3_text"]  # dense, hybrid, sliding window


@pytest.fixture(autouse=True)
def _no_silent_degrade():
    """A store failure must be loud in these tests unless a test expects it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        yield


def ids(n, seed=0):
    rnd = random.Random(seed)
    return [rnd.randrange(models.VOCAB) for _ in range(n)]


def store_at(path, **kw):
    kw.setdefault("ram_bytes", 1 << 26)
    kw.setdefault("disk_bytes", 1 << 28)
    return open_store(path, page_tokens=P, **kw)


def hits(store):
    return store.stats()["hit_tokens"]


def cold(model, prompt):
    return Runtime(model).prefill(prompt)


def assert_close(a, b):
    assert a.shape == b.shape
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), mx.abs(a - b).max().item()
    assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()


# -- 1. exact resume ---------------------------------------------------------------


@pytest.mark.parametrize("family", EXACT)
@pytest.mark.parametrize("length", [40, 10, 32])  # pages + tail, shorter than a page, on the grid
def test_warm_prefill_is_bit_identical_from_ram_and_disk(tmp_path, family, length):
    model, prompt = tiny(family), ids(length, seed=length)
    with store_at(tmp_path) as store:
        rt = Runtime(model, store=store)
        logits = rt.prefill(prompt)
        mx.eval(logits)
        published = snapshot(rt)
        warm = Runtime(model, store=store)
        again = warm.prefill(prompt)
        assert hits(store) == length
        assert mx.array_equal(again, logits).item()
        assert_snapshot_equal(published, warm)
        warm.check()
        store.evict_ram(0)  # suspended: the next hit decodes from LMDB
        assert store.stats()["ram_bytes"] == 0
        from_disk = Runtime(model, store=store)
        assert mx.array_equal(from_disk.prefill(prompt), logits).item()
        assert_snapshot_equal(published, from_disk)
    with store_at(tmp_path) as store:  # another handle: disk only
        rt = Runtime(model, store=store)
        assert mx.array_equal(rt.prefill(prompt), logits).item()
        assert_snapshot_equal(published, rt)
        rt.check()
        # the rest of a longer prompt computed after the hit matches a cold prefill
        more = prompt + ids(21, seed=99)
        resumed = Runtime(model, store=store)
        got = resumed.prefill(more)
        assert hits(store) == 2 * length
        assert_close(got, cold(model, more))
        resumed.check()
        step = [int(mx.argmax(got).item())]
        ref = Runtime(model)
        ref.prefill(more)
        assert_close(resumed.forward(step)[:, -1], ref.forward(step)[:, -1])


def test_qwen3_next_resumes_exactly(tmp_path):
    model, prompt = tiny("qwen3_next"), ids(37, seed=3)
    with store_at(tmp_path) as store:
        rt = Runtime(model, store=store)
        logits = rt.prefill(prompt)
        published = snapshot(rt)
        store.evict_ram(0)
        warm = Runtime(model, store=store)
        assert mx.array_equal(warm.prefill(prompt), logits).item()
        assert_snapshot_equal(published, warm)


def test_prefill_without_a_store_is_a_chunked_forward():
    model, prompt = tiny("qwen3_5"), ids(50)
    rt = Runtime(model)
    got = rt.prefill(prompt, step_size=7)
    assert rt.tokens == prompt and got.shape == (1, models.VOCAB)
    assert_close(got, Runtime(model).forward(prompt)[:, -1])


# -- 2. shared prefixes -------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
@pytest.mark.parametrize("length", [40, 10])
def test_a_prompt_extending_a_published_one_hits_all_of_it(tmp_path, family, length):
    model, a = tiny(family), ids(length, seed=1)
    b = a + ids(9, seed=2)
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(a)
        got = Runtime(model, store=store).prefill(b)
        assert hits(store) == length
        assert_close(got, cold(model, b))


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text", "qwen3_next"])
@pytest.mark.parametrize("length,split", [(40, 35), (40, 16), (12, 7)])
def test_diverging_prompts_share_the_common_part(tmp_path, family, length, split):
    """Dense models resume at the divergence at once; stateful ones from the branch point
    the second prompt checkpointed, for every later prompt through it."""
    model, a = tiny(family), ids(length, seed=4)
    b = a[:split] + [(t + 1) % models.VOCAB for t in a[split : split + 6]]
    c = a[:split] + [(t + 2) % models.VOCAB for t in a[split : split + 3]]
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(a)
        before = hits(store)
        assert_close(Runtime(model, store=store).prefill(b), cold(model, b))
        stateful = family != "llama"
        # stateful: a has no checkpoint before the split (pages alone do not restore a state)
        assert hits(store) - before == (0 if stateful else split)
        before = hits(store)
        assert_close(Runtime(model, store=store).prefill(c), cold(model, c))
        assert hits(store) - before == split


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_prefix_of_a_published_prompt(tmp_path, family):
    model, a = tiny(family), ids(40, seed=5)
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(a)
        got = Runtime(model, store=store).prefill(a[:30])
        # dense: K/V of 29 tokens from the pages and a's tail, the last one computed
        assert hits(store) == (29 if family == "llama" else 0)
        assert_close(got, cold(model, a[:30]))
        assert Runtime(model, store=store).prefill(a[:30] + [1]) is not None
        assert hits(store) == (29 + 30 if family == "llama" else 30)


def test_a_chat_resumes_every_turn(tmp_path):
    model = tiny("qwen3_5")
    with store_at(tmp_path) as store:
        history = ids(20, seed=6)
        rt = Runtime(model, store=store)
        rt.prefill(history)
        for turn in range(3):
            reply = [int(mx.argmax(rt.forward([t])[:, -1]).item()) for t in ids(4, seed=10 + turn)]
            history = rt.tokens
            assert rt.publish() > 0
            history = history + reply[:1] + ids(5, seed=20 + turn)
            before = hits(store)
            nxt = Runtime(model, store=store)  # a new request for the next turn
            assert_close(nxt.prefill(history), cold(model, history))
            assert hits(store) - before == len(rt.tokens)
            rt = nxt


# -- prefill / publish contract ---------------------------------------------------------


def test_prefill_refuses_an_open_branch_and_a_foreign_prefix(tmp_path):
    model = tiny("qwen3_5")
    with store_at(tmp_path) as store:
        rt = Runtime(model, store=store)
        rt.forward(ids(5))
        with rt.fork():
            with pytest.raises(BranchError, match="open branch"):
                rt.prefill(ids(5) + [1, 2])
        with pytest.raises(BranchError, match="strict prefix"):
            rt.prefill(ids(8, seed=9))
        with pytest.raises(BranchError, match="strict prefix"):
            rt.prefill(ids(5))  # nothing new
        assert rt.tokens == ids(5) and rt.depth == 0
        # a held strict prefix continues
        assert_close(rt.prefill(ids(5) + [1, 2]), cold(model, ids(5) + [1, 2]))


def test_publish_never_publishes_speculative_tokens(tmp_path):
    model, prompt = tiny("qwen3_5"), ids(20, seed=7)
    with store_at(tmp_path) as store:
        rt = Runtime(model, store=store)
        rt.forward(prompt)
        with rt.fork():
            rt.forward([1, 2, 3])
            assert rt.publish() > 0
        longer = prompt + [1, 2, 3, 4]
        warm = Runtime(model, store=store)
        assert_close(warm.prefill(longer), cold(model, longer))
        assert hits(store) == len(prompt)  # not 23
        probe = Runtime(model, store=store)
        probe.prefill(prompt + [5])
        assert hits(store) == 2 * len(prompt)


def test_publish_needs_a_store_and_known_tokens(tmp_path):
    model = tiny("llama")
    with pytest.raises(StoreError, match="without a store"):
        Runtime(model).publish()
    with store_at(tmp_path) as store:
        rt = Runtime(model, store=store)
        model(mx.array([ids(3)]), cache=rt.cache)  # fed around the runtime: ids unknown
        with pytest.raises(StoreError, match="unknown"):
            rt.publish()


def test_clones_share_the_store(tmp_path):
    model, prompt = tiny("gemma3_text"), ids(30, seed=8)
    with store_at(tmp_path) as store:
        rt = Runtime(model, store=store)
        rt.forward(prompt[:10])
        twin = rt.clone()
        assert twin.store is store
        twin.prefill(prompt)
        assert_close(Runtime(model, store=store).prefill(prompt + [3]), cold(model, prompt + [3]))
        assert hits(store) == 30


# -- 7. identities ------------------------------------------------------------------------


def test_other_weights_dtype_salt_or_page_size_never_hit(tmp_path):
    prompt = ids(40, seed=11)
    base = tiny("qwen3_5")
    with store_at(tmp_path) as store:
        Runtime(base, store=store).prefill(prompt)
        Runtime(tiny("llama"), store=store).prefill(prompt)
        for other in (tiny("qwen3_5", seed=1), models.build("qwen3_5", dtype=mx.bfloat16), models.build("llama", seed=2)):
            got = Runtime(other, store=store).prefill(prompt)
            assert hits(store) == 0
            assert_close(got.astype(mx.float32), cold(other, prompt).astype(mx.float32))
    for kw in (dict(salt="tenant-b"), dict(page_tokens=8)):
        with pytest.warns(StoreWarning, match="will not hit"):  # the store keeps its page_tokens and salt hash
            store = open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 28, **{"page_tokens": P, **kw})
        with store:
            Runtime(base, store=store).prefill(prompt)
            assert hits(store) == 0
    with store_at(tmp_path) as store:  # the original identity still hits
        Runtime(base, store=store).prefill(prompt)
        assert hits(store) == 40


# -- 8. budgets and failures ------------------------------------------------------------------


def greedy(rt, prompt, n=6):
    logits = rt.prefill(prompt)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0]).item()))
        logits = rt.forward(out[-1:])[:, -1]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_budgets_hold_and_a_full_store_only_costs_hits(tmp_path, family):
    model = tiny(family)
    prompts = [ids(8, seed=0) + ids(30, seed=s) for s in range(14)]
    want = [greedy(Runtime(model), p) for p in prompts]
    for ram, disk in ((64 << 10, 256 << 10), (0, 8 << 10)):
        path = tmp_path / f"{ram}-{disk}"
        with store_at(path, ram_bytes=ram, disk_bytes=disk) as store:
            for round_ in range(2):
                for p, w in zip(prompts, want):
                    assert greedy(Runtime(model, store=store), p) == w
                    st = store.stats()
                    assert st["ram_bytes"] <= ram and st["disk_bytes"] <= disk
                    store.check()
            st = store.stats()
            assert st["evictions"] + st["dropped"] > 0 and st["errors"] == 0
            assert st["hits"] > 0 or disk < (16 << 10)


def test_store_failures_degrade_to_a_cold_prefill(tmp_path, monkeypatch):
    model, prompt = tiny("qwen3_5"), ids(40, seed=12)
    want = greedy(Runtime(model), prompt)
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(prompt)
        store.evict_ram(0)

        def broken(*a, **k):
            raise lmdb.Error("simulated I/O error")

        monkeypatch.setattr(store._disk, "get", broken)
        monkeypatch.setattr(store._disk, "put_many", broken)
        with pytest.warns(StoreWarning, match="(lookup|publish) failed"):
            assert greedy(Runtime(model, store=store), prompt) == want
        monkeypatch.undo()
        assert store.stats()["errors"] == 2  # the lookup, and the publish reading nodes

        # a record that does not fit the runtime (a bug or a foreign writer) is a miss too
        key = next(e.key for e in store.entries() if e.kind == "ckpt")
        rec = store.get(key)
        rec.arrays.pop(next(iter(rec.arrays)))
        store.put(key, rec)
        assert greedy(Runtime(model, store=store), prompt) == want
    # a closed store is ignored
    assert greedy(Runtime(model, store=store), prompt) == want


def test_corrupt_records_on_disk_are_misses(tmp_path):
    model, prompt = tiny("llama"), ids(40, seed=13)
    with store_at(tmp_path) as store:
        want = Runtime(model, store=store).prefill(prompt)
    env = lmdb.open(str(tmp_path), max_dbs=8)
    db = env.open_db(b"records.v1")
    with env.begin(write=True) as txn:
        for k, v in list(txn.cursor(db=db)):
            if k.startswith(b"ck"):
                bad = bytearray(v)
                bad[-3] ^= 0xFF
                txn.put(k, bytes(bad), db=db)
    env.close()
    with store_at(tmp_path) as store:
        with pytest.warns(StoreWarning, match="dropped: corrupt record"):  # a dropped record warns (docs/apc.md)
            got = Runtime(model, store=store).prefill(prompt)
        assert_close(got, want)
        st = store.stats()
        assert st["corrupt_dropped"] == 1 and st["hit_tokens"] == 32  # the two pages still serve


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_prefill_checkpoints_let_a_prompt_sharing_only_that_much_resume(tmp_path, family):
    """A checkpoint asked for inside the prompt (a chat message boundary) is resumable alone."""
    model = tiny(family)
    system, first, second = ids(21, seed=1), ids(9, seed=2), ids(7, seed=3)
    with store_at(tmp_path) as store:
        Runtime(model, store=store).prefill(system + first, checkpoints=[len(system), 0, 99])
        rt = Runtime(model, store=store)
        before = hits(store)
        got = rt.prefill(system + second)
        assert hits(store) - before == len(system)
    assert_close(got, cold(model, system + second))
