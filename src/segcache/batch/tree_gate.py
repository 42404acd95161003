"""The tree gate: whether a gated decoder's speculative rounds verify trees or chains.

A tree of N nodes keeps more tokens per round than its chain, and costs a
verify of N positions instead of the chain's width; which wins depends on the
machine (on this CPU a verify costs about what a chain of as many positions
costs, so trees seldom pay; where a verify of 16 positions costs about one
forward they do). So the gate measures both, as the cost gate measures widths:

    rate(b) = decayed emitted tokens / decayed seconds of the speculative rounds run at budget b
    b*      = the tree's budget if rate(tree) > rate(chain) * (1 + margin), else 0 (chains)

Each shape is tried `trial` rounds first (the chain first), then the other
shape runs one round in every `probe`, so a machine whose load changes is
followed. Seconds are the cost gate's clock (the wall clock by default). The gate sets the drafter's budget for the next round; what a row emits
is the same either way (batch/tree.py).

What a gate measured outlives its decoder: `TreeGate.of(model, key)` is one
gate per model (held weakly) and key (the drafter's mode, the budget, one row or
a batch), so a process that generates many times (`stream_generate` per call, a
server's decoder) pays the trial rounds once, not once per generation. Only
speed depends on it, never a token.
"""

from __future__ import annotations

from ..errors import InvariantError

# A model's tree gates, {(key, budget): TreeGate}: a plain attribute of the model (an nn.Module is a
# dict, unhashable; a plain attribute leaves its module tree unchanged and goes with it)
_GATES = "_segcache_tree_gates"


class TreeGate:
    """Chooses each speculative round's node budget: `budget` (trees) or 0 (chains).

    Args:
        budget: the tree's draft nodes per round (the caller's `draft_tree`).
        trial: rounds each shape runs before the rates decide (chains first).
        probe: after this many rounds of the chosen shape, one round of the other.
        decay: weight of the past in each shape's counts, per round of that shape.
        margin: trees must beat chains' measured rate by this fraction to be chosen.

    Invariant: tokens, seconds and rounds hold entries for exactly 0 and `budget`, all >= 0;
    seconds[b] > 0 where rounds[b] > 0.
    """

    @classmethod
    def of(cls, model, key: tuple, budget: int) -> "TreeGate":
        """The process's tree gate of `model` for `key` (a new one the first time)."""
        gates = vars(model).get(_GATES)
        if gates is None:
            gates = {}
            object.__setattr__(model, _GATES, gates)
        if (key, budget) not in gates:
            gates[key, budget] = cls(budget)
        return gates[key, budget]

    def __init__(self, budget: int, *, trial: int = 2, probe: int = 64, decay: float = 0.8, margin: float = 0.03):
        if budget < 1:
            raise ValueError(f"a tree gate needs a budget >= 1, got {budget}")
        self.budget, self.trial, self.probe, self.decay, self.margin = budget, trial, probe, decay, margin
        self.tokens = {0: 0.0, budget: 0.0}
        self.seconds = {0: 0.0, budget: 0.0}
        self.rounds = {0: 0, budget: 0}
        self.since = 0  # rounds of the chosen shape since the other last ran
        self.last: dict = {}  # the last choice and the rates it saw

    def rate(self, budget: int) -> float | None:
        """Measured emitted tokens per second of rounds at `budget` (None: not measured)."""
        return self.tokens[budget] / self.seconds[budget] if self.rounds[budget] else None

    def choose(self) -> int:
        """The next speculative round's budget (0: chains)."""
        for b in (0, self.budget):
            if self.rounds[b] < self.trial:
                self.last = {"budget": b, "why": "trial"}
                return b
        chain, tree = self.rate(0), self.rate(self.budget)
        best = self.budget if tree > chain * (1.0 + self.margin) else 0
        self.since += 1
        if self.since > self.probe:
            self.since = 0
            best = self.budget - best  # the other shape, once
        self.last = {"budget": best, "chain": chain, "tree": tree}
        return best

    def record(self, budget: int, tokens: int, seconds: float) -> None:
        """A speculative round at `budget` (0: a chain round) emitted `tokens` in `seconds`."""
        d = self.decay
        self.tokens[budget] = d * self.tokens[budget] + tokens
        self.seconds[budget] = d * self.seconds[budget] + max(seconds, 1e-6)
        self.rounds[budget] += 1

    def check(self) -> None:
        keys = {0, self.budget}
        if set(self.tokens) != keys or set(self.seconds) != keys or set(self.rounds) != keys:
            raise InvariantError(f"tree gate counts for {sorted(self.tokens)}, not for chains and budget {self.budget}")
        if any(v < 0 for d in (self.tokens, self.seconds, self.rounds) for v in d.values()) or any(
                self.rounds[b] and self.seconds[b] <= 0 for b in keys):
            raise InvariantError(f"tree gate counts {self.tokens} / {self.seconds} / {self.rounds}")
