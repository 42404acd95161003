import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import shutil
import tempfile

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from segcache.store import Record, open_store

KEYS = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f"])
ONE = 2 * 16 * 8 * 2 * 2  # bytes of a record of 16 tokens (k and v, bf16)


def make(seed: int, n: int) -> Record:
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((2, n, 8)).astype(np.float32)).astype(mx.bfloat16)
    return Record("kv", n, {"k": k, "v": -k}, {"seed": seed}, cost=float(rng.random()))


def same(a: Record, b: Record) -> bool:
    bits = lambda x: np.asarray(x.view(mx.uint16)).tobytes()
    return (a.meta, a.tokens, a.cost) == (b.meta, b.tokens, b.cost) and all(
        bits(x) == bits(y) and x.shape == y.shape for x, y in zip(a.arrays.values(), b.arrays.values())
    )


class StoreMachine(RuleBasedStateMachine):
    """The store against a dict: every get is the model's value, or None only after corruption."""

    @initialize()
    def open(self):
        self.dir = tempfile.mkdtemp(prefix="segcache-sm-")
        self.model: dict[bytes, tuple[int, int]] = {}  # key -> (seed, tokens)
        self.shaky: set[bytes] = set()  # corrupted on disk: a get may return the value or None
        self.store = self._open()

    def _open(self):
        return open_store(self.dir, ram_bytes=3 * ONE, disk_bytes=1 << 26)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(key=KEYS, seed=st.integers(0, 1000), n=st.sampled_from([0, 1, 16, 40]))
    def put(self, key, seed, n):
        self.store.put(key, make(seed, n))
        self.model[key] = (seed, n)
        self.shaky.discard(key)

    @rule(key=KEYS)
    def get(self, key):
        r = self.store.get(key)
        if key not in self.model:
            assert r is None
        elif r is None:
            assert key in self.shaky, f"lost {key!r}"
            del self.model[key]
            self.shaky.discard(key)
        else:
            assert same(r, make(*self.model[key])), f"wrong data for {key!r}"

    @rule(key=KEYS)
    def delete(self, key):
        assert self.store.delete(key) == (key in self.model)
        self.model.pop(key, None)
        self.shaky.discard(key)

    @rule(limit=st.sampled_from([0, ONE, 2 * ONE]))
    def evict_ram(self, limit):
        self.store.evict_ram(limit)
        assert self.store.stats()["ram_bytes"] <= limit

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()

    @rule()
    def flush(self):
        self.store.flush()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def corrupt(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.flush()
        disk = self.store._disk
        with disk.env.begin(write=True) as txn:
            v = txn.get(key, db=disk.records)
            if v is None:
                return
            pos = data.draw(st.integers(0, len(v) - 1))
            b = bytearray(v)
            b[pos] ^= 0x40
            txn.put(key, bytes(b), db=disk.records)
        self.shaky.add(key)

    @invariant()
    def consistent(self):
        if hasattr(self, "store"):
            self.store.check()  # flips keep a value's length, so the index still agrees


StoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStoreMachine = StoreMachine.TestCase
