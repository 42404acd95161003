"""A hypothesis state machine for Runtime: random fork/forward/commit/rollback/clone.

The reference is plain mlx-lm: a `make_prompt_cache` cache fed exactly the
tokens the runtime should hold (rebuilt from scratch when a commit or rollback
shortens them). Every forward's logits are compared with it (allclose, and
the same greedy token where the top two are not a near tie), and `rt.check()`
runs after every step.

Use `machine_for(model)` to get a TestCase-ready machine for a model.
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx_lm.models.cache import make_prompt_cache

from ..errors import BranchError
from ..runtime import Runtime
from .strategies import commit_points, token_chunks

ATOL = 1e-4
RTOL = 1e-4


def assert_logits_close(got: mx.array, want: mx.array, what: str) -> None:
    """allclose, and the same argmax wherever the reference's top two are apart."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    if not mx.allclose(got, want, atol=ATOL, rtol=RTOL).item():
        diff = mx.abs(got - want).max().item()
        raise AssertionError(f"{what}: logits differ from the reference by up to {diff:.3g}")
    top2 = mx.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 1e-3
    same = mx.argmax(got, axis=-1) == mx.argmax(want, axis=-1)
    assert mx.all(same | ~clear).item(), f"{what}: greedy token differs from the reference"


class _Reference:
    """mlx-lm's own cache fed a token sequence; rebuilt when the sequence shrinks."""

    def __init__(self, model):
        self.model = model
        self.tokens: list[int] = []
        self.cache = make_prompt_cache(model)

    def logits_after(self, prefix: list[int], new: list[int]) -> mx.array:
        """Logits for `new` following `prefix` (the reference then holds prefix + new)."""
        if self.tokens != prefix:
            self.cache = make_prompt_cache(self.model)
            self.tokens = []
            if prefix:
                mx.eval(self.model(mx.array(prefix)[None], cache=self.cache))
            self.tokens = list(prefix)
        logits = self.model(mx.array(new)[None], cache=self.cache)
        self.tokens += new
        return logits


class RuntimeMachine(RuleBasedStateMachine):
    """Random programs on one Runtime (and its clones) against mlx-lm's cache."""

    model = None
    vocab = 64
    strategy = "auto"
    gdn_prefill = "auto"
    max_tokens = 48  # keeps programs cheap on two cores

    def __init__(self):
        super().__init__()
        self.rt = Runtime(self.model, recurrent_strategy=self.strategy, gdn_prefill=self.gdn_prefill)
        self.ref = _Reference(self.model)
        self.expected: list[int] = []  # what rt must hold
        self.bases: list[int] = []  # where each open branch began
        self.branches = []  # Branch objects, parallel to bases
        self.clones: list[tuple[Runtime, list[int]]] = []

    @precondition(lambda self: len(self.expected) < self.max_tokens)
    @rule(data=st.data())
    def forward(self, data):
        ids = data.draw(token_chunks(self.vocab))
        logits = self.rt.forward(ids)
        want = self.ref.logits_after(self.expected, ids)
        assert_logits_close(logits, want, f"forward {ids} after {len(self.expected)} tokens")
        self.expected += ids

    @rule()
    def fork(self):
        self.branches.append(self.rt.fork())
        self.bases.append(len(self.expected))

    @precondition(lambda self: self.bases)
    @rule(data=st.data(), through_branch=st.booleans())
    def commit(self, data, through_branch):
        length = len(self.expected) - self.bases[-1]
        n = data.draw(commit_points(length))
        branch = self.branches.pop()
        if through_branch:
            branch.commit(n)
        else:
            self.rt.commit(n)
        del self.expected[self.bases.pop() + n :]
        assert not branch.open

    @precondition(lambda self: self.bases)
    @rule()
    def rollback(self):
        self.branches.pop().rollback()
        del self.expected[self.bases.pop() :]

    @rule(data=st.data())
    def misuse(self, data):
        """Every misuse raises BranchError and changes nothing."""
        before = (self.rt.offset, self.rt.tokens, self.rt.depth)
        length = len(self.expected) - self.bases[-1] if self.bases else 0
        choice = data.draw(st.sampled_from(["low", "high", "float", "stale"]))
        try:
            if not self.bases:
                (self.rt.commit if choice in ("low", "float") else self.rt.rollback)()
            elif choice == "low":
                self.rt.commit(-1)
            elif choice == "high":
                self.rt.commit(length + 1)
            elif choice == "float":
                self.rt.commit(0.5)
            elif len(self.branches) > 1:
                self.branches[0].commit()
            else:
                self.rt.commit(length + 5)
        except BranchError:
            pass
        else:
            raise AssertionError(f"misuse {choice!r} did not raise BranchError")
        assert (self.rt.offset, self.rt.tokens, self.rt.depth) == before

    @precondition(lambda self: len(self.clones) < 2)
    @rule()
    def clone(self):
        committed = self.expected[: self.bases[0]] if self.bases else list(self.expected)
        self.clones.append((self.rt.clone(), committed))

    @precondition(lambda self: self.clones)
    @rule(data=st.data())
    def forward_clone(self, data):
        """A clone holds the committed tokens it was made from, whatever the others did since."""
        index = data.draw(st.integers(0, len(self.clones) - 1))
        clone, held = self.clones[index]
        if len(held) >= self.max_tokens:
            return
        ids = data.draw(token_chunks(self.vocab))
        logits = clone.forward(ids)
        fresh = _Reference(self.model)
        assert_logits_close(logits, fresh.logits_after(held, ids), "clone forward")
        self.clones[index] = (clone, held + ids)
        clone.check()

    @invariant()
    def consistent(self):
        self.rt.check()
        assert self.rt.offset == len(self.expected)
        assert self.rt.tokens == self.expected
        assert self.rt.depth == len(self.bases)
        assert [b.base_offset for b in self.branches] == self.bases


def machine_for(
    model, *, strategy: str = "auto", vocab: int = 64, gdn_prefill: str = "auto"
) -> type[RuntimeMachine]:
    """A RuntimeMachine subclass bound to `model` (use its `.TestCase` in pytest)."""
    return type(
        f"RuntimeMachine_{type(model).__module__.rsplit('.', 1)[-1]}_{strategy}_{gdn_prefill}",
        (RuntimeMachine,),
        {"model": model, "strategy": strategy, "vocab": vocab, "gdn_prefill": gdn_prefill},
    )


def run_machine(machine: type[RuleBasedStateMachine], *, examples: int, steps: int = 20) -> None:
    """Run `machine` for `examples` programs of up to `steps` steps, deterministically."""
    machine.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase("runTest").runTest()
