"""The MTP head's state handed back at a row's release (MTP.hand_back): the released runtime
carries a live head segment, bitwise what the head on mlx-lm's KVCache builds from the target's
hidden states (a forward on mlx-lm's own cache in the same blocks) fed in the same head calls;
its publish stores the head's records at the answer's end, so a chat's next turn (on the same
runtime, or resumed from the store) runs no head forward over the previous turn's tokens."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from segcache import Runtime, open_store
from segcache.drafters import make_decoder
from segcache.generation import stream_generate
from segcache.mtp import MTPHead, forward_with_hidden
from segcache.session.session import Session
from segcache.testing import tokenizer as test_tokenizer
from test_mtp_state import held, reference, same
from test_mtp_store import PROMPT, STEP, Calls, P, blocks, serve_once, target  # noqa: F401

NEXT = [(t * 7 + 1) % 60 + 2 for t in range(11)]
OTHER = [(t * 3 + 4) % 60 + 2 for t in range(11)]  # another next turn


class HeadCalls:
    """Records the positions of every MTP head call (MTPHead.__call__)."""

    def __enter__(self):
        self.sizes, orig = [], MTPHead.__call__
        self.orig = orig

        def recorded(head, hidden, tokens, cache=None, depth=0):
            self.sizes.append((hidden.shape[1], depth))
            return orig(head, hidden, tokens, cache, depth)

        MTPHead.__call__ = recorded
        return self

    def __exit__(self, *exc):
        MTPHead.__call__ = self.orig


def test_a_released_row_hands_its_head_state_back_bitwise(target):
    model, head = target
    dec = make_decoder(model, num_draft_tokens=2, mtp=head, one_row=True, gate=True)  # 4 plain steps
    rt = Runtime(model)
    calls, heads = Calls(model), HeadCalls()
    with calls, heads:
        session = Session(dec, rt, list(PROMPT), prefill_step=STEP, keep=True)
        session.begin()
        for _ in session.feed(STEP):
            pass
        session.join(0, session.ready(), max_tokens=4)
        out = [t for _ in range(4) for t, _, _ in session.step(0)]
        assert session.leave(0) is rt
    assert rt.tokens == PROMPT + out and all(d == 0 for _, d in heads.sizes)
    seg = rt.drafters.get("mtp")
    assert seg is not None and not seg.stale and seg.offset == len(rt.tokens)
    rt.check()
    # the reference: the target on mlx-lm's cache forwarded in the run's blocks, the head on
    # mlx-lm's KVCache fed the pairs (hidden[p], token[p + 1]) in the run's head calls
    ids = rt.tokens
    cache, hidden, at = make_prompt_cache(model), [], 0
    for n in calls.fed:
        hidden.append(forward_with_hidden(model, mx.array(ids[at : at + n], dtype=mx.uint32)[None], cache)[1])
        at += n
    assert at == len(ids)
    hidden = mx.concatenate(hidden, axis=1)
    hcache, p = head.make_cache(), 0
    for n, _ in heads.sizes:
        head(hidden[:, p : p + n], mx.array(ids[p + 1 : p + 1 + n], dtype=mx.uint32)[None], hcache)
        p += n
    assert p == len(ids) - 1
    k, v = hcache[0].keys[..., :p, :], hcache[0].values[..., :p, :]
    for x, y in zip(held(rt), (k, v, hidden[:, -1:])):
        same(x, y)


@pytest.mark.parametrize("gate", (False, True))
def test_a_chats_next_turn_runs_no_head_over_the_previous_turn(target, tmp_path, gate):
    model, head = target
    tk = test_tokenizer.tokenizer(eos=False)
    first = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=5)]
    want = {nxt[0]: [r.token for r in stream_generate(model, tk, PROMPT + first + nxt, max_tokens=5)]
            for nxt in (NEXT, OTHER)}
    calls = Calls(model)
    dec = make_decoder(model, num_draft_tokens=2, mtp=head, one_row=True, gate=gate)

    def turn(rt, prompt):
        calls.n = 0
        session = Session(dec, rt, rt.tokens + prompt, prefill_step=STEP, keep=True)
        session.begin()
        for _ in session.feed(STEP):
            pass
        session.join(0, session.ready(), max_tokens=5)
        toks = []
        while len(toks) < 5:
            toks += [t for t, _, _ in session.step(0)]
        session.leave(0)
        rt.check()
        return toks, calls.fed[len(calls.fed) - calls.n:]

    with open_store(tmp_path / "s", page_tokens=P) as st, calls:
        rt = Runtime(model, store=st)
        assert turn(rt, PROMPT)[0] == first
        assert rt.drafters.get("mtp").offset == len(PROMPT + first)  # handed back, all fed
        got, fed = turn(rt, NEXT)
        assert got == want[NEXT[0]]
        # its forwards: its own prompt's blocks and one-token steps; no forward of the previous turn
        assert fed[: len(blocks(NEXT[:-1]))] == [len(b) for b in blocks(NEXT[:-1])]
        assert set(fed[len(blocks(NEXT[:-1])):]) <= {1, 2, 3}
        ends = sorted(e.tokens for e in st.entries() if e.kind == "dckpt")
        assert len(PROMPT + first) in ends  # the answer's end carries the head's records
    # another process resumes the first turn's end from the store, the head with it
    with open_store(tmp_path / "s", page_tokens=P, ram_bytes=0) as st, calls:
        rt = Runtime(model, store=st)
        got, fed = turn(rt, PROMPT + first + OTHER)
        assert got == want[OTHER[0]]
        assert fed[: len(blocks(OTHER[:-1]))] == [len(b) for b in blocks(OTHER[:-1])]
        assert set(fed[len(blocks(OTHER[:-1])):]) <= {1, 2, 3}


def test_a_batched_row_hands_its_head_state_back(target, tmp_path):
    """The engine's rows (a BatchDecoder): the answer's end is stored with the head's records, which
    resume as what the head on mlx-lm's KVCache builds over the same tokens (within the batches'
    tolerance: the target's batched forwards round differently)."""
    model, head = target
    tk = test_tokenizer.tokenizer(eos=False)
    first = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=6)]
    with open_store(tmp_path / "s", page_tokens=P) as st:
        serve_once(model, head, tk, st, PROMPT, 6)
        rt = Runtime(model, store=st, mtp=head)
        resume = next(rt.prefill_steps(PROMPT + first + NEXT[:1], step_size=STEP))
        assert resume.restored == len(PROMPT + first) and not rt.drafters.get("mtp").stale
        rt.check()
    for x, y in zip(held(rt), reference(model, head, blocks(PROMPT + first))):
        assert x.shape == y.shape and mx.allclose(x, y, atol=1e-4, rtol=1e-4).item()
