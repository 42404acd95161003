"""A DFlash drafter's context segment in the prefix store (store/drafter_records.py, keyed with
the drafter's identity): saved with the prompt and resumed with it bitwise equal to a cold
prefill's, so a prompt resumed from the store drafts its first block with no forward of its
prefix; another drafter's records are other keys (the target resumes, the context is recomputed).
DFlash and DFlash2 drafters alike (their context segments are one kind)."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import mlx.core as mx
import pytest

from segcache import Runtime, open_store
from segcache.dflash.drafter import DFlash
from segcache.generation import stream_generate
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from segcache.testing.dflash import random_drafter
from test_mtp_store import Calls

P, STEP = 16, 8
PROMPT = [(t * 5 + 3) % 60 + 2 for t in range(45)]


@pytest.fixture(scope="module", params=("dflash", "dflash2"))
def target(tmp_path_factory, request):
    model = models.build("qwen3_5")
    return model, random_drafter(model, tmp_path_factory.mktemp("d"), seed=5, layers=2,
                                 dflash2=request.param == "dflash2")


def _state(rt):
    seg = rt.drafters.get("dflash")
    return seg.held, seg.kv.keys[..., : seg.held, :], seg.kv.values[..., : seg.held, :], seg.tail


def _first_draft_calls(monkeypatch, calls) -> list:
    seen = []
    draft = DFlash.draft

    def first(self, states, widths):
        if not seen:
            seen.append(calls.n)
        return draft(self, states, widths)

    monkeypatch.setattr(DFlash, "draft", first)
    return seen


def test_a_resumed_prompt_drafts_its_first_block_with_no_forward(target, tmp_path, monkeypatch):
    model, drafter = target
    L = len(PROMPT) - 1
    tk = test_tokenizer.tokenizer(eos=False)
    plain = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6)]
    with open_store(tmp_path / "s", page_tokens=P) as st:
        cold = Runtime(model, store=st, dflash=drafter)
        cold.prefill(PROMPT[:L], step_size=STEP)
        want = _state(cold)
        kinds = sorted(e.kind for e in st.entries())
        assert kinds.count("dpage") == (L - 1) // P and kinds.count("dckpt") == 1
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st:  # another process: from disk
        rt = Runtime(model, store=st, dflash=drafter)
        with Calls(model) as calls:
            resume = next(rt.prefill_steps(PROMPT[:L], step_size=STEP))
        assert resume.restored == L and calls.n == 0
        got = _state(rt)
        assert got[0] == want[0] == L - 1
        for x, y in zip(got[1:], want[1:]):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item()
        rt.check()
    calls = Calls(model)
    seen = _first_draft_calls(monkeypatch, calls)
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:
        out = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6, dflash=drafter,
                                                runtime=Runtime(model, store=st), prefill_step_size=STEP)]
    assert out == plain and seen == [0]  # the context came from the store with the target's layers

    other = random_drafter(model, tmp_path / "other", seed=6, layers=2)
    seen.clear()
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:
        calls.n = 0
        out = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6, dflash=other,
                                                runtime=Runtime(model, store=st), prefill_step_size=STEP)]
    # the target resumed; the other drafter's context recomputed: the prefix forwarded once more in blocks
    assert out == plain and seen == [-(-(len(PROMPT) - 1) // STEP)]
