"""MTP heads: the hidden state from one forward, loading from a checkpoint's own tensors,
and `segcache mtp extract` next to an mlx-lm conversion (float and quantized).

The synthetic checkpoints are written the way the published ones are: backbone and
`mtp.*` tensors under their Hugging Face names, zero-centred RMS-norm weights, conv1d
in the (C, 1, K) layout, routed experts one tensor per expert (Qwen3-Next) or fused
(`experts.gate_up_proj`, Qwen3.5/3.6-MoE). mlx-lm's own `load` reading them back to
the model they were written from checks that writer; a plain-array reference of the
head (written from the checkpoint convention, not from segcache's module) checks
the loader.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from segcache.cli import main as cli_main
from segcache.errors import ModelError, UnsupportedModelError
from segcache.mtp import MTPHead, extract, forward_with_hidden, load_head
from segcache.mtp.weights import HEAD_FILE, checkpoint_tensors
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer

MOE = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, moe_intermediate_size=32,
           shared_expert_intermediate_size=64, norm_topk_prob=True)
CASES = {
    # name: (family, config overrides, how the checkpoint stores routed experts)
    "qwen3_5": ("qwen3_5", {}, None),
    "qwen3_5_moe": ("qwen3_5", dict(model_type="qwen3_5_moe", **MOE), "fused"),
    "qwen3_next": ("qwen3_next", {}, "per_expert"),
}
NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
         ".k_norm.weight")
HEAD_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


def target(case, seed=0):
    family, overrides, _ = CASES[case]
    return models.build(family, seed=seed, **overrides)


def random_head(model, seed=1):
    """A head for `model` with random weights; norm weights 1 + k/64 (exact after -1/+1)."""
    head = MTPHead.build(model)
    rng = np.random.default_rng(seed)
    weights = []
    for name, w in tree_flatten(head.module.parameters()):
        if w.ndim == 1:  # every norm weight
            value = 1.0 + rng.integers(-16, 17, size=w.shape) / 64.0
        else:
            value = rng.normal(0.0, 0.5 / np.sqrt(w.shape[-1]), size=w.shape)
        weights.append((name, mx.array(value.astype(np.float32))))
    head.module.load_weights(weights)
    head.module.eval()
    return head


# ------------------------------------------------------------------ checkpoint writer


def hf_backbone(case, model) -> dict:
    """The model's weights as the original checkpoint stores them (inverse of mlx-lm's sanitize)."""
    out = {}
    for key, v in tree_flatten(model.parameters()):
        if "conv1d.weight" in key:
            v = v.moveaxis(2, 1)  # mlx (C, K, 1) -> checkpoint (C, 1, K)
        if v.ndim == 1 and (key.endswith(NORMS) or key.endswith("model.norm.weight")):
            v = v - 1.0
        if case == "qwen3_next" and ".switch_mlp." in key:
            prefix, name = key.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{prefix}.experts.{e}.{name}"] = v[e]
            continue
        if case == "qwen3_5_moe" and ".switch_mlp." in key:
            prefix, name = key.split(".switch_mlp.")
            if name.startswith("gate_proj"):
                up = dict(tree_flatten(model.parameters()))[key.replace("gate_proj", "up_proj")]
                out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
            elif name.startswith("down_proj"):
                out[f"{prefix}.experts.down_proj"] = v
            continue
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model."):]
        elif key.startswith("language_model."):
            key = key[len("language_model."):]
        out[key] = v
    return out


def hf_head(case, head) -> dict:
    """The head's weights as `mtp.*` tensors of the original checkpoint."""
    out = {}
    for key, v in tree_flatten(head.module.parameters()):
        if v.ndim == 1 and (key in HEAD_NORMS or key.endswith(NORMS)):
            v = v - 1.0
        if ".switch_mlp." in key:
            prefix, name = key.split(".switch_mlp.")
            if CASES[case][2] == "per_expert":
                for e in range(v.shape[0]):
                    out[f"mtp.{prefix}.experts.{e}.{name}"] = v[e]
            elif name.startswith("gate_proj"):
                up = dict(tree_flatten(head.module.parameters()))[key.replace("gate_proj", "up_proj")]
                out[f"mtp.{prefix}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
            elif name.startswith("down_proj"):
                out[f"mtp.{prefix}.experts.down_proj"] = v
            continue
        out[f"mtp.{key}"] = v
    return out


def write_checkpoint(case, directory, model, head, shards=2):
    """An original-style checkpoint: config, tokenizer, sharded safetensors with an index."""
    directory.mkdir(parents=True, exist_ok=True)
    family, overrides, _ = CASES[case]
    text = {**models.config(family, **overrides), "mtp_num_hidden_layers": 1}
    config = {"model_type": text["model_type"], "text_config": text} if family == "qwen3_5" \
        else {**text, "num_nextn_predict_layers": 1}
    (directory / "config.json").write_text(json.dumps(config))
    test_tokenizer.save(directory)
    tensors = {**hf_backbone(case, model), **hf_head(case, head)}
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = {k: tensors[k] for k in names[i::shards]}
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(directory / file), part)
        weight_map.update({k: file for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    case = request.param
    model = target(case)
    head = random_head(model)
    directory = tmp_path_factory.mktemp(f"ckpt-{case}")
    write_checkpoint(case, directory, model, head)
    return case, directory, model, head


# ------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", list(CASES))
def test_forward_with_hidden_is_the_models_own_forward(case):
    model = target(case)
    ids = mx.array([[3, 9, 4, 17, 22, 5, 8, 30, 2, 11]])
    ref_cache, cache = make_prompt_cache(model), make_prompt_cache(model)
    for chunk in (ids[:, :7], ids[:, 7:8], ids[:, 8:]):  # prefill, then decode steps
        want = model(chunk, cache=ref_cache)
        logits, hidden = forward_with_hidden(model, chunk, cache)
        assert mx.array_equal(logits, want).item()
        inner = model.language_model if hasattr(model, "language_model") else model
        assert hidden.shape == (*chunk.shape, inner.args.hidden_size)
    # the hidden state is the input of the output head: projecting it again gives the logits
    head = inner.model.embed_tokens.as_linear if inner.args.tie_word_embeddings else inner.lm_head
    assert mx.array_equal(head(hidden), logits).item()


def test_families_without_a_head_are_refused():
    with pytest.raises(UnsupportedModelError, match="model_type 'llama'"):
        forward_with_hidden(models.build("llama"), mx.array([[1, 2]]))
    with pytest.raises(UnsupportedModelError):
        MTPHead.build(models.build("qwen3"))


def test_checkpoint_writer_matches_mlx_lm(checkpoint):
    """mlx-lm's own loader reads the synthetic checkpoint back to the model it came from."""
    import mlx_lm

    case, directory, model, _ = checkpoint
    loaded, _ = mlx_lm.load(str(directory))
    ids = mx.array([[1, 5, 9, 13, 2, 7]])
    assert mx.allclose(loaded(ids), model(ids), atol=1e-5).item()
    assert set(checkpoint_tensors(directory)) == {k[len("mtp."):] for k in hf_head(case, checkpoint[3])}


def reference_head_logits(case, tensors, model, hidden, token):
    """The head on one position without context, from the checkpoint's tensors alone.

    With a single position the attention weights are 1, so the layer's attention is
    o_proj(v * sigmoid(gate)) per head; norms scale by (1 + w) as in the checkpoint.
    """
    t = {k[len("mtp."):]: v.astype(mx.float32) for k, v in tensors.items() if k.startswith("mtp.")}
    inner = model.language_model if hasattr(model, "language_model") else model
    args = inner.args
    eps = args.rms_norm_eps

    def norm(x, w):
        return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)

    emb = inner.model.embed_tokens.weight
    x = t["fc.weight"] @ mx.concatenate([norm(emb[token], t["pre_fc_norm_embedding.weight"]),
                                         norm(hidden, t["pre_fc_norm_hidden.weight"])])
    a = norm(x, t["layers.0.input_layernorm.weight"])
    heads, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    q_and_gate = (t["layers.0.self_attn.q_proj.weight"] @ a).reshape(heads, 2 * d)
    gate = q_and_gate[:, d:]
    v = (t["layers.0.self_attn.v_proj.weight"] @ a).reshape(kv, d)
    v = mx.repeat(v, heads // kv, axis=0)
    x = x + t["layers.0.self_attn.o_proj.weight"] @ (v * mx.sigmoid(gate)).reshape(-1)
    m = norm(x, t["layers.0.post_attention_layernorm.weight"])

    def mlp(prefix, m):
        g = t[f"{prefix}.gate_proj.weight"] @ m
        return t[f"{prefix}.down_proj.weight"] @ (nn.silu(g) * (t[f"{prefix}.up_proj.weight"] @ m))

    if CASES[case][2] is None:
        x = x + mlp("layers.0.mlp", m)
    else:
        if CASES[case][2] == "per_expert":
            experts = [(t[f"layers.0.mlp.experts.{e}.gate_proj.weight"],
                        t[f"layers.0.mlp.experts.{e}.up_proj.weight"],
                        t[f"layers.0.mlp.experts.{e}.down_proj.weight"]) for e in range(args.num_experts)]
        else:
            gu, down = t["layers.0.mlp.experts.gate_up_proj"], t["layers.0.mlp.experts.down_proj"]
            half = gu.shape[1] // 2
            experts = [(gu[e, :half], gu[e, half:], down[e]) for e in range(args.num_experts)]
        probs = mx.softmax(t["layers.0.mlp.gate.weight"] @ m)
        top = np.argsort(-np.array(probs))[: args.num_experts_per_tok]
        weights = probs[mx.array(top)]
        if args.norm_topk_prob:
            weights = weights / weights.sum()
        routed = sum(w * (dn @ (nn.silu(g @ m) * (u @ m))) for w, (g, u, dn) in
                     zip(weights, [experts[i] for i in top]))
        shared = mlp("layers.0.mlp.shared_expert", m)
        x = x + routed + mx.sigmoid(t["layers.0.mlp.shared_expert_gate.weight"] @ m) * shared
    h = norm(x, t["norm.weight"])
    out = emb if args.tie_word_embeddings else inner.lm_head.weight
    return out @ h


def test_head_loaded_from_checkpoint_matches_reference(checkpoint):
    case, directory, model, head = checkpoint
    loaded = load_head(model, directory)
    assert loaded is not None and loaded.num_layers == 1
    want = dict(tree_flatten(head.module.parameters()))
    got = dict(tree_flatten(loaded.module.parameters()))
    assert want.keys() == got.keys()
    assert all(mx.array_equal(want[k], got[k]).item() for k in want)  # exact: norms are k/64
    tensors = {}
    for f in directory.glob("model-*.safetensors"):
        tensors.update(mx.load(str(f)))
    rng = np.random.default_rng(3)
    for token in (2, 17, 40):
        hidden = mx.array(rng.normal(size=(model.args.text_config["hidden_size"] if hasattr(model.args, "text_config")
                                           else model.args.hidden_size,)).astype(np.float32))
        logits, h = loaded(hidden[None, None], mx.array([[token]]))
        ref = reference_head_logits(case, tensors, model, hidden, token)
        assert mx.allclose(logits[0, 0], ref, atol=1e-4, rtol=1e-4).item()


def drafts(model, head, prompt, depth=3):
    """Greedy drafts of `depth` tokens after every prompt position but the last few, and the logits."""
    cache, head_cache = make_prompt_cache(model), head.make_cache()
    logits, hidden = forward_with_hidden(model, prompt, cache)
    next_tokens = mx.argmax(logits, axis=-1)
    # fill the head's cache with (hidden[t], token[t+1]) for t < n-1, then draft from the end
    head(hidden[:, :-1], prompt[:, 1:], head_cache)
    h, tok = hidden[:, -1:], next_tokens[:, -1:]
    out, all_logits = [], []
    for d in range(depth):
        lg, h = head(h, tok, head_cache, depth=d)
        tok = mx.argmax(lg, axis=-1)
        out.append(tok.item())
        all_logits.append(lg[0, 0])
    return out, mx.stack(all_logits)


def within_quantization(want_logits, got_logits, want, got):
    """Drafts may differ only where the reference's top-2 margin is below twice the logit error."""
    error = mx.abs(want_logits - got_logits).max().item()
    top2 = mx.sort(want_logits, axis=-1)[:, -2:]
    margins = np.array(top2[:, 1] - top2[:, 0])
    decided = margins > 2 * error
    assert all(w == g for w, g, dec in zip(want, got, decided) if dec), (want, got, margins, error)
    return decided


def test_extract_float_round_trips(checkpoint, tmp_path):
    import mlx_lm
    from mlx_lm import convert

    case, directory, model, head = checkpoint
    converted = tmp_path / "mlx"
    convert(str(directory), str(converted))
    assert not any("mtp" in k for k in mx.load(str(converted / "model.safetensors")))  # dropped
    assert cli_main(["mtp", "extract", "--from", str(directory), "--to", str(converted)]) == 0
    conv_model, _ = mlx_lm.load(str(converted))
    got_head = load_head(conv_model, converted)
    want_head = load_head(model, directory)
    prompt = mx.array([[4, 8, 15, 16, 23, 42, 7, 1, 9]])
    got, got_logits = drafts(conv_model, got_head, prompt)
    want, want_logits = drafts(model, want_head, prompt)
    assert got == want and mx.array_equal(got_logits, want_logits).item()


def test_extract_quantized_gives_the_same_drafts_within_quantization(checkpoint, tmp_path):
    import mlx_lm
    from mlx_lm import convert

    case, directory, model, _ = checkpoint
    converted = tmp_path / "mlx-q"
    convert(str(directory), str(converted), quantize=True, q_bits=8, q_group_size=32)
    assert cli_main(["mtp", "extract", "--from", str(directory), "--to", str(converted)]) == 0
    _, metadata = mx.load(str(converted / HEAD_FILE), return_metadata=True)
    q = json.loads(metadata["quantization"])
    assert (q["bits"], q["group_size"]) == (8, 32)  # the model's, from its config.json
    conv_model, _ = mlx_lm.load(str(converted))
    got_head = load_head(conv_model, converted)
    assert isinstance(got_head.module.fc, nn.QuantizedLinear)
    want_head = load_head(model, directory)
    decided = []
    for prompt in ([4, 8, 15, 16, 23, 42, 7], [1, 2, 3, 5, 8, 13, 21, 34], [9, 9, 4, 30, 12]):
        p = mx.array([prompt])
        want, want_logits = drafts(model, want_head, p)
        got, got_logits = drafts(conv_model, got_head, p)
        decided += list(within_quantization(want_logits, got_logits, want, got))
    assert sum(decided) >= len(decided) // 2, "quantization error too large for the check to bite"


def test_extract_with_explicit_bits_on_a_float_model(checkpoint, tmp_path):
    import mlx_lm
    from mlx_lm import convert

    case, directory, model, _ = checkpoint
    converted = tmp_path / "mlx-f"
    convert(str(directory), str(converted))
    done = extract(directory, converted, bits=4, group_size=32)
    assert done["quantization"]["bits"] == 4 and done["layers"] == 1
    head = load_head(mlx_lm.load(str(converted))[0], converted)
    assert isinstance(head.module.layers[0].self_attn.q_proj, nn.QuantizedLinear)


def test_mtp_weights_path_and_errors(checkpoint, tmp_path):
    case, directory, model, head = checkpoint
    shard = next(f for f in sorted(directory.glob("model-*.safetensors"))
                 if any(k.startswith("mtp.") for k in mx.load(str(f))))
    # --mtp-weights: the checkpoint directory, or a head file segcache wrote
    from_dir = load_head(model, mtp_weights=directory)
    written = tmp_path / "head.safetensors"
    from segcache.mtp import save_head

    save_head(from_dir, written)
    again = load_head(model, mtp_weights=written)
    for (k, a), (_, b) in zip(tree_flatten(from_dir.module.parameters()),
                              tree_flatten(again.module.parameters())):
        assert mx.array_equal(a, b).item(), k
    # a model directory without a head: None; an explicit path without one: a ModelError
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_head(model, empty) is None
    with pytest.raises(ModelError, match="no mtp"):
        load_head(model, mtp_weights=empty)
    # a shard alone holds only part of the head: it does not fit, and says so
    partial = {k: v for k, v in mx.load(str(shard)).items()}
    if len([k for k in partial if k.startswith("mtp.")]) < len(hf_head(case, head)):
        with pytest.raises(ModelError):
            load_head(model, mtp_weights=shard)
    # a head of another model size does not fit
    family, overrides, _ = CASES[case]
    bigger = models.build(family, **{**overrides, "hidden_size": 128})
    with pytest.raises(ModelError, match="do not fit"):
        load_head(bigger, directory)


def test_extract_cli_reports_errors(tmp_path):
    assert cli_main(["mtp", "extract", "--from", str(tmp_path / "nowhere"),
                     "--to", str(tmp_path / "nothing")]) == 2
