"""The speculation gate of a batched step: how many positions every row verifies.

A batched verify pads every row to the longest row's drafts, and on a CPU a
forward costs about in proportion to rows x positions, so speculation only
pays when the tokens it is expected to add outweigh the wider forward. Each
step the gate picks the batch's draft width K (0: a plain step, no fork) that
maximises expected emitted tokens per second ("goodput", as SmartSpec's
dynamic speculation length):

    E(K) = sum_i 1 + p1_i (1 + p_i + ... + p_i^(min(K, avail_i) - 1))
    K*   = argmax_K  E(K) / cost(rows, K)                    cost(rows, 0): a plain step

avail_i is what row i can draft (its room; with prompt lookup, its match).
p1_i is row i's rate of accepting a round's first draft and p_i its rate of
accepting each later one after the one before it, each the ratio of two decayed
counts (`Acceptance`: the maximum-likelihood estimates of a run that stops at
its first rejection). A joining row starts at the rates pooled over every
row's rounds (`Gate.pooled`). Estimates only move when rows draft, so after
`probe` plain steps in a row the batch drafts (one token; a blockwise drafter
its best-rated width, which costs it about as much), and estimates that
collapsed after a miss streak can recover; a probe finding the estimates no
better than the last one did doubles the wait (up to `max_probe`), so while
speculation does not pay probes cost one drafting step per `probe`..`max_probe`
steps. While the gate
keeps choosing plain steps from unchanged inputs (offers, acceptance counts, the
cost records that can move a choice) and no probe is due, it answers plain
without pricing the widths again, so a quiet step's choice costs O(rows). Where every
width it could choose (the measured ones, the narrowest untried at its guess)
costs more than 1 + K plain steps (not even drafts all accepted could pay: a CPU
where the drafter costs half a forward) probes wait `max_probe`.

Costs are measured on the gate's clock (the wall clock by default), a width's as its ratio to the plain steps timed just before it
(`MeasuredCost`), never below a narrower width's; an untried width is guessed
at the widest measured one's cost plus the least a width added (for a blockwise
drafter, a DFlash block, not counting width 1's step over plain: that is the
drafter's one call, which wider widths do not repeat), and a measured
width must beat plain steps by `margin`. A decoder asks once per step, and with
a drafter that offers every row its room it asks for the next step while this
step's tokens are still lazy (`BatchDecoder._plan`), so its plain steps
pipeline as a plain decoder's do. A plain step that only reads its lookahead
and launches none (the one before a drafting step) is not timed: its forward
ran in the step before it, and it timed 0.2x a plain step, which once priced
DFlash widths at 11-18 plain steps against the plain steps just before them.

The gate only sets widths: rows verify their drafts exactly as before, so
every row's output is the same whatever it decides.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from ..errors import InvariantError

# The default `min_prob` of a draft model's rows (DraftPolicy; `stream_generate`'s
# `draft_min_prob`, the server's). The shipped draft's greedy token matched the
# target's 95-100% of the time when it gave it p >= 0.3 and 50-68% below; 0.25 was
# among the fastest settings on held-out code prompts with 4 drafts per round
# (docs/benchmarks.md).
DRAFT_MIN_PROB = 0.25

# The weight of the past in `Gate.pooled`, per round of any row: about the last 20 rounds.
POOL_DECAY = 0.95


def default_clock() -> Callable[[], float]:
    """What the gate times steps by: the wall clock, on every device. A step's cost is kept as
    its ratio to the plain steps just before it (`MeasuredCost`), so load from other processes
    moves both alike. The process's CPU time, the default before, counts the BLAS threads'
    time: on a CPU it charged a plain one-token step of 8 rows 1.7x its wall time and an MTP
    round 1.5x, so the gate ran width-1 rounds it measured at 1.5 plain steps where they took
    1.65-1.86 (gated MTP at 8 rows 0.91x plain on CPU time, 1.02x on the wall clock, the same
    run); pass `clock=time.process_time` for it."""
    return time.perf_counter


class StepCost(Protocol):
    """Seconds a batched step of `rows` rows drafting `width` tokens each (0: plain) costs."""

    def estimate(self, rows: int, width: int) -> Optional[float]:
        """The expected cost, None when nothing says yet."""

    def record(self, rows: int, width: int, seconds: float) -> None:
        """A step of that shape took `seconds` (a fixed table ignores it)."""


class TableCost:
    """A fixed cost: `fn(rows, width)` seconds (tests and calibrated tables); records nothing."""

    def __init__(self, fn: Callable[[int, int], float]):
        self.fn = fn

    def estimate(self, rows: int, width: int) -> Optional[float]:
        return self.fn(rows, width)

    def record(self, rows: int, width: int, seconds: float) -> None:
        pass


class MeasuredCost:
    """Step costs measured online, per (rows, width): a width's cost as the median of the last
    `window` ratios of its steps to the plain steps measured just before each (the median of
    the last `recent` there), times the plain steps' median now.

    Ratios, not seconds: on a shared CPU other processes move every step's time by 2-8x
    within seconds, so a width timed in a quiet moment against plain steps timed in a busy
    one looked cheaper than a plain step (and the gate ran rounds that cost 1.6 plain
    steps); a step and the plain steps just before it meet about the same load. A median,
    not a mean: a step that also evaluates lazy work left by a join can take 30x the usual,
    and a mean would carry that into many decisions. A width measured before any plain step
    at its row count keeps its seconds. A shape not measured yet at this row count is scaled
    from the nearest row count where it was (its ratio times this count's plain steps); a
    width never measured is None, which the gate takes as a guess (`Gate.choose`) so it is
    tried once if it may pay, then known.

    Invariant: every list in `samples` holds 1..window positive seconds, every list in
    `ratios` 1..window positive ratios, each for a width > 0 that has samples.
    """

    def __init__(self, window: int = 9, recent: int = 3):
        self.window, self.recent = window, recent
        self.samples: dict[tuple[int, int], list[float]] = {}
        self.ratios: dict[tuple[int, int], list[float]] = {}  # width > 0: seconds / recent plain
        self._medians: dict[tuple, float] = {}  # of `samples` / `ratios`, dropped when they change

    def estimate(self, rows: int, width: int) -> Optional[float]:
        if width and (rows, 0) in self.samples:
            if (rows, width) in self.ratios:
                return self._median("r", rows, width) * self._median("s", rows, 0)
            known = [b for b, w in self.ratios if w == width]
            if known and (rows, width) not in self.samples:
                b = min(known, key=lambda b: abs(b - rows))
                return self._median("r", b, width) * self._median("s", rows, 0)
        if (rows, width) in self.samples:
            return self._median("s", rows, width)
        known = [b for b, w in self.samples if w == width and (b, 0) in self.samples]
        if (rows, 0) not in self.samples or not known:
            return None
        b = min(known, key=lambda b: abs(b - rows))
        return self._median("s", b, width) * self._median("s", rows, 0) / self._median("s", b, 0)

    def count(self, rows: int, width: int) -> int:
        """Steps of that shape measured (in the window)."""
        return len(self.samples.get((rows, width), ()))

    def record(self, rows: int, width: int, seconds: float) -> None:
        seconds = max(seconds, 1e-6)
        if width and (rows, 0) in self.samples:
            plain = statistics.median(self.samples[rows, 0][-self.recent:])
            self._keep(self.ratios, "r", rows, width, seconds / plain)
        self._keep(self.samples, "s", rows, width, seconds)

    def _keep(self, table: dict, kind: str, rows: int, width: int, value: float) -> None:
        kept = table.setdefault((rows, width), [])
        kept.append(value)
        del kept[: -self.window]
        self._medians.pop((kind, rows, width), None)

    def check(self) -> None:
        for name, table in (("step cost samples", self.samples), ("step cost ratios", self.ratios)):
            for key, kept in table.items():
                if not 1 <= len(kept) <= self.window or min(kept) <= 0:
                    raise InvariantError(f"{name} for {key}: {kept}, not 1..{self.window} positive values")
        stray = [key for key in self.ratios if key[1] == 0 or key not in self.samples]
        if stray:
            raise InvariantError(f"step cost ratios for {stray}: a width > 0 with samples each")

    def _median(self, kind: str, rows: int, width: int) -> float:
        key = (kind, rows, width)
        if key not in self._medians:  # the gate asks every step; samples change once a step
            self._medians[key] = statistics.median((self.ratios if kind == "r" else self.samples)[rows, width])
        return self._medians[key]


@dataclass
class Acceptance:
    """One row's acceptance estimate: decayed counts of drafts accepted and tried, over all
    positions and at the first position alone.

    Two rates: p1 = first_hits / first_tries for a round's first draft, and p = the rest's
    (hits - first_hits) / (tries - first_tries) for each later draft given the one before it
    was accepted, each the maximum-likelihood estimate of a geometric run from its counts. A
    later draft is accepted more often than a first: DFlash's shipped drafter accepts 0.65-0.70
    of first drafts and 0.75-0.87 of each later one, where one rate for both expected 2.0
    tokens of a block of 8 that gave 3.5, and kept the gate plain where blocks paid 1.3x.

    Invariant: 0 <= first_hits <= first_tries <= tries, first_hits <= hits,
    hits - first_hits <= tries - first_tries, tries > 0.
    """

    hits: float = 1.0  # prior: a rate of 0.5 worth two tries, soon outweighed
    tries: float = 2.0
    # None: the overall rate, worth one try (of `tries`), as the prior's first position
    first_hits: Optional[float] = None
    first_tries: Optional[float] = None

    def __post_init__(self):
        if self.first_tries is None:
            self.first_tries = min(1.0, self.tries)
            self.first_hits = self.hits / self.tries * self.first_tries if self.tries > 0 else 0.0

    def check(self) -> None:
        h, t, h1, t1 = self.hits, self.tries, self.first_hits, self.first_tries
        if not (0 <= h1 <= t1 <= t and h1 <= h and h - h1 <= t - t1 + 1e-9 and t > 0):
            raise InvariantError(f"acceptance counts {h} of {t} tries, {h1} of {t1} first: need 0 <= first hits "
                                 f"<= first tries <= tries, and no more later hits than later tries, tries > 0")

    @property
    def rate(self) -> float:
        """Drafts accepted per draft tried, over all positions."""
        return self.hits / self.tries

    @property
    def first_rate(self) -> float:
        return self.first_hits / self.first_tries if self.first_tries > 0 else self.rate

    @property
    def later_rate(self) -> float:
        later = self.tries - self.first_tries
        return min(1.0, (self.hits - self.first_hits) / later) if later > 1e-9 else self.rate

    def update(self, drafted: int, accepted: int, decay: float) -> None:
        if drafted == 0:
            return
        self.hits = decay * self.hits + accepted
        self.tries = decay * self.tries + accepted + (accepted < drafted)
        self.first_hits = decay * self.first_hits + (accepted > 0)
        self.first_tries = decay * self.first_tries + 1

    def scaled(self, rounds: float) -> "Acceptance":
        """The same rates, worth `rounds` rounds (first tries)."""
        f = rounds / self.first_tries
        return Acceptance(self.hits * f, self.tries * f, self.first_hits * f, rounds)

    def expected(self, k: int) -> float:
        """Drafts expected accepted out of k: p1 (1 + p + p^2 + ... + p^(k-1))."""
        if k <= 0:
            return 0.0
        p, total, run = self.later_rate, 0.0, 1.0
        for _ in range(k - 1):
            run *= p
            total += run
        return self.first_rate * (1.0 + total)


class Gate:
    """Chooses each step's draft width from row estimates and a step cost.

    Args:
        cost: a StepCost, or a callable (rows, width) -> seconds (a fixed table);
            None: measured online (`MeasuredCost`).
        decay: weight of the past in each row's acceptance counts, per round drafted.
        probe: after that many plain steps in a row, one step drafts one token
            (0: never probe); doubled after each probe finding the estimates no
            better than the last, up to `max_probe`.
        clock: seconds, for measuring steps (the decoder times its steps by it); None:
            `default_clock()` (the wall clock).
        plain_samples: with measured costs, a row count's plain steps are measured
            this many times before any width is tried at it: the first step at a
            row count often also computes what a join or a leave left lazy (the
            rows' merged or cut caches), and a plain cost taken from it alone makes
            every width look cheap (the gate then speculates where it does not pay).
        margin: a measured width is chosen over plain steps only when its expected tokens per
            second beat theirs by this fraction (a table's too: a width that barely pays by its
            estimates gains little where it is right and loses where it is not).
        blockwise: the drafter proposes any width in one call (a DFlash block), so a wider width
            adds only verify positions: an untried width is guessed at the widest measured one's
            cost plus the least a measured width past the first added (nothing while only the
            first is measured), since what width 1 adds over a plain step is mostly the drafter's
            fixed call. The decoder sets it from its drafter (`Drafter.blockwise`).
    """

    def __init__(self, cost=None, *, decay: float = 0.8, probe: int = 8, max_probe: int = 256,
                 clock: Optional[Callable[[], float]] = None, plain_samples: int = 3, margin: float = 0.05,
                 blockwise: bool = False):
        if cost is None:
            cost = MeasuredCost()
        elif callable(cost) and not isinstance(cost, (TableCost, MeasuredCost)):
            cost = TableCost(cost)
        self.cost: StepCost = cost
        self.decay = decay
        self.probe, self.max_probe = probe, max_probe
        self.wait = probe  # plain steps before the next probe
        self.quiet = 0  # plain steps in a row (the gate chose 0)
        self.probed = None  # at the last probe: expected rate of width 1 over plain
        self.clock = clock if clock is not None else default_clock()
        self.plain_samples = plain_samples
        self.margin = margin
        self.blockwise = blockwise
        self.last: dict = {}  # the last choice: width, expected tokens per second of each width
        # What the last full evaluation that chose plain was computed from: (avail, each row's
        # (hits, tries), `_costs`), or None. While a choice sees the same inputs and no probe is due
        # it is plain again without re-evaluating (a quiet step's decision costs O(rows), not
        # O(rows x widths) estimates). Dropped by any choice that is not plain.
        self._quiet_key: tuple | None = None
        # Bumped by every record (through `record`: costs recorded past it go unseen) that can move
        # a choice: a width > 0, or a plain step while its row count's plain steps are still being
        # measured (`plain_samples`). Plain steps measured past that only rescale costs the ratios
        # already set (a width's rate over plain's stays).
        self._costs = 0
        self.pooled = Acceptance()  # every row's rounds, decayed by POOL_DECAY per round

    def prior(self) -> Acceptance:
        """The pooled rates, worth as many rounds as a row that has drafted long holds (1 / (1 -
        decay)), or as the pool has seen where that is fewer (at first the default prior)."""
        pooled, default = self.pooled, Acceptance()
        if pooled.first_tries <= default.first_tries:
            return default
        held = 1.0 / (1.0 - self.decay) if self.decay < 1 else default.first_tries
        return pooled.scaled(min(held, pooled.first_tries))

    def choose(self, avail: list[int], rows: list[Acceptance]) -> int:
        """The width K for a step where row i can draft avail[i] tokens."""
        B, top = len(avail), max(avail, default=0)
        if top == 0:
            return 0
        key = None
        if self._quiet_key is not None and (self.quiet < self.wait or not self.probe):
            key = (tuple(avail), tuple((r.hits, r.tries) for r in rows), self._costs)
            if key == self._quiet_key:  # the same inputs as the last plain choice, no probe due
                self.quiet += 1
                return 0
        self._quiet_key = None
        plain = self.cost.estimate(B, 0)
        counted = getattr(self.cost, "count", None)  # a fixed table has nothing to count
        if plain is None or (counted is not None and counted(B, 0) < self.plain_samples):
            self.last = {"width": 0, "why": "measure plain"}
            return 0  # plain steps measure it (plain is never a loss)
        rates, floor, slope, measured = {0: B / plain}, plain, None, {0}
        for k in range(1, top + 1):
            c = self.cost.estimate(B, k)
            if c is None:
                # unmeasured: guessed to cost what the narrower widths cost plus the least a width
                # added between them (a step is never cheaper for verifying more; the first width
                # tried is guessed as cheap as a plain step), the narrowest untried only, so widths
                # are tried narrowest first and only while the guess says widening may pay
                guess = floor + (slope or 0.0)
            else:
                # never cheaper than a narrower width or a plain step: a few lucky timings on a
                # shared CPU must not make verifying more look cheaper than verifying less
                c = max(c, floor)
                measured.add(k)
                slope = self._slope(k, c, floor, plain, slope)
                floor = c
            gain = sum(1 + r.expected(min(k, a)) for a, r in zip(avail, rows))
            rates[k] = gain / (guess if c is None else c)
            if c is None:  # one untried width at a time: the frontier widens only while it pays
                break
        # a measured width must beat plain steps by `margin` (noise in a few timed steps must not
        # tip a batch into rounds that cost as much as they give); an untried one is tried once
        best = max(rates, key=lambda k: (rates[k] / (1.0 + self.margin if k and k in measured else 1.0), -k))
        if best:  # speculation pays by the estimates: probes wait the shortest again
            self.quiet, self.wait = 0, self.probe
        elif self.probe and self.quiet >= self.wait and (self.quiet >= self.max_probe
                                                         or not self._hopeless(B, top, plain)):
            # a probe drafts the width that comes nearest to paying: width 1 where each width costs a
            # draft of its own; a blockwise drafter's wider block costs a few verify positions more
            # and tells the estimates of every position (its width 1 cost 2.0 plain steps, its 7
            # 2.4, for 1.7 and 3.5 tokens)
            probe = max((k for k in rates if k), key=lambda k: (rates[k], -k)) if self.blockwise else 1
            # back off while probes show the estimates no better than at the last probe
            ratio = rates[probe] / rates[0]
            # better by the margin: a ratio drawn from noisy step times is better than the last
            # one half the time, and every such reset brought probes back to every `probe` steps
            better = self.probed is not None and ratio > self.probed * (1.0 + self.margin)
            best, self.quiet, self.probed = probe, 0, ratio
            self.wait = self.probe if better else min(2 * self.wait, self.max_probe)
        else:
            self.quiet += 1
            self._quiet_key = key or (tuple(avail), tuple((r.hits, r.tries) for r in rows), self._costs)
        self.last = {"width": best, "rates": rates}
        return best

    def _slope(self, k: int, c: float, floor: float, plain: float, slope: Optional[float]) -> Optional[float]:
        """The least a measured width added over the one below it, width k (cost c, the narrower
        one's `floor`) counted; a blockwise drafter's width 1 is not (its step over plain is the
        drafter's call, which wider widths do not repeat)."""
        if (k > 1 or c > plain) and not (k == 1 and self.blockwise):
            return c - floor if slope is None else min(slope, c - floor)
        return slope

    def _hopeless(self, rows: int, top: int, plain: float) -> bool:
        """Every width up to `top` the gate could choose costs more than 1 + K plain steps: not even
        drafts all accepted could pay, so a probe (which only moves acceptance) waits `max_probe`.
        Those are the measured widths and the narrowest untried one at `choose`'s guess (the
        widest measured one's cost plus the least a width added): `choose` tries no wider one
        before that one pays. (Before, one untried width kept a gate probing every 8..64 steps
        where width 1 cost 2.2 plain steps: DFlash, the MTP head at 8 rows.)"""
        floor, slope = plain, None
        for k in range(1, top + 1):
            c = self.cost.estimate(rows, k)
            if c is None:
                return slope is not None and floor + slope > (1 + k) * plain
            c = max(c, floor)
            slope = self._slope(k, c, floor, plain, slope)
            floor = c
            if c <= (1 + k) * plain:
                return False
        return True

    def check(self) -> None:
        """The pooled estimate's invariant and the measured costs' (a fixed table has none)."""
        self.pooled.check()
        if isinstance(self.cost, MeasuredCost):
            self.cost.check()

    def record(self, rows: int, width: int, seconds: float) -> None:
        self.cost.record(rows, width, seconds)
        counted = getattr(self.cost, "count", None)
        if width or (counted is not None and counted(rows, 0) <= self.plain_samples):
            self._costs += 1


class DraftPolicy:
    """How far each row drafts in a step: the one place that decides, for one row or many.

    Four rules, in this order:

        room_i   = min(cap_i, tokens row i may still emit - 1)       never draft past max_tokens
        avail_i  = what the drafter offers within room_i              (prompt lookup: its match)
        width_i  = min(avail_i, K), K = gate.choose(avail, estimates) with a cost `Gate`; else avail_i
        drafting stops early for row i after a draft its draft model gives less than `min_prob`

    and after each round `update` moves the row's estimate (for the gate), the gate's
    estimate pooled over every row's rounds (`Gate.pooled`: a joining row's estimate starts
    at its rates, `new_estimate`, so a row of a few dozen tokens does not spend its life
    probing its way up from an even prior where the rows before it accepted 70%), and its
    cap: with `adaptive` and neither a cost gate nor `min_prob`, the cap halves
    after a round that accepted nothing and doubles after one that accepted
    everything (1..width). None of it changes what a row emits, only how fast.

    Args:
        width: drafts per row per step at most (0: plain decoding).
        gate: a cost `Gate` choosing each step's width, or None.
        min_prob: see above (a draft model's own probability; 0: off).
        adaptive: halve/double each row's cap (when no gate and no min_prob rules).
    """

    def __init__(self, width: int, *, gate: Optional[Gate] = None, min_prob: float = 0.0, adaptive: bool = True):
        if width < 0:
            raise ValueError(f"width must be >= 0, got {width}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be a probability in [0, 1], got {min_prob}")
        self.width = width
        self.gate = gate if width else None
        self.min_prob = min_prob
        self.adaptive = adaptive and gate is None and not min_prob

    def new_estimate(self) -> Acceptance:
        """A joining row's estimate (`Gate.prior`; without a gate, the default prior)."""
        return self.gate.prior() if self.gate is not None else Acceptance()

    def room(self, cap: int, remaining: int) -> int:
        """Drafts a row with this cap may propose when it may still emit `remaining` tokens (-1: no limit)."""
        if not self.width:
            return 0
        return cap if remaining < 0 else max(0, min(cap, remaining - 1))

    def choose(self, avail: list[int], rows: list[Acceptance]) -> list[int]:
        """Each row's width this step, from what each can draft (`avail`, within its room)."""
        if self.gate is None:
            return list(avail)
        K = self.gate.choose(avail, rows)
        return [min(a, K) for a in avail]

    def update(self, cap: int, estimate: Acceptance, drafted: int, accepted: int) -> int:
        """Record a row's round; returns its new cap."""
        estimate.update(drafted, accepted, self.gate.decay if self.gate is not None else 1.0)
        if self.gate is not None:
            self.gate.pooled.update(drafted, accepted, POOL_DECAY)
        if self.adaptive and drafted:
            if accepted == 0:
                return max(1, cap // 2)
            if accepted == drafted:
                return min(self.width, 2 * cap)
        return cap
