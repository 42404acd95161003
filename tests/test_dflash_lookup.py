"""Prompt lookup and a DFlash drafter both on (dflash/with_lookup.py): per row and round the
proposal it expects more of. Greedy tokens equal mlx-lm's (one row, batched with late joins,
gated or not); both kinds are chosen where a prompt makes lookup match; sampling stays exact
(a lookup proposal is verified as the point mass it is)."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import mlx.core as mx
import pytest

from segcache.dflash import load_dflash
from segcache.dflash.with_lookup import WithLookup, agreed
from segcache.drafters import make_decoder, make_drafter
from segcache.generation import stream_generate
from segcache.lookup import PromptLookup
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from segcache.testing.dflash import write_checkpoint
from test_dflash import PROMPT, _blind, _run_batched, _shipped, assert_exact, sampled_first_tokens
from test_mtp_decode import reference

REPEATS = [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4, 5]  # its suffix matches earlier: lookup proposes


class Rounds:
    """Each round's kinds per row (True: lookup's proposal), read from the drafter's open round."""

    def __init__(self, drafter: WithLookup):
        self.rounds = []
        draft = drafter.draft

        def spy(states, widths):
            out = draft(states, widths)
            self.rounds.append([drafter._round[s.row_id][0] for s, w in zip(states, widths) if w])
            return out

        drafter.draft = spy

    @property
    def mixed(self) -> int:
        return sum(len(set(r)) == 2 for r in self.rounds)


@pytest.mark.parametrize("target", ("qwen3_5", "llama", "shipped"))
def test_greedy_with_both_on_equals_plain_one_row_and_batched_with_late_joins(target, tmp_path):
    if target == "shipped":
        model, prompts = _shipped()
        prompts.append(prompts[0][:40] + prompts[0][:40])  # a prompt repeating itself: lookup matches
    else:
        model = models.build(target)
        prompts = [PROMPT, PROMPT[:5], REPEATS, [9, 2, 9, 2, 9]]
    n = 14
    want = {i: reference(model, p, n) for i, p in enumerate(prompts)}
    drafter = _blind(model, tmp_path, [t for w in want.values() for t in w])
    tk = test_tokenizer.tokenizer(eos=False)
    for i in (0, len(prompts) - 2):
        one = list(stream_generate(model, tk, prompts[i], max_tokens=n, dflash=drafter, prompt_lookup=True))
        assert [r.token for r in one] == want[i]
    chosen = {"lookup": 0, "dflash": 0}
    mixed = 0
    for gate in (False, True):
        dec = make_decoder(model, dflash=drafter, prompt_lookup=True, gate=gate, adaptive=False)
        assert dec.mode == "lookup+dflash"
        rounds = Rounds(dec.drafter)
        assert _run_batched(dec, model, prompts, late=(1, 2), n=n) == want, gate
        for kind, count in dec.drafter.chosen.items():
            chosen[kind] += count
        mixed += rounds.mixed
    assert chosen["lookup"] > 0 and chosen["dflash"] > 0, chosen  # both kinds were verified
    assert mixed > 0  # rounds where some rows verified lookup's match and others the block


def test_both_kinds_are_chosen_and_the_estimates_follow_what_the_target_kept(tmp_path):
    """A row whose history repeats takes lookup's match while lookup agrees with the target; a row
    with nothing to match takes the block. Each estimate moves by its own proposal's agreement."""
    model = models.build("qwen3_5")
    want = {i: reference(model, p, 16) for i, p in enumerate([REPEATS, PROMPT[:6]])}
    drafter = _blind(model, tmp_path, [t for w in want.values() for t in w])
    dec = make_decoder(model, dflash=drafter, prompt_lookup=True, gate=False, adaptive=False)
    rounds = Rounds(dec.drafter)
    assert _run_batched(dec, model, [REPEATS, PROMPT[:6]], late=(), n=16) == want
    first = rounds.rounds[0]
    assert first[0] is True  # a 3-gram match on the first round, at equal estimates: lookup
    assert first[1] is False  # no earlier occurrence of its suffix: the block
    assert dec.drafter.chosen["lookup"] > 0 and dec.drafter.chosen["dflash"] > 0


def test_agreement_is_a_censored_count():
    assert agreed([1, 2, 3], [1, 2, 4]) == 2
    assert agreed([1, 2], [1, 2, 3, 4]) == 2  # agrees as far as known
    assert agreed([], [5]) == 0
    lookup = PromptLookup()
    lookup.extend([1, 2, 3, 9, 1, 2, 3])
    assert lookup.match(2) == (3, [9, 1]) and lookup.draft(2) == [9, 1]
    lookup.extend([7])
    assert lookup.match(3) == (0, [])




def test_sampling_with_a_lookup_match_is_exact(tmp_path):
    """A row whose suffix matched (its first round takes lookup's proposal d): the first token is
    distributed as the target's p, and d is accepted with probability p(d), as a point mass is;
    verifying it against the block's q would accept it with min(1, p(d) / q(d))."""
    model = models.build("qwen3_5")
    base = [5, 17, 33, 2, 40, 11, 9]
    # [9, d] + base: its last token occurred first, followed by d: lookup proposes d (the d the target
    # gives the most probability after such a prompt, so its acceptance is far from 0 and from 1)
    heads = mx.array([[9, d] + base for d in range(models.VOCAB)])
    likely = mx.softmax(model(heads)[:, -1], -1)[mx.arange(models.VOCAB), mx.arange(models.VOCAB)]
    d = int(mx.argmax(likely).item())
    prompt = [9, d] + base
    p = mx.softmax(model(mx.array(prompt)[None])[0, -1]).tolist()
    path = write_checkpoint(model, tmp_path / "q", seed=4, blind=True, block_size=3)
    drafter = load_dflash(path, model)
    counts, from_draft = sampled_first_tokens(model, drafter, prompt, seed=6, prompt_lookup=True)
    accept = p[d]
    assert 0.05 < accept < 0.95
    assert_exact(counts, from_draft, p, accept, slack=1)


def test_prompt_lookup_goes_beside_dflash_only(tmp_path):
    model = models.build("qwen3_5")
    draft = models.build("llama")
    drafter = load_dflash(write_checkpoint(model, tmp_path / "d", seed=1, block_size=4), model)
    assert isinstance(make_drafter(model, dflash=drafter, prompt_lookup=True), WithLookup)
    with pytest.raises(ValueError, match="beside a DFlash drafter only"):
        make_drafter(model, draft_model=draft, prompt_lookup=True)
    with pytest.raises(ValueError, match="beside a DFlash drafter only"):
        make_decoder(model, draft_model=draft, prompt_lookup=True, num_draft_tokens=2)
    dec = make_decoder(model, dflash=drafter, prompt_lookup=True)
    assert dec.width == 3  # the drafter's block: 4 positions, 3 drafts
