"""The store's own state machine: operations and damage against a dict model, check() after every step.

Damage is drawn like operations: a value moved under another key (a bad restore or a
misplaced write), a value cut short, a flipped byte, and reopening with other budgets
(a smaller disk_bytes). The property: a get returns exactly the model's record or None;
None only where damage, a failed layout check or a budget allowed a loss, and never
another key's record.

`make test-long` (SEGCACHE_LONG=1) runs 5,000 programs; the default run 50 (the same 50 every run).
"""

import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import os
import shutil
import tempfile
import warnings

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from segcache.errors import StoreWarning
from segcache.store import Record, open_store
from segcache.store.disk import Entry

KEYS = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f"])
SIZES = st.sampled_from([0, 1, 16, 40])
ONE = 2 * 16 * 8 * 2 * 2  # array bytes of a 16-token record (k and v, bf16)
BIG_DISK = 1 << 26
LONG = os.environ.get("SEGCACHE_LONG") == "1"


def make(seed: int, n: int) -> Record:
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((2, n, 8)).astype(np.float32)).astype(mx.bfloat16)
    return Record("kv", n, {"k": k, "v": -k}, {"seed": seed}, cost=float(rng.random()))


def layout(n: int, dtype: str = "bfloat16") -> dict:
    return {"k": (dtype, (2, n, 8)), "v": (dtype, (2, n, 8))}


def same(a: Record, b: Record) -> bool:
    bits = lambda x: np.asarray(x.view(mx.uint16)).tobytes()
    return (a.meta, a.tokens, a.cost) == (b.meta, b.tokens, b.cost) and all(
        bits(x) == bits(y) and x.shape == y.shape for x, y in zip(a.arrays.values(), b.arrays.values())
    )


class StoreMachine(RuleBasedStateMachine):
    """The store against a dict: every get is the model's value, or None only where a loss was allowed."""

    @initialize()
    def open(self):
        self.dir = tempfile.mkdtemp(prefix="segcache-sm-")
        self.model: dict[bytes, tuple[int, int]] = {}  # key -> (seed, tokens)
        self.shaky: set[bytes] = set()  # disk value damaged or budget-evictable: a get may miss
        self.disk_bytes = BIG_DISK
        self.store = self._open()

    def _open(self):
        return open_store(self.dir, ram_bytes=3 * ONE, disk_bytes=self.disk_bytes)

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _check_read(self, key, r):
        if key not in self.model:
            assert r is None, f"{key!r} was never stored (or was deleted) but a record came back"
        elif r is None:
            assert key in self.shaky, f"lost {key!r}"
            del self.model[key]
            self.shaky.discard(key)
        else:
            assert same(r, make(*self.model[key])), f"wrong data for {key!r}"

    def _lossy(self) -> None:
        if self.disk_bytes < BIG_DISK:  # a small budget may evict anything not in RAM
            self.shaky |= set(self.model)

    # -- operations

    @rule(key=KEYS, seed=st.integers(0, 1000), n=SIZES)
    def put(self, key, seed, n):
        self.store.put(key, make(seed, n))
        self.model[key] = (seed, n)
        self.shaky.discard(key)
        self._lossy()

    @rule(key=KEYS, seed=st.integers(0, 1000), n=SIZES)
    def update(self, key, seed, n):
        seen = []

        def fn(cur):
            seen.append(cur)
            return make(seed, n)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreWarning)  # a damaged current value is reported, then replaced
            got = self.store.update(key, fn)
        cur = seen[-1]
        if cur is not None:  # update reads disk, which may lag our RAM only by what was never written
            assert key in self.model and (same(cur, make(*self.model[key])) or key in self.shaky)
        assert same(got, make(seed, n))
        self.model[key] = (seed, n)
        self.shaky.discard(key)
        self._lossy()

    @rule(key=KEYS)
    def get(self, key):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreWarning)
            self._check_read(key, self.store.get(key))

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4), wrong=st.sampled_from([None, "dtype", "shape"]))
    def get_many(self, keys, wrong):
        expects = []
        for k in keys:
            n = self.model.get(k, (0, 1))[1]
            expects.append(layout(n, "float16") if wrong == "dtype" else layout(n + 1) if wrong == "shape" else layout(n))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreWarning)
            got = self.store.get_many(keys, expects=expects)
        for k, r in zip(keys, got):
            if wrong is not None and k in self.model:
                assert r is None, f"{k!r} served against a layout it does not fit"
                self.model.pop(k)  # dropped as corrupt (from RAM and disk)
                self.shaky.discard(k)
            else:
                self._check_read(k, r)

    @rule(key=KEYS)
    def delete(self, key):
        present = self.store.delete(key)
        if key in self.model and key not in self.shaky:
            assert present
        self.model.pop(key, None)
        self.shaky.discard(key)
        assert self.store.get(key) is None

    @rule(limit=st.sampled_from([0, ONE, 2 * ONE]))
    def evict_ram(self, limit):
        self.store.evict_ram(limit)
        assert self.store.stats()["ram_bytes"] <= limit
        self._lossy()

    @rule(disk=st.sampled_from([BIG_DISK, 8 * ONE, 3 * ONE]))
    def reopen(self, disk):
        self.store.close()
        self.disk_bytes = disk
        self.store = self._open()  # a smaller budget evicts at open
        self._lossy()

    @rule()
    def flush(self):
        self.store.flush()
        self._lossy()

    @rule(limit=st.sampled_from([0, ONE, 4 * ONE]))
    def gc(self, limit):
        self.store.gc(limit)
        assert self.store.stats()["disk_bytes"] <= limit
        self.shaky |= set(self.model)

    # -- damage (the disk value of a stored key changes under the store)

    def _raw(self, key):
        d = self.store._disk
        with d.env.begin() as txn:
            v = txn.get(key, db=d.records)
            return None if v is None else bytes(v)

    def _write_raw(self, key, value):
        """Replace key's value on disk, index kept consistent, as a restore or a misplaced write would."""
        e = Entry(key, 1, len(value), "kv", 1.0, 0.5, 1.0, None)
        self.store._disk.put_many([(key, value, e)])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), dst=KEYS)
    def move(self, data, dst):
        src = data.draw(st.sampled_from(sorted(self.model)))
        self.store.flush()
        v = self._raw(src)
        if v is None or src == dst:
            return
        self._write_raw(dst, v)
        if dst not in self.model:  # never stored under dst: must stay a miss
            self.model.pop(dst, None)
        self.shaky.add(dst)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.flush()
        v = self._raw(key)
        if not v:
            return
        self._write_raw(key, v[: data.draw(st.integers(0, len(v) - 1))])
        self.shaky.add(key)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def flip(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.flush()
        v = self._raw(key)
        if not v:
            return
        b = bytearray(v)
        b[data.draw(st.integers(0, len(v) - 1))] ^= data.draw(st.sampled_from([0x01, 0x40, 0x80]))
        self._write_raw(key, bytes(b))
        self.shaky.add(key)

    @invariant()
    def consistent(self):
        if hasattr(self, "store"):
            self.store.check()


StoreMachine.TestCase.settings = settings(
    max_examples=5000 if LONG else 50,
    stateful_step_count=30,
    deadline=None,
    derandomize=not LONG,
    suppress_health_check=list(HealthCheck),
)
TestStoreMachine = StoreMachine.TestCase
