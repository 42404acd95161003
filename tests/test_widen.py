"""The widened target computes the shipped target's function: same text, same residual stream.

What is bit-exact and what is not: appended layers add exact zeros (zero output projections),
so the residual stream they pass on is the one they got, bit for bit, and a widening by layers
alone gives the source's logits bit for bit. Wider MLPs add exact zeros too, but their
down_proj sums over more terms, and the BLAS groups the same nonzero terms otherwise in a longer
reduction: the logits move by float32 rounding (~1e-5), with the same argmax and greedy text.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from segcache.dflash import load_dflash, tap
from segcache.errors import ModelError
from segcache.generation import stream_generate
from segcache.mtp import forward_with_hidden, load_head
from segcache.testing.widen import widen_target

MODELS = Path(segcache.__file__).parent / "models"
SOURCE = MODELS / "target"
LAYERS, WIDTH = 6, 1024  # small enough to build and run in well under a second
ROUNDING = 1e-4  # logits' absolute difference a longer MLP reduction may give (seen: 1e-5)


@pytest.fixture(scope="module")
def source():
    return mlx_lm.load(str(SOURCE))


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    return widen_target(SOURCE, tmp_path_factory.mktemp("wide"), layers=LAYERS, intermediate_size=WIDTH, seed=3)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """Widened by layers only: the MLPs keep their width, so every reduction is the source's."""
    return widen_target(SOURCE, tmp_path_factory.mktemp("deep"), layers=LAYERS, intermediate_size=768, seed=3)


@pytest.fixture(scope="module")
def prompt(source):
    text = (MODELS / "heldout_stdlib.txt").read_text()[:400]
    return mx.array(source[1].encode(text))[None]


def _outputs(model, prompt, layer_ids):
    """(logits, final hidden, the outputs of `layer_ids`) of one forward over `prompt`."""
    recorder = tap.install(model, tuple(layer_ids))
    try:
        logits, hidden = forward_with_hidden(model, prompt)
        states = recorder.take()
        mx.eval(logits, hidden, states)
    finally:
        tap.uninstall(model)
    return logits, hidden, mx.split(states, len(layer_ids), axis=-1)


def test_layers_alone_keep_the_logits_bit_exact(source, deep_dir, prompt):
    deep, _ = mlx_lm.load(str(deep_dir))
    logits, hidden, (one, three) = _outputs(source[0], prompt, (1, 3))
    deep_logits, deep_hidden, (deep_one, deep_three) = _outputs(deep, prompt, (1, 3))
    assert mx.array_equal(logits, deep_logits)
    assert mx.array_equal(hidden, deep_hidden)
    # DFlash taps layers 1 and 3: the appended layers leave what those indices mean untouched
    assert mx.array_equal(one, deep_one) and mx.array_equal(three, deep_three)


def test_appended_layers_pass_the_residual_stream_bit_exact(wide_dir, prompt):
    wide, _ = mlx_lm.load(str(wide_dir))
    last_source, last = 3, LAYERS - 1
    _, _, (entering, leaving) = _outputs(wide, prompt, (last_source, last))
    assert mx.array_equal(entering, leaving)


def test_wide_mlps_round_alike_and_greedy_text_is_the_same(source, wide_dir, prompt):
    wide, tokenizer = mlx_lm.load(str(wide_dir))
    logits, _, _ = _outputs(source[0], prompt, (1,))
    wide_logits, _, _ = _outputs(wide, prompt, (1,))
    assert mx.abs(logits - wide_logits).max().item() < ROUNDING
    assert mx.array_equal(logits.argmax(-1), wide_logits.argmax(-1))
    text = (MODELS / "heldout_stdlib.txt").read_text()[:400]
    want = mlx_lm.generate(source[0], source[1], text, max_tokens=32, verbose=False)
    assert mlx_lm.generate(wide, tokenizer, text, max_tokens=32, verbose=False) == want


def test_widened_mtp_head_drafts_what_the_shipped_head_drafts(source, wide_dir, deep_dir, prompt):
    model = source[0]
    _, hidden = forward_with_hidden(model, prompt)
    following = prompt[:, 1:]
    want, _ = load_head(model, SOURCE)(hidden[:, :-1], following)
    for directory, exact in ((deep_dir, True), (wide_dir, False)):
        other, _ = mlx_lm.load(str(directory))
        _, other_hidden = forward_with_hidden(other, prompt)
        head = load_head(other, directory)
        assert head.module.layers[0].mlp.down_proj.weight.shape[1] == json.loads(
            (directory / "config.json").read_text())["intermediate_size"]
        got, _ = head(other_hidden[:, :-1], following)
        if exact:
            assert mx.array_equal(got, want)
        else:
            assert mx.abs(got - want).max().item() < ROUNDING * 10  # a float16 head: coarser rounding
            assert mx.array_equal(got.argmax(-1), want.argmax(-1))


def _drafted(model, tokenizer, prompt, directory, kind):
    """(tokens, how many came from drafts) of 32 greedy tokens drafted by the shipped `kind`."""
    drafter = load_dflash(MODELS / "dflash", model) if kind == "dflash" else load_head(model, directory)
    try:
        out = list(stream_generate(model, tokenizer, prompt[0].tolist(), max_tokens=32, adaptive=False,
                                   **{kind: drafter}))
    finally:
        tap.uninstall(model)
    return [r.token for r in out], sum(r.from_draft for r in out)


@pytest.mark.parametrize("kind", ("dflash", "mtp"))
def test_the_shipped_drafters_draft_for_the_wide_target_as_for_the_shipped(source, deep_dir, wide_dir, prompt,
                                                                           kind):
    want, accepted = _drafted(*source, prompt, SOURCE, kind)
    assert accepted > 0  # the drafters are trained for this target: a test that can tell
    deep, tokenizer = mlx_lm.load(str(deep_dir))
    # layers alone: every state a drafter reads is the source's, so it drafts and keeps the same
    assert _drafted(deep, tokenizer, prompt, deep_dir, kind) == (want, accepted)
    wide, tokenizer = mlx_lm.load(str(wide_dir))
    got, wide_accepted = _drafted(wide, tokenizer, prompt, wide_dir, kind)
    assert got == want and abs(wide_accepted - accepted) <= 2  # rounding may flip a near-tie draft


def test_added_weights_are_real_work_and_recorded(wide_dir):
    config = json.loads((wide_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == LAYERS and config["intermediate_size"] == WIDTH
    assert config["segcache_widened"]["seed"] == 3 and config["segcache_widened"]["source_layers"] == 4
    weights = mx.load(str(wide_dir / "model.safetensors"))
    prefix = "language_model.model.layers."
    for index in range(4, LAYERS):
        kind = "self_attn.o_proj" if (index + 1) % 2 == 0 else "linear_attn.out_proj"
        assert not mx.any(weights[f"{prefix}{index}.{kind}.weight"]).item()
        assert not mx.any(weights[f"{prefix}{index}.mlp.down_proj.weight"]).item()
        # the rest is drawn, not zero: the layer costs what a trained one does
        assert mx.all(weights[f"{prefix}{index}.mlp.gate_proj.weight"] != 0).item()
    assert not mx.any(weights[f"{prefix}0.mlp.down_proj.weight"][:, 768:]).item()
    assert mx.all(weights[f"{prefix}0.mlp.up_proj.weight"][768:] != 0).item()
    assert (wide_dir / "tokenizer.json").read_bytes() == (SOURCE / "tokenizer.json").read_bytes()


def test_same_seed_same_bytes_other_seed_other_weights(wide_dir, tmp_path):
    again = widen_target(SOURCE, tmp_path / "again", layers=LAYERS, intermediate_size=WIDTH, seed=3)
    other = widen_target(SOURCE, tmp_path / "other", layers=LAYERS, intermediate_size=WIDTH, seed=4)
    assert (again / "model.safetensors").read_bytes() == (wide_dir / "model.safetensors").read_bytes()
    assert (again / "mtp.safetensors").read_bytes() == (wide_dir / "mtp.safetensors").read_bytes()
    name = "language_model.model.layers.5.mlp.up_proj.weight"
    a, b = mx.load(str(wide_dir / "model.safetensors"))[name], mx.load(str(other / "model.safetensors"))[name]
    assert not mx.array_equal(a, b)


def test_a_widening_only_adds(tmp_path):
    with pytest.raises(ModelError, match="only adds"):
        widen_target(SOURCE, tmp_path, layers=2)
    with pytest.raises(ModelError, match="only adds"):
        widen_target(SOURCE, tmp_path, intermediate_size=512)


def test_parameters_grow_as_asked(wide_dir, source):
    wide, _ = mlx_lm.load(str(wide_dir))
    count = lambda m: sum(v.size for _, v in tree_flatten(m.parameters()))  # noqa: E731
    # 4 widened MLPs of 3 * 256 * 256 more, and 2 appended layers of the source's kinds at MLP 1024
    grown = count(wide) - count(source[0])
    assert grown > 4 * 3 * 256 * (WIDTH - 768) + 2 * 3 * 256 * WIDTH


def test_quantized_wide_target_computes_the_quantized_source(wide_dir, tmp_path, prompt):
    """4-bit copies: the zero groups quantize to zeros, and the quantized product sums group by group,
    so here even the wider MLPs give the quantized source's logits bit for bit."""
    from segcache.testing.widen import quantize_target

    wide, _ = mlx_lm.load(str(quantize_target(wide_dir, tmp_path / "wide-q4")))
    small, _ = mlx_lm.load(str(quantize_target(SOURCE, tmp_path / "source-q4")))
    assert json.loads((tmp_path / "wide-q4" / "config.json").read_text())["quantization"]["bits"] == 4
    logits, _ = forward_with_hidden(wide, prompt)
    want, _ = forward_with_hidden(small, prompt)
    assert mx.array_equal(logits, want)
    head = load_head(wide, tmp_path / "wide-q4")
    assert head.module.layers[0].mlp.down_proj.bits == 4


def test_a_spelled_out_layer_pattern_is_extended_alike(tmp_path):
    """Hugging Face qwen3_5 configs list `layer_types`; the appended layers' kinds join the list."""
    source = tmp_path / "source"
    source.mkdir()
    config = json.loads((SOURCE / "config.json").read_text())
    config["layer_types"] = ["linear_attention", "full_attention"] * 2
    (source / "config.json").write_text(json.dumps(config))
    (source / "model.safetensors").symlink_to(SOURCE / "model.safetensors")
    out = json.loads((widen_target(source, tmp_path / "out", layers=6, intermediate_size=768) / "config.json").read_text())
    assert out["layer_types"] == ["linear_attention", "full_attention"] * 3
