"""The Runtime state machine with a prefix store: publish / prefill / evict / reopen steps.

On top of `RuntimeMachine`'s fork/forward/commit/rollback/clone programs, the
runtime carries a store and random steps:

* `publish` the main runtime (open branches are never published),
* `prefill` a fresh runtime with a prompt that shares a prefix with something
  published (or not): its last logits match mlx-lm's cache fed the prompt, and
  a prompt that an earlier prefill published comes back bit-identical,
* `prefill_main`: continue the main runtime's committed tokens through the store,
* `evict` the RAM tier to disk, `reopen` the store (a new handle: disk only),
* `squeeze` the disk tier to a drawn share of its bytes (`gc`): whole units go,
  and `check` proves that nothing left is unresumable (every checkpoint keeps
  the pages it needs, no page outlives what resumes from it),
* `misplace`: reopen after swapping two same-size values on disk (a bad
  restore); every prefill after it must still match mlx-lm: a record under a
  key it was not written for is a counted miss, never served,
* `check` the store after every step.

Budgets are large, so nothing is lost but what `squeeze` evicts: until then
a miss would be a bug (as after `misplace`, which damages the store).

Use `store_machine_for(model)` to get a TestCase-ready machine for a model.
"""

from __future__ import annotations

import shutil
import tempfile

import lmdb
import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from ..runtime import Runtime
from ..store import open_store
from .statemachine import RuntimeMachine, _Reference
from .strategies import token_chunks

PAGE_TOKENS = 8


class StoreMachine(RuntimeMachine):
    """RuntimeMachine whose runtime publishes to and resumes from a prefix store."""

    root = None  # where each program's store directory is made (None: the system's temporary directory)

    def __init__(self):
        self._dir = tempfile.mkdtemp(prefix="segcache-apc-sm-", dir=self.root)
        self.store = self._open()
        super().__init__()
        self.rt.store = self.store
        self.published: list[list[int]] = []  # prompts and committed states published so far
        self.exact: dict[tuple, mx.array] = {}  # prompt -> logits its prefill published
        self.damaged = False  # a misplace happened: misses (recomputed, maybe in other chunks) are expected
        self.squeezed = False  # a squeeze evicted: a published prompt may be recomputed (maybe in other chunks)

    def _open(self):
        return open_store(self._dir, ram_bytes=1 << 24, disk_bytes=1 << 28, page_tokens=PAGE_TOKENS)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _committed(self) -> list[int]:
        return self.expected[: self.bases[0]] if self.bases else list(self.expected)

    @rule()
    def publish(self):
        committed = self._committed()
        self.rt.publish()
        if committed:
            self.published.append(committed)

    @rule(data=st.data())
    def prefill(self, data):
        self._prefill(data, [])

    @precondition(lambda self: self.published)
    @rule(data=st.data())
    def prefill_shared(self, data):
        self._prefill(data, data.draw(st.sampled_from(self.published)))

    def _prefill(self, data, base):
        how = data.draw(st.sampled_from(["same", "extend", "cut"])) if base else "cut"
        if how == "same":  # a published prompt again: a whole hit, bit-identical
            prompt = list(base)
        else:
            cut = len(base) if how == "extend" else data.draw(st.integers(0, len(base)))
            prompt = (base[:cut] + data.draw(token_chunks(self.vocab, max_len=12)))[: self.max_tokens]
        rt = Runtime(self.model, store=self.store, recurrent_strategy=self.strategy, gdn_prefill=self.gdn_prefill)
        logits = rt.prefill(prompt, step_size=data.draw(st.sampled_from([5, 2048])))
        want = _Reference(self.model).logits_after([], prompt)[:, -1]
        self._close(logits, want, f"prefill of {len(prompt)} tokens")
        key = tuple(prompt)
        if key in self.exact and not self.damaged and not self.squeezed:
            assert mx.array_equal(logits, self.exact[key]).item(), "a published prompt came back with other logits"
        else:
            mx.eval(logits)
            self.exact[key] = logits
        assert rt.tokens == prompt and rt.depth == 0
        rt.check()
        self.published.append(prompt)

    @precondition(lambda self: not self.bases and len(self.expected) < self.max_tokens)
    @rule(data=st.data())
    def prefill_main(self, data):
        new = data.draw(token_chunks(self.vocab))
        logits = self.rt.prefill(self.expected + new)
        want = self.ref.logits_after(self.expected, new)[:, -1]
        self._close(logits, want, f"prefill_main of {len(new)} tokens after {len(self.expected)}")
        self.expected += new
        self.published.append(list(self.expected))

    @rule()
    def evict(self):
        self.store.evict_ram(0)
        assert self.store.stats()["ram_bytes"] == 0

    @rule(share=st.sampled_from([0.0, 0.3, 0.6, 0.9]))
    def squeeze(self, share):
        self.store.evict_ram(0)  # everything on disk, so the squeeze decides what is left
        before = self.store.stats()["disk_bytes"]
        if self.store.gc(int(before * share)):
            self.squeezed = True
        st = self.store.stats()
        assert st["disk_bytes"] <= before * share and st["disk_unresumable_bytes"] == 0, st

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()
        self.rt.store = self.store
        for clone, _ in self.clones:
            clone.store = self.store

    @rule(data=st.data())
    def misplace(self, data):
        self.store.close()
        env = lmdb.open(self._dir, subdir=True, max_dbs=16)
        try:
            with env.begin(write=True) as txn:
                name = next(bytes(k) for k, _ in txn.cursor() if bytes(k).startswith(b"records"))
                db = env.open_db(name, txn=txn)
                by_size: dict[int, list[bytes]] = {}
                for k, v in txn.cursor(db=db):
                    by_size.setdefault(len(v), []).append(bytes(k))
                pairs = [ks for ks in by_size.values() if len(ks) > 1]
                if pairs:
                    keys = data.draw(st.sampled_from(pairs))
                    a, b = data.draw(st.permutations(keys))[:2]
                    va, vb = txn.get(a, db=db), txn.get(b, db=db)
                    txn.put(a, vb, db=db)
                    txn.put(b, va, db=db)
                    self.damaged = True
        finally:
            env.close()
        self.reopen()

    @invariant()
    def store_consistent(self):
        self.store.check()
        if not self.damaged:
            assert self.store.stats()["errors"] == 0


def store_machine_for(model, *, strategy: str = "auto", vocab: int = 64) -> type[StoreMachine]:
    """A StoreMachine subclass bound to `model` (use its `.TestCase` in pytest)."""
    return type(
        f"StoreMachine_{type(model).__module__.rsplit('.', 1)[-1]}_{strategy}",
        (StoreMachine,),
        {"model": model, "strategy": strategy, "vocab": vocab},
    )
