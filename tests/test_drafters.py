"""The drafter and acceptor protocols on their own (the round loop is covered by test_generate*.py)."""

import mlx.core as mx
import pytest

from segcache.acceptors import ExactSpeculative, GreedyMatch, SamplerMatch, make_acceptor
from segcache.batch.decoder import BatchDecoder
from segcache.batch.drafting import Draft
from segcache.drafters import DraftModel, Lookup, make_decoder, make_drafter
from segcache.mtp import MTP, MTPHead
from segcache.sampling import Sampler
from segcache.testing import models


def test_make_acceptor_picks_the_rule_by_sampler():
    assert isinstance(make_acceptor(None), GreedyMatch)
    assert isinstance(make_acceptor(Sampler(0.7)), ExactSpeculative)
    assert isinstance(make_acceptor(lambda x: mx.argmax(x, axis=-1)), SamplerMatch)


def test_greedy_match_accepts_the_common_prefix_then_the_targets_token():
    logprobs = mx.log(mx.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.1, 0.1, 0.8]]) + 1e-9)
    rule = GreedyMatch()
    choices = rule.choices(logprobs)  # argmax: 1, 0, 2
    assert rule.accept(logprobs, [1, 0], None, choices) == (2, 2)
    assert rule.accept(logprobs, [1, 2], None, choices) == (1, 0)
    assert rule.accept(logprobs, [0, 0], None, choices) == (0, 1)


class _Row:
    def __init__(self, row_id):
        self.row_id = row_id


def test_lookup_drafter_follows_emitted_tokens():
    drafter = Lookup()
    drafter.add("a", [5, 6, 7, 8, 5, 6], None, None)
    drafter.add("b", [1, 2, 3], None, None)
    rows = [_Row("a"), _Row("b")]
    assert drafter.offer(rows, [2, 2]) == [2, 0]
    assert drafter.draft(rows, [2, 0]).tokens == [[7, 8], []]
    drafter.extend("a", [9])
    assert drafter.offer(rows, [2, 2]) == [0, 0]


def test_draft_verify_input_for_ids_and_lazy_chains():
    assert Draft([[3, 4], []], [2, 0]).verify_input([1, 2]) == [[1, 3, 4], [2]]
    lazy = Draft(mx.array([[3, 4], [5, 6]], dtype=mx.uint32), [2, 1])
    assert lazy.lazy and bool(lazy)
    assert lazy.verify_input([1, 2]).tolist() == [[1, 3, 4], [2, 5, 6]]
    assert lazy.proposals() == [[3, 4], [5, 6]]


def test_make_drafter_makes_what_was_asked_and_the_decoder_is_handed_it():
    model, draft = models.build("qwen3_next"), models.build("llama")
    head = MTPHead.build(model)
    assert make_drafter(model) is None
    assert isinstance(make_drafter(model, prompt_lookup=True), Lookup)
    by_draft = make_drafter(model, draft_model=draft, draft_min_prob=0.25, one_row=True)
    assert isinstance(by_draft, DraftModel) and by_draft.min_prob == 0.25 and by_draft.model is draft
    assert isinstance(make_drafter(model, mtp=head), MTP)
    with pytest.raises(ValueError, match="choose one drafter"):
        make_drafter(model, draft_model=draft, mtp=head)
    with pytest.raises(ValueError, match="another model"):
        make_drafter(draft, mtp=head)
    with pytest.raises(ValueError, match="probability"):
        make_drafter(model, draft_model=draft, draft_min_prob=2.0)
    # the decoder takes the drafter's mode and stop rule, and refuses a width without a drafter
    dec = BatchDecoder(model, drafter=by_draft, num_draft_tokens=3, one_row=True)
    assert dec.mode == "draft" and dec.policy.min_prob == 0.25
    assert make_decoder(model, num_draft_tokens=2).mode == "lookup"
    assert make_decoder(model).mode == "plain"
    with pytest.raises(ValueError, match="needs a drafter"):
        BatchDecoder(model, num_draft_tokens=3)
    with pytest.raises(ValueError, match="needs num_draft_tokens"):
        BatchDecoder(model, drafter=Lookup())
