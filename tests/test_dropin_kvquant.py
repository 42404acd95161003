"""mlx-lm's KV quantization (kv_bits, kv_group_size, quantized_kv_start) on segcache runtimes (issue 25).

References: mlx-lm's own `stream_generate(..., kv_bits=...)` on its own caches
(logprobs bit for bit, so the switch to quantized K/V happens at the same
forward); the quantized layers a runtime ends with against mlx-lm's
`QuantizedKVCache` fed the same tokens; the prefix store's records against a
runtime that computed the same prompt.
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache, save_prompt_cache, trim_prompt_cache

from segcache import BranchError, Runtime, open_store
from segcache.demo import MODELS_DIR
from segcache.generation import stream_generate
from segcache.kvquant import KVQuantization
from segcache.layers import KVLayer, QuantizedKVLayer
from segcache.prompt_file import runtime_from
from segcache.testing import models

PROMPT = MODELS_DIR.joinpath("heldout_other.txt").read_text()[5000:5600]


@pytest.fixture(scope="module")
def target():
    return mlx_lm.load(str(MODELS_DIR / "target"))


@pytest.fixture(scope="module")
def ids(target):
    return list(target[1].encode(PROMPT))


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def _quantized(cache):
    """Every quantized layer's rows up to its offset, keys then values, each (packed, scales, biases)."""
    return [a[..., : c.offset, :] for c in cache if type(c).__name__.startswith("Quantized")
            for part in (c.keys, c.values) for a in part]


@pytest.mark.parametrize("bits, group, start", [(4, 64, 0), (2, 64, 0), (8, 32, 60), (4, 64, 155), (4, 64, 5000)])
def test_logprobs_bit_equal_to_mlx_lm(target, ids, bits, group, start):
    """The switch happens after the forward where mlx-lm's generate_step makes it: after the
    prompt's first chunk at start 0 (not before it), mid-prompt, mid-decode, or never."""
    model, tok = target
    kw = dict(kv_bits=bits, kv_group_size=group, quantized_kv_start=start)
    cache = make_prompt_cache(model)
    want = [(r.token, r.logprobs) for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=16,
                                                                     prompt_cache=cache, prefill_step_size=64, **kw)]
    rt = Runtime(model)
    got = [(r.token, r.logprobs) for r in stream_generate(model, tok, ids, max_tokens=16, runtime=rt,
                                                           prefill_step_size=64, **kw)]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(same(a, b) for (_, a), (_, b) in zip(got, want))
    assert [type(c) is QuantizedKVLayer for c in rt.cache] == [isinstance(c, QuantizedKVCache) for c in cache]
    for mine, theirs in zip(rt.cache, cache):  # and the state the last token left is mlx-lm's
        if type(mine) is QuantizedKVLayer:
            n = theirs.offset
            assert mine.offset == n
            for a, b in zip((*mine.keys, *mine.values), (*theirs.keys, *theirs.values)):
                assert same(a[..., :n, :], b[..., :n, :])


def test_speculative_greedy_tokens_equal_plain(target, ids):
    model, tok = target
    draft, _ = mlx_lm.load(str(MODELS_DIR / "draft"))
    kw = dict(kv_bits=4, kv_group_size=64, quantized_kv_start=40)
    want = [r.token for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=32, **kw)]
    for extra in (dict(prompt_lookup=True), dict(draft_model=draft)):
        rt = Runtime(model)
        got = [r.token for r in stream_generate(model, tok, ids, max_tokens=32, runtime=rt, **kw, **extra)]
        assert got == want
        assert any(type(c) is QuantizedKVLayer for c in rt.cache)
        rt.check()


def test_the_switch_waits_for_the_branch_and_clones_keep_the_setting():
    model = models.build("llama", head_dim=32)
    rt = Runtime(model, kv_bits=4, kv_group_size=32, quantized_kv_start=6)
    rt.forward([1, 2, 3])
    assert all(type(c) is KVLayer for c in rt.cache)
    with rt.fork() as br:
        rt.forward([4, 5, 6, 7])
        assert all(type(c) is KVLayer for c in rt.cache)  # 7 >= 6, but inside a branch
        br.commit(3)
    assert all(type(c) is QuantizedKVLayer for c in rt.cache) and rt.offset == 6
    ref = make_prompt_cache(model)  # mlx-lm: the same forwards, the rejected token trimmed, then quantized
    model(mx.array([[1, 2, 3]]), cache=ref)
    model(mx.array([[4, 5, 6, 7]]), cache=ref)
    trim_prompt_cache(ref, 1)
    maybe_quantize_kv_cache(ref, 0, 32, 4)
    assert all(same(a, b) for a, b in zip(_quantized(rt.cache), _quantized(ref)))
    other = rt.clone()
    assert other.kv_quantization == rt.kv_quantization
    assert same(other.forward([9]), model(mx.array([[9]]), cache=ref))
    rt.check()
    other.check()


def test_bad_settings_are_refused_and_change_nothing():
    with pytest.raises(ValueError, match="kv_bits=7"):
        Runtime(models.build("llama"), kv_bits=7)
    with pytest.raises(ValueError, match="sliding windows"):
        Runtime(models.build("gemma3_text"), kv_bits=4)
    model = models.build("llama", head_dim=32)
    rt = Runtime(model, kv_bits=4, kv_group_size=64, quantized_kv_start=0)  # 64 does not divide 32
    with pytest.raises(ValueError, match="cannot quantize"):
        rt.forward([1, 2, 3])
    assert rt.offset == 0 and rt.tokens == [] and all(type(c) is KVLayer for c in rt.cache)
    rt.check()
    other = Runtime(model, kv_bits=4, kv_group_size=32)
    with pytest.raises(ValueError, match="already"):
        other.quantize_kv(KVQuantization(8, 32))
    other.quantize_kv(KVQuantization(4, 32))  # the same setting: nothing to do
    with pytest.raises(BranchError):
        with other.fork():
            other.quantize_like(rt)


def test_other_bits_and_group_sizes_are_other_identities(target, ids, tmp_path):
    model, _ = target
    with open_store(tmp_path / "s") as store:
        first = Runtime(model, store=store, kv_bits=4, kv_group_size=64, quantized_kv_start=0)
        first.prefill(ids)
        longer = ids + [7, 8]

        def resumed(**kw):
            steps = Runtime(model, store=store, **kw).prefill_steps(longer)
            held = next(steps).restored
            steps.close()
            return held

        assert resumed(kv_bits=8, kv_group_size=64, quantized_kv_start=0) == 0
        assert resumed(kv_bits=4, kv_group_size=32, quantized_kv_start=0) == 0
        assert resumed() == 0  # unquantized
        assert resumed(kv_bits=4, kv_group_size=64, quantized_kv_start=0) == len(ids)
        again = Runtime(model, store=store, kv_bits=4, kv_group_size=64, quantized_kv_start=0)
        again.prefill(longer)
        first.prefill(longer)
        assert all(same(a, b) for a, b in zip(_quantized(again.cache), _quantized(first.cache)))


def test_a_quantized_prompt_file_continues_on_a_runtime(target, ids, tmp_path):
    """A file mlx-lm wrote after quantizing (what mlx_lm.cache_prompt --kv-bits writes) resumes into
    quantized layers; generation from it equals mlx-lm's from the same file."""
    model, tok = target
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(ids), model, max_tokens=0, prompt_cache=cache, kv_bits=4,
                                  quantized_kv_start=0):
        pass
    path = str(tmp_path / "p.safetensors")
    save_prompt_cache(path, cache)
    from mlx_lm.models.cache import load_prompt_cache

    rest = list(tok.encode(" = 1\n"))
    want = mlx_lm.generate(model, tok, rest, max_tokens=12, prompt_cache=load_prompt_cache(path), kv_bits=4,
                           quantized_kv_start=0)
    rt = runtime_from(model, load_prompt_cache(path))
    assert [type(c).__name__ for c in rt.cache].count("QuantizedKVLayer") == 2
    got = "".join(r.text for r in stream_generate(model, tok, rest, max_tokens=12, runtime=rt, kv_bits=4,
                                                  quantized_kv_start=0))
    assert got == want
    with rt.fork():  # fork-able like any runtime
        rt.forward([1, 2])
    rt.check()


def test_quantized_pages_travel_through_the_remote_tier(target, ids, redis_server, tmp_path):
    """A host with an empty disk resumes quantized pages another host published to Redis, bit-identical."""
    model, _ = target
    kw = dict(kv_bits=4, kv_group_size=64, quantized_kv_start=0)
    opts = dict(remote=redis_server.url, remote_timeout=2.0)
    with open_store(tmp_path / "a", **opts) as store:
        first = Runtime(model, store=store, **kw)
        first.prefill(ids)
        assert store.drain_remote(timeout=30)  # the remote tier writes from a background thread
        assert store.stats()["remote_writes"] > 0
    with open_store(tmp_path / "b", **opts) as store:
        other = Runtime(model, store=store, **kw)
        steps = other.prefill_steps(ids + [7])
        assert next(steps).restored == len(ids)
        steps.close()
        assert store.stats()["remote_reads"] > 0
    assert all(same(a, b) for a, b in zip(_quantized(other.cache), _quantized(first.cache)))


def test_a_prompt_file_with_the_draft_caches_drafts_from_them(target, ids, tmp_path):
    """A file holding the model's caches then the draft's (mlx-lm's speculative prompt_cache order)
    continues speculatively, with mlx-lm's greedy text from the model's part."""
    model, tok = target
    draft, _ = mlx_lm.load(str(MODELS_DIR / "draft"))
    caches = make_prompt_cache(model), make_prompt_cache(draft)
    for m, c in zip((model, draft), caches):
        m(mx.array(ids)[None], cache=c)
    path = str(tmp_path / "both.safetensors")
    save_prompt_cache(path, caches[0] + caches[1])
    from mlx_lm.models.cache import load_prompt_cache

    rest = list(tok.encode("\n"))
    want = mlx_lm.generate(model, tok, rest, max_tokens=16, prompt_cache=load_prompt_cache(path)[: len(caches[0])])
    loaded = load_prompt_cache(path)
    rt = runtime_from(model, loaded[: len(caches[0])])
    drt = runtime_from(draft, loaded[len(caches[0]):])
    out = list(stream_generate(model, tok, rest, max_tokens=16, runtime=rt, draft_runtime=drt))
    assert "".join(r.text for r in out) == want
    assert out[-1].stats.mode == "draft" and out[-1].stats.rounds > 0


def _serve(engine, requests):
    """Run GenRequests through `engine` one scheduler step at a time; {id: (text, events)}."""
    from segcache.serve.engine import Chunk
    from segcache.serve.worker import Job, Scheduler

    sched = Scheduler(engine, max_queue=len(requests), max_running=1, begin_step=engine.begin_step)
    events = {r.id: [] for r in requests}
    for r in requests:
        sched.submit(Job(r, events[r.id].append))
    for _ in range(2000):
        if not sched.step():
            break
    assert not sched.pending() and len(engine.decoder) == 0
    return {rid: ("".join(e.text for e in ev if isinstance(e, Chunk)), ev) for rid, ev in events.items()}


def test_the_serve_engine_quantizes_target_and_draft_one_row_at_a_time(target, ids, tmp_path, monkeypatch):
    """`segcache serve --kv-bits`: the request engine's runtimes (target and draft) switch where
    mlx-lm's do, a second request resumes the quantized pages with the same text, and batched rows
    (which hold unquantized KV) are refused rather than run unquantized."""
    from segcache.serve.engine import Engine, Finish, GenRequest

    model, tok = target
    draft, _ = mlx_lm.load(str(MODELS_DIR / "draft"))
    kv = KVQuantization(4, 64, 40)
    with pytest.raises(ValueError, match="decode_concurrency"):
        Engine(model, tok, kv=kv, decode_concurrency=2)
    want = mlx_lm.generate(model, tok, ids, max_tokens=24, kv_bits=4, quantized_kv_start=40)
    made = []
    real = Engine._draft_runtime
    monkeypatch.setattr(Engine, "_draft_runtime", lambda self, req: made.append(real(self, req)) or made[-1])
    for extra in ({}, dict(draft_model=draft)):
        with open_store(tmp_path / f"s{len(extra)}") as store:
            engine = Engine(model, tok, store=store, kv=kv, **extra)
            got = _serve(engine, [GenRequest("a", ids, 24)])["a"]
            again = _serve(engine, [GenRequest("b", ids, 24)])["b"]
        assert got[0] == want and again[0] == want
        finish = again[1][-1]
        assert isinstance(finish, Finish) and finish.usage.cached_tokens >= len(ids) - 1
    assert len(made) == 4 and made[:2] == [None, None]  # no draft model: no draft runtime
    for drt in made[2:]:
        assert drt.kv_quantization == kv and any(type(c) is QuantizedKVLayer for c in drt.cache)


def test_undo_across_the_switch_puts_the_unquantized_layers_back():
    """A savepoint taken before the forward that switched (a distributed step that is abandoned)
    returns to the full-precision layers as they were; the next forward switches again, as mlx-lm."""
    model = models.build("llama", head_dim=32)
    rt = Runtime(model, kv_bits=4, kv_group_size=32, quantized_kv_start=4)
    rt.forward([1, 2, 3])
    point = rt.savepoint()
    rt.forward([4, 5])
    assert all(type(c) is QuantizedKVLayer for c in rt.cache)
    rt.undo(point)
    del point
    assert all(type(c) is KVLayer for c in rt.cache) and rt.offset == 3 and rt.tokens == [1, 2, 3]
    rt.check()
    ref = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=ref)
    want = model(mx.array([[6, 7]]), cache=ref)
    maybe_quantize_kv_cache(ref, 4, 32, 4)
    assert same(rt.forward([6, 7]), want)
    assert all(same(a, b) for a, b in zip(_quantized(rt.cache), _quantized(ref)))
    rt.check()
