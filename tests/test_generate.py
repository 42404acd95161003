import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import functools

import mlx.core as mx
import mlx_lm
import pytest

from segcache import Runtime
from segcache.errors import BranchError
from segcache.generation import generate, stream_generate
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer

PROMPT = "def add(a, b):\n    return a + b\n\ndef add("
MAX_TOKENS = 23  # not a multiple of any round width 2, 3, 5, 7


@functools.lru_cache(maxsize=None)
def model(family: str, seed: int = 0):
    return models.build(family, seed=seed)


@functools.lru_cache(maxsize=None)
def tok(eos: bool = False):
    return test_tokenizer.tokenizer(eos=eos)


def prompt_ids():
    return tok().encode(PROMPT)


@functools.lru_cache(maxsize=None)
def reference(family: str, prompt: tuple, max_tokens: int = MAX_TOKENS, eos_ids: tuple = ()):
    """mlx-lm's own greedy generation: the responses' (token, text, finish_reason)."""
    tk = test_tokenizer.tokenizer(eos=False, eos_token_ids=list(eos_ids))
    return [
        (r.token, r.text, r.finish_reason)
        for r in mlx_lm.stream_generate(model(family), tk, mx.array(prompt), max_tokens=max_tokens)
    ]


def ref_tokens(family, prompt, max_tokens=MAX_TOKENS):
    return [t for t, _, _ in reference(family, tuple(prompt), max_tokens)]


class Steered:
    """A draft model whose greedy drafts are chosen by the test.

    It runs the real draft model (so its runtime and layer caches do real
    work) but replaces the last position's logits by a one-hot on the token
    the target will choose there (`truth`), except at the draft index
    `schedule(round)` of a round, where it proposes a wrong token. So every
    round's acceptance is known in advance.
    """

    def __init__(self, inner, truth, schedule, unsure=lambda r: None):
        self.inner, self.truth, self.schedule, self.unsure = inner, list(truth), schedule, unsure
        self.rounds = []  # draft index that was corrupted per round (None = none)
        self.unsure_at = []  # draft index given a low probability per round (None = none)
        self._base, self._i = None, 0
        self.active = True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, inputs, cache=None, **kwargs):
        position = cache[0].offset + inputs.shape[1]  # the position whose token is predicted
        logits = self.inner(inputs, cache=cache, **kwargs)
        if self.active and cache[0].branch_offsets():
            base = cache[0].committed_offset
            if base != self._base:  # a new round's draft fork
                self._base, self._i = base, 0
                self.unsure_at.append(self.unsure(len(self.rounds)))
                self.rounds.append(self.schedule(len(self.rounds)))
            wrong = self._i == self.rounds[-1]
            # Unsure: still the same argmax, but a probability of about 1/25
            # over the 64-token test vocabulary instead of about 1.
            peak = 1.0 if self._i == self.unsure_at[-1] else 100.0
            self._i += 1
            tok = self.truth[position] if position < len(self.truth) else 0
            if wrong:
                tok = (tok + 1) % logits.shape[-1]
            row = mx.where(mx.arange(logits.shape[-1]) == tok, peak, 0.0).astype(logits.dtype)
            logits = mx.concatenate([logits[:, :-1], row[None, None]], axis=1)
        return logits


def pattern(k):
    """Per round: full acceptance, reject first, middle, last drafted position."""
    kinds = [None, 0, k // 2, k - 1]
    return lambda r: kinds[r % 4]


PAIRS = [
    ("llama", "llama"),  # dense + dense
    ("qwen3_5", "llama"),  # hybrid + dense
    ("llama", "qwen3_next"),  # dense + hybrid
    ("qwen3_next", "qwen3_5"),  # hybrid + hybrid
    ("gemma3_text", "qwen3_5"),  # sliding window + hybrid
]


@pytest.mark.parametrize("k", [1, 2, 4, 6])
@pytest.mark.parametrize("target_family,draft_family", PAIRS)
def test_draft_greedy_identical_with_every_rejection_position(target_family, draft_family, k):
    prompt = prompt_ids()
    expected = ref_tokens(target_family, prompt)
    draft = Steered(model(draft_family, 1), prompt + expected, pattern(k))
    rt, drt = Runtime(model(target_family)), Runtime(draft)
    out = list(stream_generate(model(target_family), tok(), prompt, draft_model=draft, num_draft_tokens=k,
                               max_tokens=MAX_TOKENS, runtime=rt, draft_runtime=drt, adaptive=False))
    assert [r.token for r in out] == expected
    assert [r.text for r in out] == [t for _, t, _ in reference(target_family, tuple(prompt))]
    stats = out[-1].stats
    # Every full-width round accepted exactly what the schedule made it accept.
    seen = set()
    for drafted, accepted, wrong in zip(stats.drafted_per_round, stats.accepted_per_round, draft.rounds):
        if drafted == k:
            assert accepted == (k if wrong is None else wrong)
            seen.add(accepted)
    assert seen == {0, k // 2, k - 1, k}, f"not every acceptance case happened: {seen}"
    assert stats.accepted == sum(r.from_draft for r in out)
    assert sum(stats.accepted_per_round) + stats.rounds >= MAX_TOKENS
    _assert_holds(rt, prompt + expected)
    draft.active = False
    _assert_draft_prefix(drt, rt)


def test_replay_strategy_runtimes():
    """The recurrent "replay" strategy (the Metal default) gives the same tokens and states."""
    prompt, k = prompt_ids(), 4
    expected = ref_tokens("qwen3_next", prompt)
    draft = Steered(model("qwen3_5", 1), prompt + expected, pattern(k))
    rt = Runtime(model("qwen3_next"), recurrent_strategy="replay")
    drt = Runtime(draft, recurrent_strategy="replay")
    out = list(stream_generate(rt.model, tok(), prompt, draft_model=draft, num_draft_tokens=k,
                               max_tokens=MAX_TOKENS, runtime=rt, draft_runtime=drt, adaptive=False))
    assert [r.token for r in out] == expected
    assert set(out[-1].stats.accepted_per_round[:4]) == {0, k // 2, k - 1, k}
    _assert_holds(rt, prompt + expected)
    draft.active = False
    _assert_draft_prefix(drt, rt)


def test_adaptive_width_follows_acceptance():
    prompt, k = prompt_ids(), 4
    expected = ref_tokens("qwen3_5", prompt, 40)
    # Rejected at the first position for 3 rounds, then always accepted: 4, 2, 1, 1, 2, 4, 4 ...
    draft = Steered(model("llama", 1), prompt + expected, lambda r: 0 if r < 3 else None)
    out = list(stream_generate(model("qwen3_5"), tok(), prompt, draft_model=draft, num_draft_tokens=k,
                               max_tokens=40, draft_min_prob=0.0))
    assert [r.token for r in out] == expected
    assert out[-1].stats.drafted_per_round[:7] == [4, 2, 1, 1, 2, 4, 4]
    assert out[-1].stats.accepted_per_round[:7] == [0, 0, 0, 1, 2, 4, 4]


@pytest.mark.parametrize("target_family,draft_family", [("qwen3_5", "llama"), ("llama", "qwen3_next")])
def test_draft_stops_after_the_first_unsure_draft(target_family, draft_family):
    """With the gate, a round drafts up to and including its first draft below
    draft_min_prob; that draft is still verified (here it is right, so accepted)."""
    prompt, k = prompt_ids(), 5
    expected = ref_tokens(target_family, prompt, 40)
    # Per round: unsure at draft index 0, 2, 4 (the last: no early stop), or nowhere.
    kinds = [0, 2, 4, None]
    draft = Steered(model(draft_family, 1), prompt + expected, lambda r: None, unsure=lambda r: kinds[r % 4])
    rt, drt = Runtime(model(target_family)), Runtime(draft)
    out = list(stream_generate(model(target_family), tok(), prompt, draft_model=draft, num_draft_tokens=k,
                               max_tokens=40, runtime=rt, draft_runtime=drt, draft_min_prob=0.2))
    assert [r.token for r in out] == expected
    stats = out[-1].stats
    rounds = list(zip(stats.drafted_per_round, stats.accepted_per_round, draft.unsure_at))
    full = [(d, a, u) for d, a, u in rounds if d == k or u is not None and d == u + 1]
    assert len(full) >= 4, rounds  # rounds not cut short by max_tokens
    for drafted, accepted, unsure in rounds[:-1]:  # the last round may be cut by max_tokens
        assert drafted == (k if unsure is None else unsure + 1)
        assert accepted == drafted  # the unsure draft was right, and verified
    _assert_holds(rt, prompt + expected)
    draft.active = False
    _assert_draft_prefix(drt, rt)
    # Without the gate every round drafts k, unsure or not.
    draft = Steered(model(draft_family, 1), prompt + expected, lambda r: None, unsure=lambda r: kinds[r % 4])
    out = list(stream_generate(model(target_family), tok(), prompt, draft_model=draft, num_draft_tokens=k,
                               max_tokens=40, draft_min_prob=0.0))
    assert [r.token for r in out] == expected
    assert set(out[-1].stats.drafted_per_round[:-1]) == {k}


@pytest.mark.parametrize("target_family", ["llama", "qwen3_5", "qwen3_next"])
def test_draft_sharing_target_weights_is_always_accepted(target_family):
    target = model(target_family)
    prompt = prompt_ids()
    out = list(stream_generate(target, tok(), prompt, draft_model=target, num_draft_tokens=4,
                               max_tokens=MAX_TOKENS))
    assert [r.token for r in out] == ref_tokens(target_family, prompt)
    stats = out[-1].stats
    assert stats.acceptance_rate == 1.0 and stats.drafted == stats.accepted > 0


@pytest.mark.parametrize("target_family,draft_family", [("qwen3_5", "llama"), ("llama", "qwen3_5")])
def test_unrelated_random_draft_identical(target_family, draft_family):
    prompt = prompt_ids()
    for k in (3, 5):
        out = list(stream_generate(model(target_family), tok(), prompt, draft_model=model(draft_family, 7),
                                   num_draft_tokens=k, max_tokens=MAX_TOKENS))
        assert [r.token for r in out] == ref_tokens(target_family, prompt)


@pytest.mark.parametrize("family", models.FAMILIES)
def test_plain_generation_identical(family):
    prompt = prompt_ids()
    rt = Runtime(model(family))
    out = list(stream_generate(model(family), tok(), prompt, max_tokens=MAX_TOKENS, runtime=rt))
    assert [(r.token, r.text, r.finish_reason) for r in out] == reference(family, tuple(prompt))
    assert out[-1].stats.mode == "plain" and out[-1].stats.drafted == 0
    _assert_holds(rt, prompt + [r.token for r in out])


@pytest.mark.parametrize("k", [1, 2, 4, 6])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "llama"])
def test_prompt_lookup_greedy_identical(family, k):
    # A prompt that repeats itself and the greedy output appended to it: the
    # lookup drafts are then often right, so rounds both accept and reject.
    base = prompt_ids()
    continuation = ref_tokens(family, base, 12)
    prompt = base + continuation + base[-6:]
    expected = ref_tokens(family, prompt)
    rt = Runtime(model(family))
    out = list(stream_generate(model(family), tok(), prompt, prompt_lookup=True, num_draft_tokens=k,
                               max_tokens=MAX_TOKENS, runtime=rt))
    assert [r.token for r in out] == expected
    stats = out[-1].stats
    assert stats.mode == "lookup" and stats.drafted > 0 and stats.accepted > 0
    assert any(a < d for d, a in zip(stats.drafted_per_round, stats.accepted_per_round)), "no rejection"
    _assert_holds(rt, prompt + expected)


def test_eos_stops_exactly_like_mlx_lm():
    family = "qwen3_5"
    prompt = prompt_ids()
    free = ref_tokens(family, prompt, 30)
    stop = free[9]  # a token greedy emits at position 9 (or earlier): the EOS for this test
    expected = reference(family, tuple(prompt), 30, (stop,))
    assert expected[-1][2] == "stop" and len(expected) <= 10
    tk = test_tokenizer.tokenizer(eos=False, eos_token_ids=[stop])
    target = model(family)
    for kwargs in ({}, {"prompt_lookup": True}, {"draft_model": target}, {"draft_model": model("llama", 3)}):
        for k in (2, 5):
            rt = Runtime(target)
            out = list(stream_generate(target, tk, prompt, num_draft_tokens=k, max_tokens=30, runtime=rt, **kwargs))
            assert [(r.token, r.text, r.finish_reason) for r in out] == expected
            _assert_holds(rt, prompt + [r.token for r in out])  # the EOS is fed, as mlx-lm's cache


def test_continuing_a_runtime_equals_one_generation():
    family = "qwen3_next"
    target = model(family)
    p = prompt_ids()
    q = tok().encode("\n# next\n")
    for kwargs in ({}, {"prompt_lookup": True}, {"draft_model": model("llama", 2)}, {"draft_model": target}):
        rt = Runtime(target)
        drt = Runtime(kwargs["draft_model"]) if "draft_model" in kwargs else None
        a = [r.token for r in stream_generate(target, tok(), p, max_tokens=9, runtime=rt, draft_runtime=drt,
                                              num_draft_tokens=3, **kwargs)]
        assert a == ref_tokens(family, p, 9)
        b = [r.token for r in stream_generate(target, tok(), q, max_tokens=11, runtime=rt, draft_runtime=drt,
                                              num_draft_tokens=3, **kwargs)]
        assert b == ref_tokens(family, p + a + q, 11)
        _assert_holds(rt, p + a + q + b)
        if drt is not None:
            _assert_draft_prefix(drt, rt)


def test_stats_and_verbose_generate(capsys):
    target = model("qwen3_5")
    text = generate(target, tok(), PROMPT, draft_model=target, num_draft_tokens=3, max_tokens=10, verbose=True)
    printed = capsys.readouterr().out
    assert text and text in printed
    for needle in ("Prompt:", "Generation: 10 tokens", "accepted", "draft", "verify", "commit"):
        assert needle in printed
    out = list(stream_generate(target, tok(), PROMPT, draft_model=target, num_draft_tokens=3, max_tokens=10))
    s = out[-1].stats
    assert s.generation_tokens == 10 == out[-1].generation_tokens
    assert s.drafted == sum(s.drafted_per_round) and s.accepted == sum(s.accepted_per_round)
    assert s.rounds == len(s.drafted_per_round) and s.mean_accepted == s.accepted / s.rounds
    assert s.prompt_tps > 0 and s.generation_tps > 0 and s.draft_time > 0 and s.verify_time > 0
    assert all(r.stats is s for r in out)


def test_argument_errors():
    target = model("llama")
    with pytest.raises(ValueError, match="draft_model or prompt_lookup"):
        stream_generate(target, tok(), PROMPT, draft_model=target, prompt_lookup=True)
    with pytest.raises(ValueError, match="max_tokens"):
        stream_generate(target, tok(), PROMPT, max_tokens=0)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="draft_min_prob"):
            stream_generate(target, tok(), PROMPT, draft_model=target, draft_min_prob=bad)
    with pytest.raises(ValueError, match="empty"):
        stream_generate(target, tok(), [])
    with pytest.raises(ValueError, match="model"):
        stream_generate(target, tok(), PROMPT, runtime=Runtime(model("qwen3")))
    rt = Runtime(target)
    rt.forward([1, 2])
    rt.fork()
    with pytest.raises(BranchError, match="open branch"):
        stream_generate(target, tok(), PROMPT, runtime=rt)
    rt.rollback()
    with pytest.raises(ValueError, match="of its own"):
        stream_generate(target, tok(), [5], runtime=rt, draft_model=target, draft_runtime=rt)
    other = Runtime(target)
    other.forward([3])
    with pytest.raises(ValueError, match="prefix"):
        stream_generate(target, tok(), [5], runtime=rt, draft_model=target, draft_runtime=other)
    assert rt.tokens == [1, 2] and rt.depth == 0


def test_mlx_lm_sampler_and_temperature_sampler_run():
    from mlx_lm.sample_utils import make_sampler

    from segcache.sampling import Sampler

    target, prompt = model("qwen3_5"), prompt_ids()
    greedy = make_sampler(0.0)  # an opaque mlx-lm sampler: the match rule
    out = [r.token for r in stream_generate(target, tok(), prompt, draft_model=model("llama", 1),
                                            max_tokens=MAX_TOKENS, sampler=greedy)]
    assert out == ref_tokens("qwen3_5", prompt)
    mx.random.seed(3)
    for kwargs in ({"draft_model": model("llama", 1)}, {"prompt_lookup": True}, {}):
        for sampler in (Sampler(1.0, top_k=8), make_sampler(0.8, top_p=0.9)):
            rt = Runtime(target)
            out = [r.token for r in stream_generate(target, tok(), prompt, max_tokens=15, sampler=sampler,
                                                    runtime=rt, **kwargs)]
            assert len(out) == 15
            _assert_holds(rt, prompt + out)


# -- helpers ---------------------------------------------------------------------


def _assert_holds(rt: Runtime, tokens: list):
    """rt holds exactly `tokens`, all fed, no branch, and its state is theirs."""
    assert rt.depth == 0
    assert rt.tokens == tokens
    assert rt.offset == len(tokens)
    rt.check()
    fresh = Runtime(rt.model)
    fresh.forward(tokens)
    probe = [7]
    with rt.fork():
        a = rt.forward(probe)[0, -1]
        b = fresh.forward(probe)[0, -1]
        assert mx.allclose(a, b, atol=1e-4).item() and mx.argmax(a).item() == mx.argmax(b).item()
    assert rt.depth == 0 and rt.tokens == tokens


def _assert_draft_prefix(drt: Runtime, rt: Runtime):
    """The draft holds a prefix of what the target holds (at most the last round behind), consistently."""
    assert drt.depth == 0
    held = drt.tokens
    assert held == rt.tokens[: len(held)] and len(held) >= rt.offset - 3
    drt.check()
    fresh = Runtime(getattr(drt.model, "inner", drt.model))
    fresh.forward(held)
    with drt.fork():
        a = drt.forward([7])[0, -1]
        b = fresh.forward([7])[0, -1]
        assert mx.allclose(a, b, atol=1e-4).item()


def test_segcache_generate_stays_the_function_after_the_module_is_imported():
    """The module is segcache.generation, so importing it never rebinds segcache.generate."""
    import importlib

    import segcache

    importlib.import_module("segcache.generation")
    assert callable(segcache.generate) and segcache.generate.__name__ == "generate"
