"""A hypothesis state machine for MTP rounds over batched rows with the prefix store.

Rows join a `BatchDecoder` drafting with the target's MTP head (`make_decoder(model,
mtp=head)`), each on a runtime carrying the head's drafter segment (`Runtime(model,
store=..., mtp=head)`) that resumed what the store holds of its prompt (prompts share
prefixes, so later rows resume earlier rows' records, the head's pages and boundary
state with them) and prefilled the rest, in blocks drawn per row. Rules:

    join          a prompt from the pool, resumed and prefilled; its segment must be live
    step          one decoder step: MTP rounds (drafts accepted, partly, not at all)
    settle        a step's tokens taken only in part by one row, which then leaves
    failed_draft  the head fails half-way through a round: nothing changes
    leave         a row released (every token it took fed) and published

The reference for every row is mlx-lm's own greedy decoding of its prompt: the tokens
a row emits must equal it exactly (greedy MTP is plain greedy); after every step the
decoder's `check()` runs (the head's rows: pairs + unfed states = each target's tokens),
and a released runtime's `check()` (its head segment's invariants included).

    run_machine(mtp_machine_for(model, head), examples=3)
"""

from __future__ import annotations

import shutil
import tempfile

import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx_lm.generate import generate_step

from ..drafters import make_decoder
from ..mtp.segment import HeadRows
from ..runtime import Runtime
from ..store import open_store

MAX_ROWS = 3


class MTPMachine(RuleBasedStateMachine):
    model = None
    head = None
    vocab = 64
    new_tokens = 10  # tokens each row generates at most
    page_tokens = 8
    stats = None  # class-wide counts of what the programs exercised (a dict; see mtp_machine_for)

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="segcache_mtp_machine_")
        self.store = open_store(self.dir, page_tokens=self.page_tokens)
        self.dec = make_decoder(self.model, num_draft_tokens=2, mtp=self.head, one_row=False, gate=False)
        gen = mx.random.randint(2, self.vocab, (3, 30), key=mx.random.key(11)).tolist()
        self.bases = gen  # prompts are a base's prefix plus a few tokens of their own
        self.rows: dict = {}  # row id -> {"prompt", "got"}
        self.next_id = 0
        self._refs: dict = {}

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _want(self, prompt: tuple) -> list:
        if prompt not in self._refs:
            self._refs[prompt] = [int(t) for t, _ in generate_step(mx.array(prompt), self.model,
                                                                    max_tokens=self.new_tokens)]
        return self._refs[prompt]

    def _count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    @precondition(lambda self: len(self.rows) < MAX_ROWS)
    @rule(data=st.data())
    def join(self, data):
        base = self.bases[data.draw(st.integers(0, len(self.bases) - 1))]
        cut = data.draw(st.integers(3, len(base)))
        own = data.draw(st.lists(st.integers(2, self.vocab - 1), min_size=0, max_size=3))
        prompt = base[:cut] + own
        rt = Runtime(self.model, store=self.store, mtp=self.head)
        steps = rt.prefill_steps(prompt[:-1], step_size=data.draw(st.integers(2, 9)))
        resume = next(steps)
        if resume.restored:
            self._count("resumed")
            if not rt.drafters.get("mtp").stale:
                self._count("head resumed")
        for _ in steps:
            pass
        seg = rt.drafters.get("mtp")
        assert not seg.stale and seg.offset == len(prompt) - 1, "the head's segment follows the prefill"
        rt.check()
        rid = self.next_id
        self.next_id += 1
        self.dec.add(rid, rt, prompt[-1], max_tokens=self.new_tokens)
        self.rows[rid] = {"prompt": tuple(prompt), "got": []}

    def _take(self, out: dict) -> None:
        for rid, emitted in out.items():
            row = self.rows[rid]
            row["got"] += [t for t, _, _ in emitted]
            want = self._want(row["prompt"])
            assert row["got"] == want[: len(row["got"])], f"row {rid}: {row['got']} vs plain {want}"
            if any(d for _, _, d in emitted):
                self._count("accepted a draft")

    @precondition(lambda self: self.rows)
    @rule()
    def step(self):
        self._take(self.dec.step())
        for rid in [r for r, row in self.rows.items() if len(row["got"]) >= self.new_tokens]:
            self._release(rid)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def settle(self, data):
        out = self.dec.step()
        long = [r for r, e in out.items() if len(e) > 1]
        if not long:
            self._take(out)
            return
        rid = data.draw(st.sampled_from(long))
        k = data.draw(st.integers(1, len(out[rid]) - 1))
        self.dec.settle({rid: k})
        out[rid] = out[rid][:k]
        self._take(out)
        self._count("settled")
        self._release(rid)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def failed_draft(self, data):
        """The head fails at a draft depth: the round is dropped, every row as it was."""
        before = {r: len(row["got"]) for r, row in self.rows.items()}
        real = HeadRows.depth

        def failing(rows, *args, **kwargs):
            raise _Failure("the MTP head failed half-way through a round")

        HeadRows.depth = failing
        try:
            out = self.dec.step()
        except _Failure:
            self._count("failed draft")
            assert {r: len(row["got"]) for r, row in self.rows.items()} == before
            return
        finally:
            HeadRows.depth = real
        self._take(out)  # no round reached a second depth: a step like any other
        for rid in [r for r, row in self.rows.items() if len(row["got"]) >= self.new_tokens]:
            self._release(rid)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def leave(self, data):
        self._release(data.draw(st.sampled_from(sorted(self.rows))))

    def _release(self, rid) -> None:
        row = self.rows.pop(rid)
        rt = self.dec.release(rid, pending=True)
        rt.check()
        assert rt.tokens == list(row["prompt"]) + row["got"]
        rt.publish()

    @invariant()
    def consistent(self):
        self.dec.check()
        assert sorted(self.dec.rows) == sorted(self.rows)


class _Failure(Exception):
    """Raised by a head call made to fail (failed_draft)."""


def mtp_machine_for(model, head, *, vocab: int = 64) -> type[MTPMachine]:
    """An MTPMachine subclass bound to `model` and its `head` (use its `.TestCase`); its `stats`
    count what the programs did (resumes, the head resumed, accepted drafts, settles, failures)."""
    return type(f"MTPMachine_{type(model).__module__.rsplit('.', 1)[-1]}", (MTPMachine,),
                {"model": model, "head": head, "vocab": vocab, "stats": {}})
