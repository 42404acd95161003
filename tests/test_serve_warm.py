"""Hot conversation runtimes (serve/hot.py): a next turn continues from its conversation's live
runtime copy-on-write, and what it gives is what a cold resume from the store and a prefill from
scratch give; domains never share one; a failed or cancelled turn leaves it as it was; the store's
RAM pages share its buffers. In-process on the shipped target, then a real server driven by the
official `openai` and `anthropic` clients."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import re

import anthropic
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from segcache import Runtime, open_store
from segcache.controls import Controls
from segcache.sampling import Sampler
from segcache.serve.engine import Chunk, Engine, Failure, GenRequest
from segcache.serve.hot import HotRuntimes, runtime_nbytes
from segcache.serve.worker import Job, Scheduler
from segcache.store.prompt_index import PromptKeys
from serve_util import TARGET, Server

TEXT = open(TARGET.parent / "heldout_stdlib.txt").read()


@pytest.fixture(scope="module")
def loaded():
    return mlx_lm.load(str(TARGET))


class Turns:
    """One engine kept across requests: run a request, get its text, logprobs and usage."""

    def __init__(self, loaded, concurrency=4, **kwargs):
        model, tok = loaded
        self.engine = Engine(model, tok, decode_concurrency=concurrency, **kwargs)
        self.sched = Scheduler(self.engine, max_queue=8, max_running=concurrency, begin_step=self.engine.begin_step)

    def run(self, req):
        events = []
        self.sched.submit(Job(req, events.append))
        for _ in range(5000):
            if not self.sched.step():
                break
        assert not self.sched.pending() and len(self.engine.decoder) == 0
        chunks = [e for e in events if isinstance(e, Chunk)]
        return "".join(c.text for c in chunks), [lp.logprob for c in chunks for lp in c.logprobs], events[-1]


def conversation(loaded, turns=3, tokens=12):
    """Prompts of a conversation: each one the previous prompt + its greedy reply (as the hot runtime
    holds it, EOS included) + new text. Returns the prompts and a hot engine's (text, logprobs, last event)."""
    tok = loaded[1]
    hot = HotRuntimes(4, 64 << 20)
    t = Turns(loaded, hot=hot)
    prompts, got = [tok.encode(TEXT[:1500])], []
    for k in range(turns):
        got.append(t.run(GenRequest(f"t{k}", prompts[-1], tokens, top_logprobs=0)))
        assert hot.count == 1  # the turn superseded the one it extended
        held = next(iter(hot._entries.values())).tokens
        prompts.append(held + tok.encode(TEXT[3000 + 400 * k : 3000 + 400 * k + 300]))
    hot.check()
    return prompts[:turns], got, hot


def test_a_hot_turn_gives_what_a_cold_resume_and_a_prefill_from_scratch_give(loaded, tmp_path):
    prompts, hot_got, hot = conversation(loaded)
    assert hot.hits == 2 and hot.misses == 0
    with open_store(tmp_path / "s") as store:
        cold = Turns(loaded, store=store)  # no hot runtimes: every turn resumes from the store
        cold_got = [cold.run(GenRequest(f"c{k}", p, 12, top_logprobs=0)) for k, p in enumerate(prompts)]
        assert [g[2].usage.tier for g in cold_got[1:]] == ["ram", "ram"]
    scratch = Turns(loaded)  # no store, no hot runtime: every turn computed whole
    scratch_got = [scratch.run(GenRequest(f"x{k}", p, 12, top_logprobs=0)) for k, p in enumerate(prompts)]
    for k in range(len(prompts)):
        assert hot_got[k][0] == cold_got[k][0] == scratch_got[k][0], k  # the same greedy tokens
        np.testing.assert_allclose(hot_got[k][1], scratch_got[k][1], atol=1e-4)
        np.testing.assert_allclose(hot_got[k][1], cold_got[k][1], atol=1e-4)
    usage = [g[2].usage for g in hot_got]
    assert usage[0].tier == "-" and [u.tier for u in usage[1:]] == ["hot", "hot"]
    # cached: every token of the previous turn's runtime, the new text computed
    assert [u.cached_tokens for u in usage[1:]] == [len(prompts[0]) + usage[0].completion_tokens,
                                                  len(prompts[1]) + usage[1].completion_tokens]


def _held(rt):
    """The runtime's tokens and every array of its layers, copied to numpy."""
    arrays = [np.array(a) for layer in rt.cache for a in _arrays(layer.state)]
    return rt.committed_tokens, arrays


def _arrays(x):
    if isinstance(x, mx.array):
        return [x]
    return [a for y in x for a in _arrays(y)] if isinstance(x, (tuple, list)) else []


def test_a_clone_continues_bit_exactly_and_never_writes_into_the_hot_runtime(loaded):
    model, tok = loaded
    ids = tok.encode(TEXT[:1200])
    a, b, c = ids[:150], ids[150:160], ids[160:190]
    rt = Runtime(model, gdn_prefill="native")
    mx.eval(rt.forward(a), rt.forward(b))
    hot = HotRuntimes(2, 64 << 20, share=False)
    assert hot.keep(rt, None)
    before = _held(rt)
    clone = hot.take(a + b + c, None)
    out = clone.forward(c)
    ref = Runtime(model, gdn_prefill="native")  # the same forwards from scratch
    ref.forward(a), ref.forward(b)
    assert mx.array_equal(out, ref.forward(c)).item()
    after = _held(rt)
    assert after[0] == before[0] and all(np.array_equal(x, y) for x, y in zip(before[1], after[1]))
    hot.check()


def test_domains_never_share_a_hot_runtime_and_the_longest_prefix_wins(loaded):
    model, tok = loaded
    ids = tok.encode(TEXT[:600])
    hot = HotRuntimes(4, 64 << 20, share=False)
    for salt, n in ((None, 40), ("s:a", 60), (None, 20)):
        rt = Runtime(model, cache_salt=salt)
        mx.eval(rt.forward(ids[:n]))
        assert hot.keep(rt, salt)
    assert hot.count == 3  # the 20 tokens do not extend the 40: an edit of the turn may resume them
    assert hot.take(ids[:100], "s:b") is None and hot.take(ids[:100], "k:x;s:a") is None
    assert len(hot.take(ids[:100], "s:a").committed_tokens) == 60
    assert len(hot.take(ids[:100], None).committed_tokens) == 40  # the longest prefix of the prompt
    assert len(hot.take(ids[:30], None).committed_tokens) == 20
    assert hot.take(ids[1:100], None) is None and hot.take(ids[:10], None) is None
    rt = Runtime(model, cache_salt="s:a")
    mx.eval(rt.forward(ids[:80]))
    assert not hot.keep(rt, None)  # a runtime of one domain is never kept for another
    assert hot.keep(rt, "s:a") and hot.count == 3  # it supersedes the 60 tokens of its own domain
    hot.check()


def test_the_bounds_drop_the_least_recently_used_and_a_runtime_too_big_is_not_kept(loaded):
    model, tok = loaded
    ids = tok.encode(TEXT[:2000])
    rts = []
    for k in range(3):
        rt = Runtime(model)
        mx.eval(rt.forward(ids[k * 100 : k * 100 + 50]))
        rts.append(rt)
    size = runtime_nbytes(rts[0])
    hot = HotRuntimes(2, 10 * size, share=False)
    assert hot.keep(rts[0], None) and hot.keep(rts[1], None)
    assert hot.take(ids[:60], None) is not None  # a use: rts[1] is now the least recently used
    assert hot.keep(rts[2], None) and hot.count == 2
    assert hot.take(ids[100:160], None) is None and hot.take(ids[:60], None) is not None
    tight = HotRuntimes(4, size + size // 2, share=False)
    assert tight.keep(rts[0], None) and tight.keep(rts[1], None) and tight.count == 1 and tight.dropped == 1
    big = Runtime(model)
    mx.eval(big.forward(ids[:400]))
    assert not tight.keep(big, None) and tight.count == 1
    for h in (hot, tight):
        h.check()
    with pytest.raises(ValueError):
        HotRuntimes(-1)


class Broken(Sampler):
    def sample(self, logprobs, keys):
        raise ValueError("this sampler cannot sample")


def test_a_failed_or_cancelled_turn_leaves_the_hot_runtime_as_it_was(loaded, monkeypatch):
    tok = loaded[1]
    hot = HotRuntimes(4, 64 << 20, share=False)
    t = Turns(loaded, hot=hot)
    first = t.run(GenRequest("a", tok.encode(TEXT[:800]), 8))
    entry = next(iter(hot._entries.values()))
    before = _held(entry.runtime)
    nxt = entry.tokens + tok.encode(TEXT[900:1100])
    made = Controls.sampler
    monkeypatch.setattr(Controls, "sampler",
                        lambda self, tok: Broken(self.temperature) if self.temperature == 1.25 else made(self, tok))
    assert isinstance(t.run(GenRequest("bad", nxt, 8, temperature=1.25))[2], Failure)
    # cancelled after its first chunk: the client went away
    events = []
    job = Job(GenRequest("gone", nxt, 30), events.append)
    t.sched.submit(job)
    for _ in range(5000):
        if any(isinstance(e, Chunk) and e.text for e in events):
            break
        t.sched.step()
    job.cancel()
    for _ in range(50):
        if not t.sched.step():
            break
    assert len(t.engine.decoder) == 0
    assert hot.count == 1 and next(iter(hot._entries.values())) is entry and hot.hits == 2
    after = _held(entry.runtime)
    assert after[0] == before[0] and all(np.array_equal(x, y) for x, y in zip(before[1], after[1]))
    # and the next turn continues from it as if they never ran
    fresh = Turns(loaded)
    fresh.run(GenRequest("a", tok.encode(TEXT[:800]), 8))
    assert t.run(GenRequest("ok", nxt, 8))[0] == fresh.run(GenRequest("ok", nxt, 8))[0]
    assert hot.hits == 3 and first[2].reason in ("stop", "length")


def _record_views(store, rt):
    """The page records of rt's tokens in RAM, and whether each now shares rt's buffer."""
    cache = rt.prefix_cache()
    ix = PromptKeys(store, cache.layout, rt.committed_tokens, rt.cache, rt.cache_salt)
    return [store._ram.peek(ix.page_key(j)) for j in range(1, len(rt.committed_tokens) // 256 + 1)]


def test_the_stores_ram_pages_share_the_hot_runtimes_buffers(loaded, tmp_path):
    model, tok = loaded
    ids = tok.encode(TEXT[:6000])[:1100]
    with open_store(tmp_path / "s") as store:
        rt = Runtime(model, store=store)
        rt.prefill(ids)
        pages = _record_views(store, rt)
        assert len(pages) == 4 and all(p is not None for p in pages)
        copies = [dict(p.arrays) for p in pages]
        mx.eval(copies)
        gc_base = mx.get_active_memory()
        hot = HotRuntimes(2, 64 << 20)
        assert hot.keep(rt, None) and hot.shared >= 4
        del pages, copies
        mx.clear_cache()
        kv_rows = sum(a.nbytes for p in _record_views(store, rt) for a in p.arrays.values())
        assert gc_base - mx.get_active_memory() >= 0.9 * kv_rows  # the copies are gone: the rows are held once
        store.check()
        # the shared records serve a cold resume as before
        cold = Runtime(model, store=store)
        resume = cold.prefill(ids + tok.encode(" more text"))
        ref = Runtime(model)
        assert mx.allclose(resume, ref.prefill(ids + tok.encode(" more text")), atol=1e-4).item()
        # a record whose bytes differ is never swapped for the runtime's rows
        key = PromptKeys(store, rt.prefix_cache().layout, ids, rt.cache, None).page_key(1)
        rec = store._ram.peek(key)
        name = next(iter(rec.arrays))
        bad = {name: rec.arrays[name] + 1}
        assert store.share([(key, bad)]) == 0 and store._ram.peek(key) is rec
        # written to disk from the views, and read back from there, the records give the same state
        store.flush()
        store.evict_ram(0)
        assert store.stats()["ram_entries"] == 0
        from_disk = Runtime(model, store=store)
        assert mx.allclose(from_disk.prefill(ids + tok.encode(" more text")), resume, atol=1e-4).item()


def _chat(client, messages, **kw):
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=0.0, **kw)
    return r.choices[0].message.content or "", r.usage


def _turns(client, n=3, **kw):
    """A chat of n turns: each the conversation so far + the answer + a new question."""
    messages = [{"role": "system", "content": TEXT[:700]}, {"role": "user", "content": TEXT[800:1000]}]
    out = []
    for k in range(n):
        text, usage = _chat(client, messages, **kw)
        out.append((text, usage))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": TEXT[1200 + 300 * k : 1400 + 300 * k]}]
    return out


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_real_server_continues_hot_turns_through_the_official_clients(tmp_path):
    hot = Server(tmp_path / "hot", "--log-level", "INFO", log_path=tmp_path / "hot.log").launch()
    cold = Server(tmp_path / "cold", "--hot-conversations", "0", log_path=tmp_path / "cold.log").launch()
    try:
        hot.wait_ready(), cold.wait_ready()
        got = _turns(hot.client())
        want = _turns(cold.client())  # every turn resumed from the store's pages instead
        assert [t for t, _ in got] == [t for t, _ in want]  # the same greedy answers
        tiers = [u.model_extra["segcache"]["cached_tokens_by_tier"] for _, u in got]
        assert tiers[0] == {} and all(set(t) == {"hot"} for t in tiers[1:]), tiers
        for (_, u), (_, w) in zip(got[1:], want[1:]):
            assert u.prompt_tokens == w.prompt_tokens
            assert u.prompt_tokens_details.cached_tokens >= w.prompt_tokens_details.cached_tokens > 0
        assert len(re.findall(r"cached \d+ \(hot\)", hot.log())) == 2  # the log line names the tier
        # another domain (its own cache_salt) never continues from this conversation's runtime
        salted = _turns(hot.client(), n=1, extra_body={"cache_salt": "other"})
        assert salted[0][1].model_extra["segcache"]["cached_tokens_by_tier"] == {}
        # the anthropic client: the second turn is hot, its usage says so from message_start on
        a = anthropic.Anthropic(base_url=hot.url, api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": TEXT[5000:5600]}]
        first = a.messages.create(model="target", max_tokens=12, system=TEXT[:700], messages=messages)
        messages += [{"role": "assistant", "content": _text(first)},
                     {"role": "user", "content": TEXT[6000:6200]}]
        second = a.messages.create(model="target", max_tokens=12, system=TEXT[:700], messages=messages)
        assert second.usage.segcache["cached_tokens_by_tier"] == {"hot": second.usage.cache_read_input_tokens}
        assert second.usage.cache_read_input_tokens >= first.usage.input_tokens
        messages += [{"role": "assistant", "content": _text(second)},
                     {"role": "user", "content": TEXT[6500:6700]}]
        with a.messages.stream(model="target", max_tokens=12, system=TEXT[:700], messages=messages) as s:
            start = next(e for e in s if e.type == "message_start")
            final = s.get_final_message()
        assert start.message.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens
        assert final.usage.cache_read_input_tokens >= second.usage.input_tokens + second.usage.cache_read_input_tokens
        assert len(re.findall(r"cached \d+ \(hot\)", hot.log())) == 4
        # a completion that extends the last prompt and its answer continues the hot runtime too
        got, want = _continuations(hot.client()), _continuations(cold.client())
        assert [t for t, _ in got] == [t for t, _ in want]
        tiers = [u.model_extra["segcache"]["cached_tokens_by_tier"] for _, u in got]
        # each resumes all of the last prompt; the hot runtime where its answer re-encodes as generated
        # (here the second; the third's answer ends in spaces that merge with the text after them)
        assert all(u.prompt_tokens_details.cached_tokens >= last.prompt_tokens
                   for (_, last), (_, u) in zip(got, got[1:])), [u for _, u in got]
        assert tiers[0] == {} and set(tiers[1]) == {"hot"}, tiers
    finally:
        hot.stop(), cold.stop()


def _continuations(client, n=3):
    """Completion prompts as editors send them: each the last prompt, its answer and more text."""
    prompt, out = TEXT[9000:9600], []
    for k in range(n):
        r = client.completions.create(model="target", prompt=prompt, max_tokens=12, temperature=0.0)
        out.append((r.choices[0].text, r.usage))
        prompt += r.choices[0].text + TEXT[9700 + 200 * k : 9800 + 200 * k]
    return out
