"""A hypothesis state machine for BatchRuntime: random joins, leaves, forwards,
forks, ragged commits, rollbacks, extracts and tree rounds (a tree per row, docs/tree.md).

The reference for each row is plain mlx-lm: a `make_prompt_cache` cache fed
exactly the tokens the row should hold before a forward, then the forward's
tokens; every batched forward's logits for each row's real tokens must be
within `ATOL` of that (see docs/batching.md for why not bit-equal). After
every step `check()` runs and each row's ids equal the reference ids.

    run_machine(batch_machine_for(model), examples=3)

On a sliding-window model give `prompt` (longest joining prompt) and `chunk`
(longest forward) past the window, so rows pass it, branches straddle its
edge and the batched layer compacts (`layers/window.py`: `BatchWindowLayer`).
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from mlx_lm.models.cache import make_prompt_cache

from ..batch import BatchRuntime
from ..layers.tree import Tree
from ..runtime import Runtime
from .strategies import draft_trees

ATOL = 1e-4
MAX_ROWS = 4


def reference_logits(model, held: list, new: list) -> mx.array:
    """mlx-lm's logits for `new` after `held`, on its own cache: [len(new), V]."""
    cache = make_prompt_cache(model)
    if held:
        model(mx.array(held, dtype=mx.uint32)[None], cache=cache)
    return model(mx.array(new, dtype=mx.uint32)[None], cache=cache)[0]


class BatchMachine(RuleBasedStateMachine):
    model = None
    strategy = "auto"
    vocab = 64
    prompt = 6  # longest prompt a row joins with
    chunk = 4  # longest forward of a row
    atol = ATOL  # how far a row's logits may be from mlx-lm's (16-bit models round more: segcache.check)

    def __init__(self):
        super().__init__()
        self.br = BatchRuntime(self.model, recurrent_strategy=self.strategy)
        self.want: dict = {}  # row id -> ids it holds
        self.next_id = 0

    def _compare(self, logits, chunks):
        for i, rid in enumerate(self.br.ids):
            new = chunks[i]
            ref = reference_logits(self.model, self.want[rid], new)
            got = logits[i, : len(new)]
            diff = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item()
            assert diff <= self.atol, f"row {rid}: logits differ from mlx-lm's by {diff}"
            self.want[rid] = self.want[rid] + new

    @initialize(data=st.data())
    def start(self, data):
        for size in data.draw(st.lists(st.integers(0, self.prompt), min_size=2, max_size=3)):
            self._join(data, size)

    @precondition(lambda self: not self.br.branch_open and len(self.br) < MAX_ROWS)
    @rule(data=st.data())
    def join(self, data):
        self._join(data, data.draw(st.integers(0, self.prompt)))

    def _join(self, data, size):
        tokens = data.draw(st.lists(st.integers(0, self.vocab - 1), min_size=size, max_size=size))
        rt = None
        if tokens:
            rt = Runtime(self.model, recurrent_strategy=self.strategy)
            rt.forward(tokens)
        rid, self.next_id = self.next_id, self.next_id + 1
        self.br.join(rid, rt)
        self.want[rid] = list(tokens)

    @precondition(lambda self: len(self.br) > 1)
    @rule(data=st.data())
    def leave(self, data):
        rid = data.draw(st.sampled_from(self.br.ids))
        self.br.leave(rid)
        del self.want[rid]

    @precondition(lambda self: len(self.br) > 0 and not self.br.sealed)
    @rule(data=st.data())
    def forward(self, data):
        B = len(self.br)
        token = st.integers(0, self.vocab - 1)
        if self.br.branch_open and data.draw(st.booleans()):
            chunks = [data.draw(st.lists(token, min_size=1, max_size=self.chunk)) for _ in range(B)]
        else:
            S = data.draw(st.integers(1, max(3, self.chunk - 1)))
            chunks = [data.draw(st.lists(token, min_size=S, max_size=S)) for _ in range(B)]
        logits = self.br.forward(chunks)
        self._compare(logits, chunks)

    @precondition(lambda self: not self.br.branch_open and len(self.br) > 0)
    @rule()
    def fork(self):
        self.br.fork()
        self.base = {rid: len(ids) for rid, ids in self.want.items()}

    @precondition(lambda self: self.br.branch_open)
    @rule(data=st.data())
    def commit(self, data):
        ns = {}
        for rid in self.br.ids:
            fed = len(self.want[rid]) - self.base[rid]
            ns[rid] = data.draw(st.integers(0, fed))
        self.br.commit(ns)
        for rid, n in ns.items():
            del self.want[rid][self.base[rid] + n :]

    @precondition(lambda self: not self.br.branch_open and len(self.br) > 0)
    @rule(data=st.data())
    def speculative_round(self, data):
        """fork, one ragged forward (pending + drafts per row), a ragged commit."""
        self.fork()
        token = st.integers(0, self.vocab - 1)
        chunks = [data.draw(st.lists(token, min_size=1, max_size=self.chunk)) for _ in self.br.ids]
        self._compare(self.br.forward(chunks), chunks)
        self.check_rows()
        self.commit(data)

    @precondition(lambda self: not self.br.branch_open and len(self.br) > 0 and self.br.takes_trees)
    @rule(data=st.data())
    def tree_round(self, data):
        """fork, one forward of a tree per row (sizes differ: padded), every node of every row against
        mlx-lm's forward of its path; a root path kept per row (`keep_paths`), then a ragged commit."""
        self.fork()
        drawn = [data.draw(draft_trees(self.vocab, max_nodes=6)) for _ in self.br.ids]
        logits = self.br.forward_trees([t for t, _ in drawn], [p for _, p in drawn])
        paths = []
        for i, (rid, (tokens, parents)) in enumerate(zip(self.br.ids, drawn)):
            tree = Tree(parents)
            for leaf in sorted(set(range(tree.size)) - set(parents)):
                nodes = tree.path(leaf)
                ref = reference_logits(self.model, self.want[rid], [tokens[j] for j in nodes])
                diff = mx.abs(logits[i, mx.array(nodes)] - ref).max().item()
                assert diff <= self.atol, f"row {rid}: the tree's path to node {leaf} differs from mlx-lm's by {diff}"
            end = data.draw(st.integers(-1, tree.size - 1))
            paths.append(tree.path(end) if end >= 0 else [])
        self.br.keep_paths(paths)
        for rid, (tokens, _), path in zip(self.br.ids, drawn, paths):
            self.want[rid] = self.want[rid] + [tokens[j] for j in path]
        self.check_rows()
        self.commit(data)

    @precondition(lambda self: self.br.branch_open)
    @rule()
    def rollback(self):
        self.br.rollback()
        for rid in self.br.ids:
            del self.want[rid][self.base[rid] :]

    @precondition(lambda self: len(self.br) > 1)
    @rule(data=st.data())
    def extract_and_continue(self, data):
        """An extracted row keeps its branch; it is settled alone and checked, then dropped."""
        rid = data.draw(st.sampled_from(self.br.ids))
        one = self.br.extract(rid)
        one.check()
        ids = self.want.pop(rid)
        if one.branch_open:
            n = data.draw(st.integers(0, len(ids) - self.base[rid]))
            one.commit([n])
            ids = ids[: self.base[rid] + n]
        assert one.tokens(rid) == ids
        logits = one.forward([[1]])
        ref = reference_logits(self.model, ids, [1])
        assert mx.abs(logits[0, :1] - ref).max().item() <= self.atol, f"extracted row {rid} drifted"

    @precondition(lambda self: not self.br.branch_open and len(self.br) > 0)
    @rule(data=st.data())
    def round_trip(self, data):
        """A row leaves as a Runtime (`to_runtime`), runs alone a little, and joins again."""
        rid = data.draw(st.sampled_from(self.br.ids))
        rt = self.br.to_runtime(rid)
        rt.check()
        assert rt.tokens == self.want[rid]
        self.br.leave(rid)
        ids = self.want.pop(rid)
        for _ in range(data.draw(st.integers(0, 2))):
            new = data.draw(st.lists(st.integers(0, self.vocab - 1), min_size=1, max_size=self.chunk))
            got = rt.forward(new)[0]
            diff = mx.abs(got - reference_logits(self.model, ids, new)).max().item()
            assert diff <= self.atol, f"row {rid} alone after to_runtime: logits differ by {diff}"
            ids = ids + new
        rid, self.next_id = self.next_id, self.next_id + 1
        self.br.join(rid, rt)
        self.want[rid] = ids

    def check_rows(self):
        self.consistent()

    @invariant()
    def consistent(self):
        self.br.check()
        for rid in self.br.ids:
            assert self.br.tokens(rid) == self.want[rid], f"row {rid} ids"


def batch_machine_for(model, *, strategy: str = "auto", vocab: int = 64, prompt: int = 6,
                      chunk: int = 4) -> type[BatchMachine]:
    """A BatchMachine subclass bound to `model` (run it with statemachine.run_machine)."""
    return type(
        f"BatchMachine_{type(model).__module__.rsplit('.', 1)[-1]}_{strategy}",
        (BatchMachine,),
        {"model": model, "strategy": strategy, "vocab": vocab, "prompt": prompt, "chunk": chunk},
    )
