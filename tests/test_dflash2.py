"""DFlash2 block drafters (segcache.dflash, conv.py and selector.py): a synthetic checkpoint in the
published layout (random weights, a tiny config) loads and drafts what the reference
implementation (z-lab's `dflash` package from the wheel under tests/wheels, installed for the
test only) drafts for the same target hidden states, one row and batched, across rounds, on a
dense and a hybrid target, with its selector overruling the positions' argmax; greedy DFlash2
decoding, one row and batched with late joins, equals mlx-lm's greedy decoding; exact
speculative sampling through the selector has the target's distribution; the surfaces take a
DFlash2 directory."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import json
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from segcache.acceptors import GreedyMatch
from segcache.dflash import load_dflash
from segcache.dflash.config import _DFLASH2_SIZES
from segcache.dflash.drafter import DFlash
from segcache.dflash.load import read_module, save_dflash
from segcache.dflash.segment import drafter_identity
from segcache.drafters import make_decoder
from segcache.errors import UnsupportedModelError
from segcache.generation import generate, stream_generate
from segcache.processors import make_processors, normalize
from segcache.runtime import Runtime
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from segcache.testing.dflash import random_module, tiny_config, write_checkpoint
from test_dflash import ref_module  # noqa: F401  (the reference package's fixture)
from test_dflash import PROMPT, _run_batched, assert_exact, sampled_first_tokens
from test_dflash_surfaces import CODE, TARGET, assert_cli_generates
from test_mtp_decode import reference

OTHER = [(t * 11 + 5) % 60 + 2 for t in range(14)]


def _row(row_id, history):
    return SimpleNamespace(row_id=row_id, history=history, acceptor=GreedyMatch(), processors=None)


class _Reference:
    """The reference drafter on its own copy of the target: its target cache and its drafter caches
    (one for `propose`, one for the logits), fed as its generation loop feeds them."""

    def __init__(self, ref_module, target, path, monkeypatch):
        monkeypatch.setattr(ref_module, "snapshot_download", lambda *a, **k: str(path))
        self.ref = ref_module.load_draft("local").bind(target)
        assert type(self.ref).__name__ == "DFlash2DraftModel"
        ref_module._patch_model(target, self.ref.config.target_layer_ids)
        self.target = target
        self.tcache = make_prompt_cache(target)
        self.caches = self.ref.make_cache(), self.ref.make_cache()

    def forward(self, tokens):
        self.target(mx.array(tokens)[None], self.tcache)
        self.hidden = mx.concatenate(self.target._hidden_states, axis=-1)

    def draft(self, pending, mask, width):
        """(the reference's proposed tokens [width], its logits [1, width, V]) of the next block."""
        block = mx.array([[pending] + [mask] * width])
        tokens, _, _ = self.ref.propose(block, self.hidden, self.caches[0], 0.0, logits_start=1)
        return tokens[0].tolist(), self.ref(block, self.hidden, self.caches[1], logits_start=1)


@pytest.mark.parametrize("family", ("llama", "qwen3_5"))
def test_a_published_dflash2_checkpoint_drafts_what_the_reference_drafts(family, ref_module, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    mine = models.build(family)
    path = write_checkpoint(mine, tmp_path / "d", seed=1, layers=2, block_size=6, dflash2=True)
    stored = mx.load(str(path / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in stored  # published bare, as the reference reads it
    assert "layers.1.mlp_conv.base_kernel" in stored and "layers.0.attention_conv.kernel_projection.weight" in stored
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert all(n in config["dflash_config"] for n in _DFLASH2_SIZES)
    drafter = load_dflash(path, mine)
    mask, W = drafter.cfg.mask_token_id, 5
    refs = [_Reference(ref_module, models.build(family), path, monkeypatch) for _ in (PROMPT, OTHER)]

    # ours: each row's runtime segment fed by its forwards, the rows taken from them, drafted together
    dfl = DFlash(drafter)
    for i, (prompt, ref) in enumerate(zip((PROMPT, OTHER), refs)):
        rt = Runtime(mine, dflash=drafter)
        rt.forward(prompt[:-1])
        dfl.add(i, prompt, rt, None)
        ref.forward(prompt[:-1])
    histories = [list(PROMPT), list(OTHER)]
    overruled = 0
    for kept in ([9, 4], [13]):  # two rounds: the verifies kept these tokens after each row's pending one
        want = [ref.draft(h[-1], mask, W) for h, ref in zip(histories, refs)]
        alone = dfl.draft([_row(0, histories[0])], [W]).tokens.tolist()[0]  # one row: no padding
        dfl.rollback()
        got = dfl.draft([_row(i, h) for i, h in enumerate(histories)], [W, W]).tokens.tolist()  # padded contexts
        dfl.rollback()
        assert alone == want[0][0]
        for i, (h, (tokens, logits), g) in enumerate(zip(histories, want, got)):
            keys, values = dfl.rows[i].context()
            mine_logits = drafter.block(mx.array([[h[-1]] + [mask] * W]), keys, values, len(h) - 1)
            assert mx.allclose(mine_logits, logits, atol=1e-5).item()
            assert g == tokens
            overruled += g != mx.argmax(logits, axis=-1)[0].tolist()
        fed = [h[-1:] + kept for h in histories]
        hidden = []
        for ref, h, f in zip(refs, histories, fed):  # stands for the verifies: the rows' tapped outputs
            ref.forward(f)
            rt = Runtime(mine)
            rt.forward(h[:-1])
            rt.forward(f)
            hidden.append(dfl.tap.take())
        dfl.close([_row(i, h) for i, h in enumerate(histories)], [len(f) for f in fed],
                  (mx.concatenate(hidden, axis=0), [0, 1]))
        histories = [h + kept + [7] for h in histories]
    assert overruled  # the selector chose other tokens than the positions' argmax somewhere


def test_dflash2_configs_that_do_not_fit_are_refused_naming_the_field(tmp_path):
    model = models.build("qwen3_5")
    path = write_checkpoint(model, tmp_path / "d", dflash2=True)
    config = json.loads((path / "config.json").read_text())
    for field, value, said in (("conv_group_size", 24, "does not divide hidden_size 64"),
                               ("selector_top_k", 65, "exceeds the vocabulary 64"),
                               ("conv_kernel_size", None, "without dflash_config.conv_kernel_size")):
        bad = json.loads(json.dumps(config))
        if value is None:
            del bad["dflash_config"][field]
        else:
            bad["dflash_config"][field] = value
        (path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(UnsupportedModelError, match=said):
            load_dflash(path, model)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="hidden size 64 for a target of hidden size 32"):
        load_dflash(path, models.build("qwen3_5", hidden_size=32))
    with pytest.raises(UnsupportedModelError, match="vocabulary 64 for a target of vocabulary 80"):
        load_dflash(path, models.build("qwen3_5", vocab_size=80))
    v1 = load_dflash(write_checkpoint(model, tmp_path / "v1"), model)
    assert drafter_identity(load_dflash(path, model)) != drafter_identity(v1)


def test_a_quantized_dflash2_checkpoint_loads_quantized_and_drafts_as_written(tmp_path):
    model = models.build("qwen3_5")
    cfg = tiny_config(model, dflash2=True)
    module = random_module(cfg, seed=8)
    nn.quantize(module, group_size=32, bits=8, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    cfg.quantization = {"group_size": 32, "bits": 8}
    path = save_dflash(module, cfg, tmp_path / "q")
    loaded, _ = read_module(path)
    assert isinstance(loaded.layers[0].attention_conv.kernel_projection, nn.QuantizedLinear)
    assert isinstance(loaded.candidate_selector.hidden_projection, nn.QuantizedLinear)
    want, got = dict(tree_flatten(module.parameters())), dict(tree_flatten(loaded.parameters()))
    assert want.keys() == got.keys() and all(mx.array_equal(want[k], got[k]).item() for k in want)
    tk = test_tokenizer.tokenizer(eos=False)
    plain = reference(model, PROMPT, 10)
    out = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=10, dflash=str(path))]
    assert out == plain


def _blind2(model, tmp_path, want: dict):
    """A blind DFlash2 drafter (each masked position's logits are the head's of the mask embedding,
    so draft j = the selector's choice after draft j-1) whose mask makes the selector's choices
    follow the most pairs of consecutive tokens of the `want` continuations."""
    path = write_checkpoint(model, tmp_path / "blind2", seed=3, blind=True, block_size=4, dflash2=True)
    drafter = load_dflash(path, model)
    pairs = [(a, b) for w in want.values() for a, b in zip(w, w[1:])]
    prev = mx.array([a for a, _ in pairs])
    h = drafter.module.norm(drafter.embed(mx.arange(drafter.cfg.vocab_size)))  # [V, H]: h of each mask
    lp = normalize(drafter.logits(h))
    proj = drafter.selector.project(h)
    hits = []
    for m in range(drafter.cfg.vocab_size):
        rows = mx.broadcast_to(lp[m], (len(pairs), lp.shape[-1]))
        projected = mx.broadcast_to(proj[m], (len(pairs), proj.shape[-1]))
        nxt = mx.argmax(drafter.selector.rescore(rows, projected, prev), -1)
        hits.append(sum(int(n) == b for n, (_, b) in zip(nxt.tolist(), pairs)))
    drafter.cfg.mask_token_id = max(range(len(hits)), key=hits.__getitem__)
    assert max(hits) > 0
    return drafter


@pytest.mark.parametrize("target", ("llama", "qwen3_5", "qwen3_next"))
def test_greedy_dflash2_one_row_and_batched_with_late_joins_equals_plain_greedy(target, tmp_path):
    model = models.build(target)
    prompts = [PROMPT, PROMPT[:5], [3, 4, 3, 4, 3, 4, 3]]
    n = 12
    want = {i: reference(model, p, n) for i, p in enumerate(prompts)}
    drafter = _blind2(model, tmp_path, want)
    tk = test_tokenizer.tokenizer(eos=False)
    accepted = 0
    for i, p in enumerate(prompts):
        one = list(stream_generate(model, tk, p, max_tokens=n, dflash=drafter, adaptive=False))
        assert [r.token for r in one] == want[i]
        accepted += sum(r.from_draft for r in one)
    assert accepted > 0  # some rounds kept drafts
    for gate in (False, True):
        dec = make_decoder(model, dflash=drafter, gate=gate, adaptive=False)
        assert _run_batched(dec, model, prompts, late=(1,), n=n) == want, gate


def test_processors_shape_every_position_the_selector_rescores(tmp_path):
    """Penalties and a logit bias at every drafted position, before the selector picks among its
    candidates: greedy DFlash2 tokens are plain decoding's with the same processors."""
    model = models.build("qwen3_5")
    tk = test_tokenizer.tokenizer(eos=False)
    procs = lambda: make_processors(vocab_size=models.VOCAB, repetition_penalty=1.5,  # noqa: E731
                                    logit_bias={7: 3.0, 11: -2.0})
    want = [r.token for r in stream_generate(model, tk, PROMPT, max_tokens=12, processors=procs())]
    drafter = _blind2(model, tmp_path, {0: want})
    got = list(stream_generate(model, tk, PROMPT, max_tokens=12, processors=procs(), dflash=drafter, adaptive=False))
    assert [r.token for r in got] == want




def test_dflash2_sampling_matches_the_target_distribution(tmp_path):
    """The first drafted token is drawn from the selector's q (its candidates after the pending
    token); exact speculative sampling makes the emitted token the target's whatever q is."""
    model = models.build("qwen3_5")
    prompt = [5, 17, 33, 2, 40, 11, 9]
    p = mx.softmax(model(mx.array(prompt)[None])[0, -1]).tolist()
    path = write_checkpoint(model, tmp_path / "q", seed=4, blind=True, block_size=3, dflash2=True, top_k=32)
    drafter = load_dflash(path, model)
    V = drafter.cfg.vocab_size
    h = drafter.module.norm(drafter.embed(mx.arange(V)))
    lp = normalize(drafter.logits(h))
    qs = mx.exp(drafter.selector.rescore(lp, drafter.selector.project(h), mx.full((V,), prompt[-1])))
    overlap = mx.minimum(qs, mx.array(p)[None]).sum(-1).tolist()
    mask = min(range(V), key=lambda m: abs(overlap[m] - 0.5))
    drafter.cfg.mask_token_id = mask
    q, accept = qs[mask].tolist(), overlap[mask]
    assert 0.2 < accept < 0.8
    counts, from_draft = sampled_first_tokens(model, drafter, prompt, seed=5)
    assert_exact(counts, from_draft, p, accept, q)


def test_the_surfaces_take_a_dflash2_directory(tmp_path, capsys):
    """`segcache generate --dflash DIR` and a `--draft-model DIR` recognised from its config, and
    `generate(..., dflash=DIR)`, on the shipped target: mlx-lm's greedy text."""
    model, tok = mlx_lm.load(str(TARGET))
    path = write_checkpoint(model, tmp_path / "d2", seed=7, block_size=4, dflash2=True)
    expected = mlx_lm.generate(model, tok, CODE[:300], max_tokens=16)
    assert generate(model, tok, CODE[:300], max_tokens=16, dflash=str(path)) == expected
    assert_cli_generates(path, expected, capsys)
