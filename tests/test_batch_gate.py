"""The speculation gate of BatchDecoder: each step's draft width follows expected tokens per
unit of cost. Driven by fixed cost tables (never time); every row stays token-identical to
the same request generated alone whatever the gate decides."""

import mlx.core as mx
import pytest

from conftest import tiny
from segcache.batch import decoder as decoder_module
from segcache.drafters import GAP_IN_FORK, make_decoder
from segcache.batch.gate import Acceptance, Gate, MeasuredCost
from segcache.generation import stream_generate
from segcache.runtime import Runtime
from segcache.testing import tokenizer as test_tokenizer
from test_mtp_decode import fitted, reference

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [9, 10, 11],
    [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3],
    [20, 21, 22, 23, 24, 20, 21, 22],
]
MAX = 16
K = 4


def proportional(rows, width):  # a CPU-like forward: cost in rows x positions, no fixed part
    return rows * (1 + width)


def flat(rows, width):  # extra positions almost free (a batch far from compute-bound)
    return 1.0 + 0.01 * width


def alone(model, prompt, n=MAX):
    tk = test_tokenizer.tokenizer(eos=False)
    return [r.token for r in stream_generate(model, tk, prompt, max_tokens=n)]


def run(dec, model, prompts=PROMPTS):
    got = {i: [] for i in range(len(prompts))}
    widths = []  # per step: the longest draft of any row
    for i, p in enumerate(prompts):
        rt = Runtime(model)
        rt.forward(p[:-1])
        dec.add(i, rt, p[-1], max_tokens=MAX)
    states = dict(dec.rows)  # each row's counters, kept after it leaves
    while dec.rows:
        out = dec.step()
        widths.append(max(sum(d for _, _, d in e) for e in out.values()))
        for rid, emitted in out.items():
            got[rid].extend(t for t, _, _ in emitted)
            if len(got[rid]) >= MAX:
                dec.remove(rid)
        dec.check()
    return got, widths, list(states.values())


def recording(gate) -> list:
    """The (width, cost) of every step `gate` records, in order."""
    recorded = []
    record = gate.record
    gate.record = lambda rows, width, seconds: (recorded.append((width, seconds)), record(rows, width, seconds))
    return recorded


def assert_alone(got, model, prompts=PROMPTS):
    """Every row emitted what it emits decoded alone."""
    for i, p in enumerate(prompts):
        assert got[i][:MAX] == alone(model, p), f"row {i}"


def counting(dec):
    """Count the target batch's verify forwards: a forward of more than one position per row,
    which a plain step never runs (its pipelined lookahead is one token per row, in a branch)."""
    verifies = []
    forward = dec.batch.forward

    def counted(inputs):
        if (inputs.shape[1] if isinstance(inputs, mx.array) else max(map(len, inputs))) > 1:
            verifies.append(1)
        return forward(inputs)

    dec.batch.forward = counted
    return verifies


@pytest.mark.parametrize("drafter", ("lookup", "draft"))
def test_speculation_that_does_not_pay_never_forks_and_rows_stay_exact(drafter):
    model = tiny("llama")
    draft = model if drafter == "draft" else None  # the draft is the target: every draft accepted
    dec = make_decoder(model, num_draft_tokens=K, draft_model=draft,
                       gate=Gate(proportional, probe=0))
    forks = counting(dec)
    got, widths, states = run(dec, model)
    assert_alone(got, model)
    assert not forks and set(widths) == {0}


@pytest.mark.parametrize("family", ("llama", "qwen3_5"))
def test_speculation_that_pays_drafts_full_width_with_a_draft_model(family):
    model = tiny(family)
    dec = make_decoder(model, num_draft_tokens=K, draft_model=model, gate=Gate(flat))
    forks = counting(dec)
    got, widths, states = run(dec, model)
    assert_alone(got, model)
    # all accepted, so each step emits K + 1 per row until a row's room is smaller
    assert widths[:3] == [K] * 3 and len(forks) == sum(1 for w in widths if w)
    assert all(s.accepted == s.drafted > 0 for s in states)


def test_lookup_rows_draft_their_match_up_to_the_width_the_gate_picks():
    model = tiny("llama")
    # positions past 2 cost far more: K = 2 is the best width for rows that accept all
    dec = make_decoder(model, num_draft_tokens=K, gate=Gate(lambda r, w: 1.0 + 0.01 * w + 10.0 * max(0, w - 2)))
    got, widths, states = run(dec, model)
    assert_alone(got, model)
    assert max(widths) == 2 and 2 in widths


def test_a_batch_that_stopped_drafting_is_probed_and_recovers():
    gate = Gate(lambda r, w: 1.0 + 0.3 * w, probe=3, max_probe=6)
    row = Acceptance()
    for _ in range(6):  # a miss streak: the rate falls and speculation stops paying
        row.update(4, 0, gate.decay)
    widths = []
    for _ in range(15):  # still missing: probes back off, 3 then 6 plain steps between them
        k = gate.choose([4], [row])
        widths.append(k)
        row.update(k, 0, gate.decay)
    assert widths == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    widths = []
    for _ in range(20):  # the row now accepts everything it drafts
        k = gate.choose([4], [row])
        widths.append(k)
        row.update(k, k, gate.decay)
    assert widths[:4] == [0, 0, 1, 0]  # the next probe, 6 plain steps after the last
    assert widths[-1] == 4  # probes come sooner as the estimate rises: back to full width


def test_acceptance_is_the_two_rate_maximum_likelihood():
    """A round's first draft and each later one (given the one before it) have rates of their own,
    each the maximum-likelihood estimate from the rounds: counted here from the rounds directly."""
    rounds = [(4, 2), (3, 3), (5, 0), (2, 1)]  # (drafted, accepted)
    row = Acceptance(hits=0.0, tries=0.0)
    for drafted, accepted in rounds:
        row.update(drafted, accepted, 1.0)
        row.check()
    first = [a > 0 for _, a in rounds]  # every round tried its first draft
    later_hits = sum(max(a - 1, 0) for _, a in rounds)
    later_tries = sum(min(a + 1, d) - 1 for d, a in rounds if a > 0)  # drafts 2.. up to the first rejected
    p1, p = sum(first) / len(first), later_hits / later_tries
    assert (row.first_rate, row.later_rate) == (pytest.approx(p1), pytest.approx(p))
    assert (row.hits, row.tries) == (6.0, 9.0)  # all positions: 2 + 3 + 0 + 1 of 3 + 3 + 1 + 2
    assert row.expected(3) == pytest.approx(p1 * (1 + p + p * p))
    # one rate for both where nothing says otherwise: a constructed estimate, the default prior
    for est in (Acceptance(hits=9.0, tries=10.0), Acceptance()):
        assert est.first_rate == pytest.approx(est.rate) and est.later_rate == pytest.approx(est.rate)
        assert est.expected(2) == pytest.approx(est.rate + est.rate ** 2)


def test_measured_cost_plain_first_then_each_width_then_scaled_across_row_counts():
    cost = MeasuredCost(window=3)
    gate = Gate(cost)
    rows = [Acceptance(), Acceptance()]
    assert gate.choose([3, 3], rows) == 0  # nothing known: plain steps measure it
    cost.record(2, 0, 9.0)  # the first also computed a join's lazy work
    cost.record(2, 0, 1.0)
    assert gate.choose([3, 3], rows) == 0  # plain_samples (3) plain steps before any width
    cost.record(2, 0, 1.0)
    assert cost.estimate(2, 0) == 1.0  # the median: the first step's cost dropped
    assert gate.choose([3, 3], rows) == 1  # the narrowest untried width, guessed as cheap as plain
    for t in (1.1, 99.0, 1.2, 1.2):  # an outlier, then it leaves the window
        cost.record(2, 1, t)
    assert cost.estimate(2, 1) == 1.2  # the median of the last 3
    # width 1: 3 tokens / 1.2 = 2.5, over plain's 2 by more than the margin; untried width 2 is
    # guessed at 1.2 + 0.2 (what width 1 added): 3.5 tokens / 1.4 = 2.5 > 2.5 / 1.05, the most tokens
    assert gate.choose([3, 3], rows) == 2
    cost.record(2, 2, 4.0)
    assert gate.choose([3, 3], rows) == 1  # 3 untried, but guessed at 4.0 + 0.2: not worth a try
    cost.record(4, 0, 2.0)
    assert cost.estimate(4, 1) == 2.4  # scaled by the plain steps' ratio
    assert cost.estimate(4, 3) is None


@pytest.mark.parametrize("family", ("llama", "qwen3_5"))
def test_the_draft_batch_skips_plain_steps_and_catches_up_before_drafting(family):
    model = tiny(family)
    # speculation never pays by the table, so only probes draft: 2 plain steps, a probe, 4, a probe, ...
    dec = make_decoder(model, num_draft_tokens=K, draft_model=model, gate=Gate(proportional, probe=2))
    lags = []
    check = dec.check
    dec.check = lambda: (check(), lags.append([len(dec.rows[r.id].history) - 1 - len(r.tokens) for r in dec.drafter.rows.rows]))
    got, widths, states = run(dec, model)
    assert_alone(got, model)
    assert widths[:8] == [0, 0, 1, 0, 0, 0, 0, 1]
    # the prompt (fed to the draft when the row first drafts) and two plain steps: never fed yet
    assert lags[1] == [len(p) - 1 + 2 for p in PROMPTS]
    # the draft is the target: after catching up it proposes what the target emits, so every probe accepts
    assert all(s.accepted == s.drafted > 0 for s in states)


def test_no_probe_sooner_than_max_probe_where_no_acceptance_could_pay():
    """Every width costs more than 1 + K plain steps: probes (which only move acceptance) wait
    max_probe; where a perfect row would pay, they keep their usual backoff."""
    hopeless = Gate(lambda r, w: 1.0 + 1.5 * w, probe=2, max_probe=8)
    hopeful = Gate(lambda r, w: 1.0 + 0.9 * w, probe=2, max_probe=8)
    for gate in (hopeless, hopeful):
        row = Acceptance(hits=0.0, tries=4.0)  # a row accepting nothing: plain steps pay
        widths = [gate.choose([2], [row]) for _ in range(20)]
        probes = [i for i, k in enumerate(widths) if k]
        if gate is hopeless:
            assert probes == [8, 17]  # every max_probe + 1 steps
        else:
            assert probes[:3] == [2, 7, 16]  # 2, then 4, then 8 plain steps between probes


def test_an_untried_wider_width_keeps_probes_only_where_its_guess_could_pay():
    """Width 1 measured, width 2 untried: probes wait max_probe when width 1 costs more than
    2 plain steps (choose's guess for width 2, 2 x c(1) - plain, then costs more than 3), and
    keep their backoff when width 1 costs 1.5 (width 2 guessed at 2.0 could pay)."""
    for cost_1, want in ((2.5, [8, 17]), (1.5, [2, 7, 16])):
        cost = MeasuredCost()
        for _ in range(3):
            cost.record(1, 0, 1.0)
        cost.record(1, 1, cost_1)
        gate = Gate(cost, probe=2, max_probe=8)
        row = Acceptance(hits=0.0, tries=4.0)
        widths = [gate.choose([2], [row]) for _ in range(20)]
        assert [i for i, k in enumerate(widths) if k][:3] == want, cost_1


def test_a_measured_width_must_beat_plain_steps_by_the_margin():
    rows = [Acceptance(hits=9.0, tries=10.0)] * 2  # a = 0.9: width 1 gives 1.9 tokens per row
    for cost_1, want in ((1.85, 0), (1.75, 1)):  # 1.9 / 1.85 = 1.03x plain: under 5%; 1.9 / 1.75 = 1.09x
        cost = MeasuredCost()
        for _ in range(3):
            cost.record(2, 0, 1.0)
        cost.record(2, 1, cost_1)
        assert Gate(cost, probe=0).choose([1, 1], rows) == want


def test_a_quiet_choice_is_reused_only_while_its_inputs_stay():
    """Plain choices from unchanged inputs are answered without pricing the widths; a change
    of a row's acceptance, of the offers or of a width's measured cost is priced at once, and
    each answer equals a fresh gate's full evaluation of the same inputs."""
    table = lambda r, w: 1.0 + 0.6 * w  # width 1 pays when a row accepts above ~0.68
    gate = Gate(table, probe=100)
    rows = [Acceptance(hits=0.1, tries=2.0), Acceptance(hits=0.1, tries=2.0)]
    assert [gate.choose([3, 3], rows) for _ in range(3)] == [0, 0, 0]
    assert gate.quiet == 3  # quiet steps count as before (probes come at the same steps)
    rows = [rows[0], Acceptance(hits=1.9, tries=2.0)]  # one row accepts: still plain, priced again
    assert gate.choose([3, 3], rows) == 0 == Gate(table, probe=100).choose([3, 3], rows)
    rows = [Acceptance(hits=1.9, tries=2.0)] * 2  # both accept: a new choice, now
    want = Gate(table, probe=100).choose([3, 3], rows)
    assert want > 0 and gate.choose([3, 3], rows) == want
    rows = [Acceptance(hits=0.1, tries=2.0)] * 2
    assert gate.choose([3, 3], rows) == 0 and gate.choose([0, 3], rows) == 0  # offers changed: priced
    measured = MeasuredCost()
    gate = Gate(measured, probe=100)
    rows = [Acceptance(hits=1.9, tries=2.0)]
    for _ in range(3):
        gate.record(1, 0, 1.0)
    gate.record(1, 1, 3.0)  # width 1 at 3 plain steps: plain
    assert gate.choose([1], rows) == 0 and gate.choose([1], rows) == 0
    for _ in range(9):
        gate.record(1, 1, 1.2)  # now width 1 pays: the next choice sees it
    assert gate.choose([1], rows) == 1 == Gate(measured, probe=100).choose([1], rows)


@pytest.mark.parametrize("family", ("qwen3_5", "qwen3_next"))
def test_gated_mtp_plain_steps_pipeline_and_hand_the_head_every_token(family, monkeypatch):
    """Speculation never pays by the table, so the gate's plain steps run ahead (one lookahead
    each, in a branch) and its probes draft; the head gets the plain steps' hidden states in one
    hand-over (BACKLOG steps at most, or before a probe or a join; cut to the rows that stay when
    one leaves). Every row is plain greedy's, the head holds one state per token its target holds
    (check()), and its K/V and unfed states are those of a decoder handing them over every step."""
    model, head = fitted(family)

    def decoder(backlog):
        monkeypatch.setattr(decoder_module, "BACKLOG", backlog)
        return make_decoder(model, num_draft_tokens=2, mtp=head, gate=Gate(proportional, probe=4, max_probe=8))

    def start(dec, i):
        rt = Runtime(model)
        rt.forward(PROMPTS[i][:-1])
        dec.add(i, rt, PROMPTS[i][-1], max_tokens=n)

    n = 24
    decs = [decoder(3), decoder(1)]  # BACKLOG applies at each step: patched around each one's steps
    lookaheads = []
    fork = decs[0].batch.fork
    decs[0].batch.fork = lambda: (lookaheads.append(decs[0]._round is None), fork())[1]
    got = [{i: [] for i in range(len(PROMPTS))} for _ in decs]
    widths, steps = [], 0
    for dec in decs:
        for i in (0, 1):
            start(dec, i)
    while decs[0].rows:
        for d, (dec, backlog) in enumerate(zip(decs, (3, 1))):
            monkeypatch.setattr(decoder_module, "BACKLOG", backlog)
            if steps == 4:  # late joins, with a lookahead in flight
                for i in (2, 3):
                    start(dec, i)
            out = dec.step()
            if d == 0:
                widths.append(dec.last_width)
            for rid, emitted in out.items():
                got[d][rid].extend(t for t, _, _ in emitted)
                if dec.rows[rid].finished:
                    dec.remove(rid)
        steps += 1
        if steps % 5 == 0 and decs[0].rows:  # now and then (check() hands the backlog over itself)
            for dec in decs:
                dec.check()
            a, b = (dec.drafter.rows for dec in decs)
            assert a.ids == b.ids and a.held == b.held and a.lags == b.lags
            assert mx.allclose(a.layers[0].keys[..., : max(a.held), :], b.layers[0].keys[..., : max(b.held), :],
                               atol=1e-5)
            if a.tail is not None:
                assert mx.allclose(a.tail[:, : max(a.lags)], b.tail[:, : max(b.lags)], atol=1e-5)
    for i, p in enumerate(PROMPTS):
        assert got[0][i][:n] == reference(model, p, n) == got[1][i][:n], f"row {i}"
    assert 0 in widths and any(widths)  # plain steps and probes
    assert sum(lookaheads) > len(widths) // 2  # most plain steps ran ahead


def test_a_width_is_never_taken_as_cheaper_than_a_narrower_one():
    cost = MeasuredCost()
    for _ in range(3):
        cost.record(2, 0, 1.0)
    cost.record(2, 1, 2.0)  # 1.5 tokens per row for 2 plain steps: does not pay
    cost.record(2, 2, 0.5)  # lucky timings: 1.75 tokens for half a plain step, were it believed
    assert Gate(cost, probe=0).choose([2, 2], [Acceptance(), Acceptance()]) == 0  # width 2 taken at 2.0


def test_a_width_costs_its_ratio_to_the_plain_steps_timed_just_before_it():
    """Other processes move step times by several x within seconds: a width timed while the
    machine was quiet must not look cheap against plain steps timed once it got busy."""
    cost = MeasuredCost()
    for _ in range(3):
        cost.record(2, 0, 1.0)  # quiet
    cost.record(2, 1, 1.6)  # quiet too: 1.6 plain steps
    for _ in range(9):
        cost.record(2, 0, 3.0)  # busy now
    assert cost.estimate(2, 1) == pytest.approx(4.8)  # 1.6 of the plain steps now, not 1.6 seconds
    assert Gate(cost, probe=0).choose([1, 1], [Acceptance(), Acceptance()]) == 0  # 1.5 tokens for 1.6 steps
    cost.record(4, 0, 6.0)
    assert cost.estimate(4, 1) == pytest.approx(9.6)  # another row count: the same ratio
    cost.check()


def _measured(costs: dict, rows: int = 1) -> MeasuredCost:
    """Plain steps at 1.0 each (three of them, as the gate asks), then each width's one timing."""
    cost = MeasuredCost()
    for _ in range(3):
        cost.record(rows, 0, 1.0)
    for width, seconds in costs.items():
        cost.record(rows, width, seconds)
    return cost


def test_a_blockwise_drafter_guesses_wider_widths_from_verify_positions_only():
    """Width 1 costs 2.0 plain steps: for a drafter paying a draft per width, width 2 is guessed at
    3.0 (not worth a try for 1 + 0.9 + 0.81 tokens); for a block drafter, whose width 1 is mostly
    its one call, width 2 is guessed at width 1's 2.0, so it is tried."""
    row = Acceptance(hits=9.0, tries=10.0)  # 0.9 at every position
    for blockwise, want in ((False, 0), (True, 2)):
        gate = Gate(_measured({1: 2.0}), probe=0, blockwise=blockwise)
        assert gate.choose([7], [row]) == want, blockwise
        if blockwise:  # 2.71 tokens for 2.0: the untried guess, tried once
            assert gate.last["rates"][2] == pytest.approx((1 + 0.9 + 0.81) / 2.0)


def test_a_blockwise_probe_drafts_its_best_rated_width():
    """Nothing pays (a row accepting 0.5: 1.875 tokens at width 3 for 2.02 plain steps): a probe
    drafts width 1 for a drafter paying per width, and the best-rated width for a block drafter
    (there, width 3 costs little over width 1)."""
    row = Acceptance(hits=0.5, tries=1.0)
    for blockwise, want in ((False, 1), (True, 3)):
        gate = Gate(_measured({1: 2.0, 2: 2.01, 3: 2.02}), probe=2, blockwise=blockwise)
        widths = [gate.choose([3], [row]) for _ in range(3)]
        assert widths == [0, 0, want], blockwise


def test_a_joining_row_starts_at_the_rates_pooled_over_earlier_rows():
    """Rows before it accepted every first draft and half of the later ones: a new row's estimate
    has those rates, worth the rounds a row that drafted long holds (1 / (1 - decay) = 5)."""
    from segcache.batch.gate import DraftPolicy

    gate = Gate(_measured({}), decay=0.8)
    policy = DraftPolicy(4, gate=gate)
    assert policy.new_estimate() == Acceptance()  # nothing pooled yet: the default prior
    for _ in range(200):
        for accepted in (1, 2):  # drafted 4: first accepted always, a later one half the time
            policy.update(4, Acceptance(), 4, accepted)
    gate.check()
    new = policy.new_estimate()
    new.check()
    assert new.first_rate == pytest.approx(1.0) and new.later_rate == pytest.approx(gate.pooled.later_rate)
    assert gate.pooled.later_rate == pytest.approx(1 / 3, abs=0.02)  # 1 of 3 later tries: 0 or 1 accepted + a miss
    assert new.first_tries == pytest.approx(5.0)


def test_the_plain_step_before_a_drafting_step_is_not_timed_as_a_plain_step():
    """A pipelined plain step that launches no lookahead (the next step drafts) runs no forward of
    its own: timed, it would price plain steps near 0 and every width far above them. With a clock
    counting the target's forwards, every plain step the gate records ran one."""
    model = tiny("qwen3_5")
    forwards = [0]
    dec = make_decoder(model, num_draft_tokens=K, draft_model=model,
                       gate=Gate(proportional, probe=2, clock=lambda: float(forwards[0])))
    call = dec.batch.forward
    dec.batch.forward = lambda *a, **k: (forwards.__setitem__(0, forwards[0] + 1), call(*a, **k))[1]
    recorded = recording(dec.gate)
    got, widths, _ = run(dec, model)
    assert_alone(got, model)
    plain = [s for w, s in recorded if w == 0]
    assert any(widths) and len(plain) > 5
    assert min(plain) >= 1.0, plain


def test_a_draft_models_catch_up_is_not_priced_as_its_rounds_cost():
    """Rows join with draft runtimes holding nothing, so the first drafting step feeds each its
    prompt (`DraftModel.prepare`) before the round. That is a draft prefill, paid once: with a clock
    counting the positions the draft rows are fed, no drafting step the gate records costs more than
    its own round (up to K draft positions, and a lag short enough to ride along), while the
    catch-up itself fed the longest prompt's lag in one forward."""
    model = tiny("qwen3_5")
    fed = [0]
    dec = make_decoder(model, num_draft_tokens=K, draft_model=model,
                       gate=Gate(proportional, probe=2, clock=lambda: float(fed[0])))
    rows, widest = dec.drafter.rows, []
    for name in ("forward", "forward_padded"):
        call = getattr(rows, name)

        def counted(tokens, *a, _call=call, **k):
            n = tokens.shape[1] if isinstance(tokens, mx.array) else max(map(len, tokens))
            fed[0] += n
            widest.append(n)
            return _call(tokens, *a, **k)

        setattr(rows, name, counted)
    recorded = recording(dec.gate)
    got, _, _ = run(dec, model)
    assert_alone(got, model)
    rounds = [s for w, s in recorded if w > 0]
    assert rounds and max(widest) >= max(len(p) for p in PROMPTS)  # a catch-up ran (the prompts, 2 plain steps)
    assert max(rounds) <= K + GAP_IN_FORK, rounds
