"""A hypothesis state machine for Runtime: random fork/forward/commit/rollback/clone.

Tokens reach the runtime as lists, as lazy mx.arrays (recorded unread), and
by direct model calls on `rt.cache` (as mlx-lm's generate_step does: their
ids are unknown, so `rt.tokens` must read None there); some forwards raise
half-way (a decoder layer fails after the earlier ones ran) and must leave
the runtime exactly as it was.

The reference is plain mlx-lm: a `make_prompt_cache` cache fed exactly the
tokens the runtime should hold (rebuilt from scratch when a commit or rollback
shortens them). Every forward's logits are compared with it (allclose, and
the same greedy token where the top two are not a near tie); after every step
`rt.check()` runs and `rt.tokens` must equal the reference ids, None where
fed directly.

Use `machine_for(model)` to get a TestCase-ready machine for a model.
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx_lm.models.cache import make_prompt_cache

from ..errors import BranchError
from ..layers.tree import Tree
from ..runtime import Runtime
from .strategies import commit_points, draft_trees, token_chunks, token_ids

ATOL = 1e-4
RTOL = 1e-4


def assert_logits_close(got: mx.array, want: mx.array, what: str, *, atol: float = ATOL, rtol: float = RTOL,
                        margin: float = 1e-3) -> None:
    """allclose, and the same argmax wherever the reference's top two are more than `margin` apart."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    if not mx.allclose(got, want, atol=atol, rtol=rtol).item():
        diff = mx.abs(got - want).max().item()
        raise AssertionError(f"{what}: logits differ from the reference by up to {diff:.3g}")
    top2 = mx.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > margin
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
    gdn_prefill = "native"
    max_tokens = 48  # keeps programs cheap on two cores
    # logit tolerances against the reference (16-bit models round more: segcache.check)
    atol, rtol, margin = ATOL, RTOL, 1e-3

    def __init__(self):
        super().__init__()
        self.rt = Runtime(self.model, recurrent_strategy=self.strategy, gdn_prefill=self.gdn_prefill)
        self.ref = _Reference(self.model)
        self.expected: list[int | None] = []  # what rt.tokens must be: None where fed directly
        self.direct: dict[int, int] = {}  # position -> id it was fed directly (the last time)
        self.bases: list[int] = []  # where each open branch began
        self.branches = []  # Branch objects, parallel to bases
        self.clones: list[tuple[Runtime, list[int]]] = []  # (clone, ids it was fed)
        self.clone_tokens: list[list[int | None]] = []  # what each clone's tokens must be

    def _close(self, got: mx.array, want: mx.array, what: str) -> None:
        assert_logits_close(got, want, what, atol=self.atol, rtol=self.rtol, margin=self.margin)

    def _fed(self, expected: list[int | None]) -> list[int]:
        """The ids actually fed at each position of `expected`."""
        return [self.direct[i] if t is None else t for i, t in enumerate(expected)]

    @precondition(lambda self: len(self.expected) < self.max_tokens)
    @rule(data=st.data(), how=st.sampled_from(["list", "array", "array2d"]))
    def forward(self, data, how):
        ids = data.draw(token_chunks(self.vocab))
        if how == "list":
            feed = ids
        else:  # lazy (an unevaluated op), as a decode loop's next token is
            feed = mx.array(ids, dtype=mx.int32) + 0
            feed = feed[None] if how == "array2d" else feed
        logits = self.rt.forward(feed)
        want = self.ref.logits_after(self._fed(self.expected), ids)
        self._close(logits, want, f"forward {ids} ({how}) after {len(self.expected)} tokens")
        self.expected += ids

    # A runtime with a store refuses to publish positions fed directly
    # (StoreError), which tests/test_tokens.py checks; a store machine opts in.
    @precondition(lambda self: len(self.expected) < self.max_tokens and self.rt.store is None)
    @rule(data=st.data())
    def direct_call(self, data):
        """The model called on rt.cache, around the runtime: ids unknown (None)."""
        ids = data.draw(token_chunks(self.vocab))
        logits = self.model(mx.array([ids]), cache=self.rt.cache)
        want = self.ref.logits_after(self._fed(self.expected), ids)
        self._close(logits, want, f"direct call {ids} after {len(self.expected)} tokens")
        for i, t in enumerate(ids, start=len(self.expected)):
            self.direct[i] = t
        self.expected += [None] * len(ids)

    @precondition(lambda self: len(self.expected) < self.max_tokens)
    @rule(data=st.data(), as_array=st.booleans())
    def forward_raises(self, data, as_array):
        """A forward whose model call fails after some layers ran changes nothing."""
        ids = data.draw(token_chunks(self.vocab))
        layers = self.model.layers
        layer = layers[data.draw(st.integers(0, len(layers) - 1))]
        base = type(layer)
        before = (self.rt.offset, self.rt.tokens, self.rt.depth)
        layer.__class__ = type(f"Failing{base.__name__}", (base,), {"__call__": _fail})
        try:
            self.rt.forward(mx.array(ids) + 0 if as_array else ids)
        except _Failure:
            pass
        else:
            raise AssertionError("a failing model call did not raise")
        finally:
            layer.__class__ = base
        assert (self.rt.offset, self.rt.tokens, self.rt.depth) == before

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

    @precondition(lambda self: len(self.expected) + 5 <= self.max_tokens)
    @rule(data=st.data())
    def speculative_round(self, data):
        """One round of speculative decoding: fork, verify 2..4 drafts, keep some, feed the next token.

        A commit that keeps a wrong state shows at once in the next token's logits, so
        this common pattern is drawn whole rather than left to chance among the rules.
        """
        self.fork()
        drafts = data.draw(st.lists(token_ids(self.vocab), min_size=2, max_size=4))
        self._close(self.rt.forward(drafts), self.ref.logits_after(self._fed(self.expected), drafts),
                    f"verify {drafts} after {len(self.expected)} tokens")
        self.expected += drafts
        n = data.draw(st.integers(0, len(drafts) - 1))
        self.branches.pop().commit(n)
        del self.expected[self.bases.pop() + n :]
        nxt = data.draw(token_ids(self.vocab))
        self._close(self.rt.forward([nxt]), self.ref.logits_after(self._fed(self.expected), [nxt]),
                    f"the token after commit({n}) of {drafts}")
        self.expected.append(nxt)

    @precondition(lambda self: len(self.expected) + 9 <= self.max_tokens and self.rt.takes_trees)
    @rule(data=st.data())
    def tree_round(self, data):
        """A tree round (docs/tree.md): fork, verify a tree of drafts in one forward, every node
        against a chain forward of its path; commit one path (or none), feed the next token."""
        tokens, parents = data.draw(draft_trees(self.vocab, max_nodes=8))
        tree, prefix = Tree(parents), self._fed(self.expected)
        self.fork()
        logits = self.rt.forward_tree(tokens, parents)
        for leaf in sorted(set(range(tree.size)) - set(parents)):
            nodes = tree.path(leaf)
            want = self.ref.logits_after(prefix, [tokens[i] for i in nodes])
            self._close(logits[:, nodes], want, f"tree {tokens} / {parents}: the path to node {leaf}")
        end = data.draw(st.integers(-1, tree.size - 1))
        path = tree.path(end) if end >= 0 else []
        self.branches.pop().commit(path)
        del self.expected[self.bases.pop() :]
        self.expected += [tokens[i] for i in path]
        nxt = data.draw(token_ids(self.vocab))
        self._close(self.rt.forward([nxt]), self.ref.logits_after(self._fed(self.expected), [nxt]),
                    f"the token after committing path {path} of {tokens} / {parents}")
        self.expected.append(nxt)

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
        clone = self.rt.clone()
        assert clone.tokens == committed
        self.clones.append((clone, self._fed(committed)))
        self.clone_tokens.append(committed)

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
        self._close(logits, fresh.logits_after(held, ids), "clone forward")
        self.clones[index] = (clone, held + ids)
        self.clone_tokens[index] = self.clone_tokens[index] + ids
        clone.check()
        assert clone.tokens == self.clone_tokens[index]

    @rule()
    def read_tokens(self):
        """Reading the ids (which reads the unread arrays once) gives the reference ids."""
        assert self.rt.tokens == self.expected
        assert self.rt.committed_tokens == (self.expected[: self.bases[0]] if self.bases else self.expected)

    @invariant()
    def consistent(self):
        self.rt.check()
        assert self.rt.offset == len(self.expected)
        # Peek, not rt.tokens: reading would leave no unread ids for the next
        # step (a rollback, a commit) to get wrong.
        assert self.rt._ledger.peek(self.rt.offset) == self.expected
        assert self.rt.depth == len(self.bases)
        assert [b.base_offset for b in self.branches] == self.bases


class _Failure(Exception):
    """Raised by a decoder layer made to fail (forward_raises)."""


def _fail(self, *args, **kwargs):
    raise _Failure("a decoder layer failed half-way through the model call")


def machine_for(
    model, *, strategy: str = "auto", vocab: int = 64, gdn_prefill: str = "native"
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
