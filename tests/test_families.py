"""Every recurrent family beyond Gated DeltaNet: exact branches, the state machine, the prefix
store and speculative generation, each against mlx-lm's own caches.

The compatibility table (docs/compatibility.md) is generated from this file's
results: `COLUMNS` maps each test to the column it proves, and the first
parameter of every test is the family (tools/compat_table.py).
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import functools
import importlib
import random

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.models.cache import CacheList, make_prompt_cache

from segcache import BranchError, Runtime, UnsupportedModelError, open_store
from segcache.adapters import state as hooks
from segcache.generation import stream_generate
from segcache.layers.composite import CompositeLayer
from segcache.layers.kv import KVLayer
from segcache.layers.state import StateLayer
from segcache.layers.window import WindowLayer
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from segcache.testing.statemachine import assert_logits_close, machine_for, run_machine

# Gated DeltaNet (RecurrentLayer) and every family served by the generic kinds
FAMILIES = models.HYBRID + models.RECURRENT

# The recurrence each family's module reaches, as a dotted name under its mlx-lm
# model module: recorded by test_kernel_kept_outside_branches, named in the table.
KERNELS = {
    "qwen3_next": "gated_delta_update",
    "qwen3_5": "gated_delta_update",
    "nemotron_h": "ssm_update",
    "granitemoehybrid": "ssm_update",
    "falcon_h1": "ssm_update",
    "lfm2": "nn.Conv1d.__call__",
    "mamba": "MambaBlock.ssm_step",
    "jamba": "JambaMambaMixer.ssm_step",
    "mamba2": "ssm_update",
    "lfm2_moe": "nn.Conv1d.__call__",
    "plamo2": "ssm_update",
    "kimi_linear": "gated_delta_update",
    "recurrent_gemma": "rnn_scan",
    "bailing_moe_linear": "recurrent_gla",
    "rwkv7": "Rwkv7TimeMixing._wkv7",
    "baichuan_m1": "Attention._custom_convolution",
    "olmo_hybrid": "gated_delta_update",
    "gear": "nn.Conv1d.__call__",
    "bailing_hybrid": "recurrent_gla",
    "bailing_moe_v3": "gated_delta_update",
    "kimi_k3": "gated_delta_update",
    "longcat_flash_ngram": "NgramEmbedding._get_ngram_ids",
}

# Recurrent families of mlx-lm 0.32.2 outside the matrix, with the reason
# Runtime(model) refuses them (test_refused_families checks it is still so).
# Empty: every family whose make_cache() holds an ArraysCache is in the matrix
# (test_every_recurrent_family_of_mlx_lm_is_in_the_matrix).
REFUSED = {}
# Families BatchRuntime refuses (UnsupportedModelError, nothing changed), with the reason;
# test_batched_rows_as_alone checks they still are, and every other family batches exactly.
NOT_BATCHED = {
    "falcon_h1": "a CacheList per layer (composites are not batched)",
    "baichuan_m1": "a CacheList per layer (composites are not batched)",
    "recurrent_gemma": "its state starts otherwise from None than from zeros (an empty row beside others)",
    "longcat_flash_ngram": "its n-gram context grows with the first tokens (rows cannot be stacked)",
}
# make_cache() uses CacheList, but only of attention caches: not recurrent, not in this matrix
ATTENTION_LISTS = ("deepseek_v32", "longcat_flash", "minimax_m3_vl")
STRATEGIES = ["replay", "states"]
PREFIX = [5, 17, 3, 42, 8, 8, 1, 30, 22, 9, 14]
TAIL_A = [7, 11, 63, 0, 19, 4]
TAIL_B = [50, 50, 50, 50, 50, 50]

# test function -> compatibility column it proves (tools/compat_table.py)
COLUMNS = {
    "test_commit_n_is_exact_for_every_n": "fork/commit/rollback",
    "test_rollback_and_misuse_change_nothing": "fork/commit/rollback",
    "test_nested_branches_and_clones": "fork/commit/rollback",
    "test_runtime_state_machine": "fork/commit/rollback",
    "test_prefix_store_round_trip": "prefix store",
    "test_speculative_target": "speculative target",
    "test_speculative_draft": "speculative draft",
    "test_kernel_kept_outside_branches": "kernel kept on the hot path",
    "test_batched_rows_as_alone": "batched rows",
}


@functools.lru_cache(maxsize=None)
def tiny(family, seed=0):
    return models.build(family, seed=seed)


def flat_state(layer) -> list:
    """The arrays that determine a layer's future outputs, cut to what is live."""
    if isinstance(layer, CompositeLayer):
        return [a for c in layer.caches for a in flat_state(c)] + [mx.array([layer.offset])]
    if isinstance(layer, KVLayer):
        if layer.keys is None:
            return [mx.array([0])]
        return [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]
    if isinstance(layer, WindowLayer):
        return [mx.array([layer.offset, layer._idx])] + ([] if layer.keys is None else [layer.keys, layer.values])
    return [a for a in layer.cache if a is not None] + [mx.array([layer.offset])]


def assert_same_state(a, b, what=""):
    for i, (la, lb) in enumerate(zip(a.cache, b.cache)):
        sa, sb = flat_state(la), flat_state(lb)
        assert len(sa) == len(sb), f"{what} layer {i}"
        for x, y in zip(sa, sb):
            assert x.shape == y.shape and mx.array_equal(x, y).item(), f"{what} layer {i}: states differ"


def frozen(rt) -> list:
    copies = [[mx.array(x) + 0 for x in flat_state(layer)] for layer in rt.cache]
    mx.eval(copies)
    return copies


def _feed(rt, ids, chunking):
    if chunking == "block":
        return rt.forward(ids)
    return [rt.forward([t]) for t in ids][-1]


def _runtime(family, strategy, tokens=PREFIX, chunking="block"):
    rt = Runtime(tiny(family), recurrent_strategy=strategy)
    _feed(rt, tokens, chunking)
    return rt


def test_layers_are_the_generic_kinds():
    """Each family is served by the generic kinds, with the cache list mlx-lm makes."""
    for family in models.RECURRENT:
        model = tiny(family)
        rt = Runtime(model)
        native = make_prompt_cache(model)
        assert [type(n) for n in native] == [next(b for b in type(c).__mro__ if b.__module__ == "mlx_lm.models.cache") for c in rt.cache]
        assert all(isinstance(c, (StateLayer, KVLayer, WindowLayer, CompositeLayer)) for c in rt.cache)
    assert len(Runtime(tiny("nemotron_h")).cache) < len(tiny("nemotron_h").layers)  # MLP blocks: no cache
    # "auto" is "replay" for the generic kind on every device; an explicit strategy is kept
    assert {c.strategy for c in Runtime(tiny("lfm2")).cache if isinstance(c, StateLayer)} == {"replay"}
    assert {c.strategy for c in Runtime(tiny("lfm2"), recurrent_strategy="states").cache
            if isinstance(c, StateLayer)} == {"states"}


@pytest.mark.parametrize("chunking", ["block", "steps"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_commit_n_is_exact_for_every_n(family, strategy, chunking):
    for n in range(len(TAIL_A) + 1):
        a, b = _runtime(family, strategy), _runtime(family, strategy)
        with a.fork() as br:
            _feed(a, TAIL_A, chunking)
            br.commit(n)
        with b.fork() as br:
            _feed(b, TAIL_A[:n] + TAIL_B[n:], chunking)
            br.commit(n)
        assert_same_state(a, b, f"n={n}: the committed state depends on the rejected tail:")
        la, lb = a.forward([2]), b.forward([2])
        assert mx.array_equal(la, lb).item()
        fresh = _runtime(family, strategy, PREFIX + TAIL_A[:n])
        assert_logits_close(la, fresh.forward([2]), f"{family} commit({n}) vs recompute")
        if chunking == "steps":
            # fed one at a time, commit(n) is bit for bit the n tokens fed one at a time
            ref = _runtime(family, strategy, PREFIX)
            for t in TAIL_A[:n] + [2]:
                want = ref.forward([t])
            assert mx.array_equal(la, want).item(), f"{family} n={n}: not the bits of one-at-a-time"
        assert a.tokens == PREFIX + TAIL_A[:n] + [2]
        a.check()
        b.check()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_and_misuse_change_nothing(family, strategy):
    rt = _runtime(family, strategy)
    before = frozen(rt)
    for chunking in ("block", "steps"):
        br = rt.fork()
        _feed(rt, TAIL_A, chunking)
        br.rollback()
        assert rt.offset == len(PREFIX) and rt.tokens == PREFIX
        assert_same_state_frozen(before, rt)
    br = rt.fork()
    rt.forward(TAIL_A)
    inside = frozen(rt)
    for bad in (-1, len(TAIL_A) + 1, 0.5):
        with pytest.raises(BranchError):
            rt.commit(bad)
        assert_same_state_frozen(inside, rt)
    br.rollback()
    with pytest.raises(BranchError):
        rt.rollback()
    assert_same_state_frozen(before, rt)
    rt.check()
    # the native cache and mlx-lm's own call still agree with the runtime after all this
    native = make_prompt_cache(rt.model)
    want = rt.model(mx.array([PREFIX + [2]]), cache=native)[:, -1]
    assert_logits_close(rt.forward([2])[:, -1], want, f"{family} after rollback")


def assert_same_state_frozen(snap, rt):
    now = frozen(rt)
    for i, (la, lb) in enumerate(zip(snap, now)):
        assert len(la) == len(lb)
        for x, y in zip(la, lb):
            assert x.shape == y.shape and mx.array_equal(x, y).item(), f"layer {i} changed"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_nested_branches_and_clones(family, strategy):
    rt = _runtime(family, strategy)
    outer = rt.fork()
    rt.forward([1, 2, 3])
    inner = rt.fork()
    rt.forward([4, 5, 6])
    inner.commit(2)
    with rt.fork():
        rt.forward([7])
    clone = rt.clone()  # the committed state only
    outer.commit(4)
    rt.check()
    fresh = _runtime(family, strategy, PREFIX + [1, 2, 3, 4])
    assert_logits_close(rt.forward([9]), fresh.forward([9]), "nested commit")
    before = frozen(clone)
    assert clone.tokens == PREFIX
    rt.forward([10, 11])
    assert_same_state_frozen(before, clone)
    assert_logits_close(clone.forward([9]), _runtime(family, strategy).forward([9]), "clone")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_state_machine(family, strategy):
    run_machine(machine_for(tiny(family), strategy=strategy), examples=6, steps=12)


def _ids(n, seed):
    rnd = random.Random(seed)
    return [rnd.randrange(models.VOCAB) for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_store_round_trip(tmp_path, family):
    model, prompt = tiny(family), _ids(37, seed=3)
    with open_store(tmp_path, page_tokens=16, ram_bytes=1 << 26, disk_bytes=1 << 28) as store:
        rt = Runtime(model, store=store)
        logits = rt.prefill(prompt)
        published = frozen(rt)
        warm = Runtime(model, store=store)
        assert mx.array_equal(warm.prefill(prompt), logits).item(), "from RAM"
        assert_same_state_frozen(published, warm)
        warm.check()
        store.evict_ram(0)
        from_disk = Runtime(model, store=store)
        assert mx.array_equal(from_disk.prefill(prompt), logits).item(), "from disk"
        assert_same_state_frozen(published, from_disk)
        # a longer prompt resumes at the checkpoint and matches a cold prefill
        more = prompt + _ids(9, seed=4)
        resumed = Runtime(model, store=store)
        got = resumed.prefill(more)
        assert store.stats()["hit_tokens"] >= 3 * len(prompt)
        assert_logits_close(got, Runtime(model).prefill(more), f"{family} resumed prefill")
    with open_store(tmp_path, page_tokens=16) as store:  # a new handle: disk only
        again = Runtime(model, store=store)
        assert mx.array_equal(again.prefill(prompt), logits).item(), "another process"


MAX_TOKENS = 19
PROMPT = "def add(a, b):\n    return a + b\n\ndef add("


def _reference(model, prompt):
    tk = test_tokenizer.tokenizer(eos=False)
    return [r.token for r in mlx_lm.stream_generate(model, tk, mx.array(prompt), max_tokens=MAX_TOKENS)]


def _ours(model, prompt, **kw):
    tk = test_tokenizer.tokenizer(eos=False)
    return [r.token for r in stream_generate(model, tk, prompt, max_tokens=MAX_TOKENS, **kw)]


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_target(family):
    """The family as target: prompt lookup and a draft model, greedy = mlx-lm's greedy."""
    model = tiny(family)
    prompt = test_tokenizer.tokenizer().encode(PROMPT)
    want = _reference(model, prompt)
    assert _ours(model, prompt, prompt_lookup=True, num_draft_tokens=3) == want
    assert _ours(model, prompt, draft_model=tiny(family, seed=1), num_draft_tokens=3) == want


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_draft(family):
    """The family as draft for a dense target."""
    target = models.build("qwen3", seed=0)
    prompt = test_tokenizer.tokenizer().encode(PROMPT)
    assert _ours(target, prompt, draft_model=tiny(family), num_draft_tokens=3) == _reference(target, prompt)


def _record(monkeypatch, family: str, path: str) -> list:
    """Record the calls of `path` (a dotted name under the family's model module)."""
    *chain, name = path.split(".")
    owner = importlib.import_module(f"mlx_lm.models.{family}")
    for part in chain:
        owner = getattr(owner, part)
    calls = []
    original = getattr(owner, name)

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorder)
    return calls


def kernel_of(family: str) -> str:
    """The recurrence a family's module reaches (a dotted name under its model module)."""
    if family in models.HYBRID:
        return "gated_delta_update"
    return next(h.kernel for h in hooks.HOOKS if h.family == family)


def _arrays(call):
    args, kwargs = call
    return [a for a in list(args) + list(kwargs.values()) if isinstance(a, mx.array)]


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_kept_outside_branches(family, monkeypatch):
    """Outside a branch the family's recurrence gets exactly the unpatched arguments."""
    model = tiny(family)
    steps = [[5, 17, 3, 42, 8, 8, 1], [30], [22], [9, 14]]
    assert KERNELS[family] == kernel_of(family)
    calls = _record(monkeypatch, family, KERNELS[family])
    native = make_prompt_cache(model)
    for ids in steps:
        mx.eval(model(mx.array(ids)[None], cache=native))
    unpatched = list(calls)
    calls.clear()
    rt = Runtime(model)
    for ids in steps:
        mx.eval(rt.forward(ids))
    assert len(calls) == len(unpatched) > 0
    for got, want in zip(calls, unpatched):
        assert got[1].keys() == want[1].keys() and len(got[0]) == len(want[0])
        for x, y in zip(_arrays(got), _arrays(want)):
            assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_as_alone(family):
    """BatchRuntime: rows (one empty) decode a step, verify drafts in a ragged round and
    each commit its own count, each as a single Runtime fed the row's kept tokens (logits
    as close as the state machine asks, same greedy tokens: batched products round
    otherwise, docs/batching.md).
    A family in NOT_BATCHED is refused before any module is adapted."""
    from segcache import BatchRuntime

    model = tiny(family)
    if family in NOT_BATCHED:
        classes = [type(m) for _, m in model.named_modules()]
        with pytest.raises(UnsupportedModelError, match="decode-concurrency 1"):
            BatchRuntime(model)
        assert [type(m) for _, m in model.named_modules()] == classes
        return
    prompts = [PREFIX, PREFIX[:4], []]
    held = [p + [9] for p in prompts]
    batch = BatchRuntime(model)
    for i, p in enumerate(prompts):
        batch.join(i, _runtime(family, "replay", p) if p else None)
    steps = [batch.forward([[9]] * 3)[:, 0]]
    feeds = [TAIL_A[:3], TAIL_A[:1], TAIL_B[:2]]
    batch.fork()
    batch.forward(feeds)
    batch.commit([2, 1, 0])
    batch.check()
    held = [h + f[:n] for h, f, n in zip(held, feeds, [2, 1, 0])]
    steps.append(batch.forward([[4]] * 3)[:, 0])
    for i, (p, h) in enumerate(zip(prompts, held)):
        assert batch.tokens(i) == h + [4]
        alone = Runtime(model)
        want = [alone.forward(p + [9])[0, -1], alone.forward(h[len(p) + 1 :] + [4])[0, -1]]
        for got, ref in zip((steps[0][i], steps[1][i]), want):
            assert_logits_close(got, ref, f"{family} row {i}")


def test_a_family_without_a_hook_is_refused_before_anything_changes(monkeypatch):
    model = models.build("nemotron_h", seed=5)
    mixer = model.layers[0].mixer
    before = type(mixer)
    monkeypatch.setattr(hooks, "_by_class", {h.module_class: h for h in hooks.HOOKS if h.family != "nemotron_h"})
    with pytest.raises(UnsupportedModelError, match="layer 0"):
        Runtime(model)
    assert type(mixer) is before


def test_every_recurrent_family_of_mlx_lm_is_in_the_matrix():
    """Every mlx-lm model module that makes an ArraysCache or a CacheList is tested here, or refused."""
    from pathlib import Path

    root = Path(mlx_lm.__file__).parent / "models"
    makers = {
        p.stem for p in root.glob("*.py")
        if p.stem != "cache" and ("ArraysCache(" in p.read_text() or "CacheList(" in p.read_text())
    }
    assert makers - set(ATTENTION_LISTS) == set(FAMILIES) | set(REFUSED)


@pytest.mark.parametrize("family", list(REFUSED) or [pytest.param(None, marks=pytest.mark.skip("none refused"))])
def test_refused_families(family):
    """No hook or GDN adapter names a class of these model modules, so Runtime refuses them."""
    from segcache import adapters

    module = importlib.import_module(f"mlx_lm.models.{family}")
    hooked = set(hooks.by_class()) | set(adapters.FAMILIES)
    classes = {c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__}
    assert not classes & hooked, f"{family} has a hook now: add it to the matrix and drop it from REFUSED"
    assert "ArraysCache" in vars(module), f"{family} keeps no ArraysCache: not a recurrent family"


class _NestedLists(nn.Module):
    """falcon_h1 with every layer's CacheList wrapped in another CacheList (a nested composite)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.args = inner.args

    @property
    def layers(self):
        return self.inner.layers

    def make_cache(self):
        return [CacheList(c) for c in self.inner.make_cache()]

    def __call__(self, inputs, cache=None):
        return self.inner(inputs, cache=None if cache is None else [c[0] for c in cache])


@functools.lru_cache(maxsize=None)
def _nested():
    return _NestedLists(models.build("falcon_h1", seed=0))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nested_cache_lists(tmp_path, strategy):
    model = _nested()
    rt = Runtime(model, recurrent_strategy=strategy)
    assert all(isinstance(c, CompositeLayer) and isinstance(c.caches[0], CompositeLayer) for c in rt.cache)
    for n in (0, 2, len(TAIL_A)):
        a, b = Runtime(model, recurrent_strategy=strategy), Runtime(model, recurrent_strategy=strategy)
        for r, tail in ((a, TAIL_A), (b, TAIL_A[:n] + TAIL_B[n:])):
            r.forward(PREFIX)
            with r.fork() as br:
                r.forward(tail)
                br.commit(n)
            r.check()
        assert_same_state(a, b, f"nested n={n}:")
        ref = model.inner(mx.array([PREFIX + TAIL_A[:n] + [2]]), cache=make_prompt_cache(model.inner))
        assert_logits_close(a.forward([2])[:, -1], ref[:, -1], f"nested commit({n})")
    with open_store(tmp_path, page_tokens=16) as store:
        prompt = _ids(21, seed=5)
        logits = Runtime(model, store=store).prefill(prompt)
        store.evict_ram(0)
        warm = Runtime(model, store=store)
        assert mx.array_equal(warm.prefill(prompt), logits).item()
        assert store.stats()["hit_tokens"] == len(prompt)
        warm.check()
