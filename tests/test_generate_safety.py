import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import pytest

from segcache import Runtime
from segcache.generation import stream_generate
from test_generate import Steered, _assert_draft_prefix, _assert_holds, model, pattern, prompt_ids, ref_tokens, tok


class Boom(RuntimeError):
    pass


class Flaky:
    """A model that raises on its `fail_at`-th call (1-based), before or after computing."""

    def __init__(self, inner, fail_at=None, after=False):
        self.inner, self.fail_at, self.after = inner, fail_at, after
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, inputs, cache=None, **kwargs):
        self.calls += 1
        boom = self.calls == self.fail_at
        if boom and not self.after:
            raise Boom(f"call {self.calls}")
        out = self.inner(inputs, cache=cache, **kwargs)
        if boom:
            out.shape  # the layer caches were already updated by this call
            raise Boom(f"call {self.calls}")
        return out


Q = tok().encode("\nx = 1\n")


def _check_consistent_and_reusable(target_family, rt, drt, emitted, prompt):
    """No open branch, state = the committed tokens, and generation continues exactly."""
    held = rt.tokens
    history = prompt + emitted
    # Every emitted token is fed except, after an error, possibly the last one.
    assert held == history[: len(held)] and len(held) >= len(history) - 1
    _assert_holds(rt, held)
    if drt is not None:
        _assert_draft_prefix(drt, rt)
    kwargs = {"draft_runtime": drt, "num_draft_tokens": 3} if drt is not None else {}
    more = [r.token for r in stream_generate(rt.model, tok(), Q, max_tokens=7, runtime=rt, **kwargs)]
    assert more == ref_tokens(target_family, held + Q, 7)
    _assert_holds(rt, held + Q + more)


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("fail_at", [2, 5, 9])
@pytest.mark.parametrize("target_family,draft_family", [("qwen3_5", "llama"), ("qwen3_next", "qwen3_5")])
def test_exception_in_draft_forward(target_family, draft_family, fail_at, after):
    prompt = prompt_ids()
    draft = Flaky(model(draft_family, 1), fail_at, after)
    rt, drt = Runtime(model(target_family)), Runtime(draft)
    emitted = []
    with pytest.raises(Boom):
        for r in stream_generate(rt.model, tok(), prompt, draft_model=draft, num_draft_tokens=3,
                                 max_tokens=40, runtime=rt, draft_runtime=drt):
            emitted.append(r.token)
    assert draft.calls == fail_at
    assert emitted == ref_tokens(target_family, prompt)[: len(emitted)]
    draft.fail_at = None
    _check_consistent_and_reusable(target_family, rt, drt, emitted, prompt)


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("fail_at", [2, 4])
@pytest.mark.parametrize("drafter", ["draft", "lookup"])
@pytest.mark.parametrize("target_family", ["qwen3_5", "llama"])
def test_exception_in_verify_forward(target_family, drafter, fail_at, after):
    prompt = prompt_ids()
    target = Flaky(model(target_family), fail_at, after)
    rt = Runtime(target)
    drt = Runtime(model("qwen3_next", 1)) if drafter == "draft" else None
    kwargs = {"draft_runtime": drt} if drt else {"prompt_lookup": True}
    emitted = []
    with pytest.raises(Boom):
        for r in stream_generate(target, tok(), prompt, num_draft_tokens=3, max_tokens=40, runtime=rt, **kwargs):
            emitted.append(r.token)
    assert target.calls == fail_at  # call 1 is the prefill, then one verify per round
    assert emitted == ref_tokens(target_family, prompt)[: len(emitted)]
    target.fail_at = None
    _check_consistent_and_reusable(target_family, rt, drt, emitted, prompt)


@pytest.mark.parametrize("target_family,draft_family", [("qwen3_5", "llama"), ("qwen3_next", "qwen3_5")])
def test_close_at_every_yield(target_family, draft_family):
    """Closing at a drafted token's yield (branches open) or at a target token's yield."""
    prompt = prompt_ids()
    expected = ref_tokens(target_family, prompt)
    kinds = set()
    for stop_after in range(1, 12):
        draft = Steered(model(draft_family, 1), prompt + expected, pattern(4))
        rt, drt = Runtime(model(target_family)), Runtime(draft)
        gen = stream_generate(rt.model, tok(), prompt, draft_model=draft, num_draft_tokens=4,
                              max_tokens=40, runtime=rt, draft_runtime=drt)
        received = []
        for r in gen:
            received.append(r)
            if len(received) == stop_after:
                break
        kinds.add(received[-1].from_draft)
        if received[-1].from_draft:
            assert rt.depth == 1 and drt.depth == 1  # suspended inside the round
        gen.close()
        tokens = [r.token for r in received]
        assert tokens == expected[:stop_after]
        assert rt.tokens == prompt + tokens  # exactly what the caller received, all fed
        draft.active = False
        _check_consistent_and_reusable(target_family, rt, drt, tokens, prompt)
    assert kinds == {True, False}


def test_close_prompt_lookup_and_plain():
    prompt = prompt_ids()
    family = "qwen3_5"
    base = ref_tokens(family, prompt, 12)
    prompt = prompt + base + prompt[-6:]  # repetitive: lookup drafts get accepted
    for kwargs in ({"prompt_lookup": True}, {}):
        for stop_after in (1, 3, 6):
            rt = Runtime(model(family))
            gen = stream_generate(rt.model, tok(), prompt, max_tokens=40, runtime=rt, **kwargs)
            received = [next(gen) for _ in range(stop_after)]
            gen.close()
            tokens = [r.token for r in received]
            assert rt.tokens == prompt + tokens
            _check_consistent_and_reusable(family, rt, None, tokens, prompt)


def test_unstarted_generator_touches_nothing():
    rt = Runtime(model("qwen3_5"))
    gen = stream_generate(rt.model, tok(), prompt_ids(), prompt_lookup=True, runtime=rt)
    gen.close()
    assert rt.offset == 0 and rt.depth == 0
