"""LoRA adapters (--adapter-path) on the shipped target, made here with mlx-lm's LoRA utilities (issue 25).

References: `mlx_lm.generate --adapter-path` (its own main) for the text; the
store must never resume a prefix computed with one adapter under another
adapter, another scale, or none, and must resume it under the same adapter.
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import contextlib
import importlib
import io
import json
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import save_config

from segcache import Runtime, open_store
from segcache.cli import main as segcache_main
from segcache.demo import MODELS_DIR
from segcache.store import model_identity

TARGET = str(MODELS_DIR / "target")
PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"


def make_adapter(path, *, seed: int, scale: float, rank: int = 4, dora: bool = False) -> str:
    """An adapter directory as `mlx_lm.lora` writes one: its config and the trainable (adapter) weights.

    LoRA's B starts at zero (the update is then nothing); a seeded normal B stands in for training.
    """
    model, _ = mlx_lm.load(TARGET)
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    mx.random.seed(seed)  # A's initialization too: the same seed gives the same weights
    linear_to_lora_layers(model, len(model.layers), params, use_dora=dora)
    for _, module in model.named_modules():
        if "lora_b" in module:
            module.lora_b = 0.05 * mx.random.normal(module.lora_b.shape)
    path.mkdir()
    mx.save_safetensors(str(path / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    save_config({"fine_tune_type": "dora" if dora else "lora", "num_layers": len(model.layers),
                 "lora_parameters": params}, path / "adapter_config.json")
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    same_weights_other_scale = make_adapter(root / "a_scale", seed=1, scale=4.0)
    return {
        "a": make_adapter(root / "a", seed=1, scale=8.0),
        "b": make_adapter(root / "b", seed=2, scale=8.0),
        "a_scale": same_weights_other_scale,
        "dora": make_adapter(root / "dora", seed=1, scale=8.0, dora=True),
    }


def mlx_generate(argv) -> str:
    out = io.StringIO()
    saved = sys.argv
    sys.argv = ["mlx_lm.generate", *argv]
    try:
        with contextlib.redirect_stdout(out):
            importlib.import_module("mlx_lm.generate").main()
    finally:
        sys.argv = saved
    return out.getvalue()


def segcache_generate(argv, capsys) -> str:
    capsys.readouterr()
    code = segcache_main(["generate", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_adapter_text_equals_mlx_lm(adapters, capsys):
    base = ["--model", TARGET, "--prompt", PROMPT, "--max-tokens", "24", "--verbose", "False"]
    plain = mlx_generate(base)
    for name in ("a", "dora"):
        argv = base + ["--adapter-path", adapters[name]]
        want = mlx_generate(argv)
        assert want != plain  # the adapter changes the text, so the comparison can fail
        assert segcache_generate(argv, capsys) == want
        assert segcache_generate(argv + ["--prompt-lookup"], capsys) == want
        assert segcache_generate(argv + ["--draft-model", str(MODELS_DIR / "draft")], capsys) == want


def test_identity_holds_the_adapter_whole(adapters):
    base = model_identity(mlx_lm.load(TARGET)[0])
    ids = {name: model_identity(mlx_lm.load(TARGET, adapter_path=path)[0]) for name, path in adapters.items()}
    a, a_scale = (mx.load(str(adapters[n]) + "/adapters.safetensors") for n in ("a", "a_scale"))
    assert all(mx.array_equal(a[k], a_scale[k]).item() for k in a)  # the same weights, another scale
    assert len({base, *ids.values()}) == 1 + len(adapters)  # scale alone is enough to differ
    assert model_identity(mlx_lm.load(TARGET, adapter_path=adapters["a"])[0]) == ids["a"]  # a reload: the same


def _resumed(model, store, ids) -> int:
    steps = Runtime(model, store=store).prefill_steps(ids)
    first = next(steps).restored
    steps.close()
    return first


def test_no_resume_across_adapters(adapters, tmp_path):
    model_a, tok = mlx_lm.load(TARGET, adapter_path=adapters["a"])
    ids = list(tok.encode(PROMPT * 3))
    with open_store(tmp_path / "store") as store:
        Runtime(model_a, store=store).prefill(ids)
        longer = ids + list(tok.encode("    return parser"))
        assert _resumed(mlx_lm.load(TARGET, adapter_path=adapters["a"])[0], store, longer) == len(ids)
        for other in (mlx_lm.load(TARGET)[0], *(mlx_lm.load(TARGET, adapter_path=adapters[n])[0]
                                               for n in ("b", "a_scale", "dora"))):
            assert _resumed(other, store, longer) == 0
    # and through the command: a run with adapter b after one with a resumes nothing
    # (mlx-lm itself has no prefix store to compare with: the texts are checked above)


def test_cli_store_keeps_adapters_apart(adapters, tmp_path, capsys):
    cache = str(tmp_path / "apc")
    base = ["--model", TARGET, "--prompt", PROMPT, "--max-tokens", "8", "--prompt-cache-dir", cache]

    def resumed(argv):
        capsys.readouterr()
        assert segcache_main(["generate", *argv]) == 0
        return int(capsys.readouterr().err.split("prompt cache: ")[1].split()[0])

    assert resumed(base + ["--adapter-path", adapters["a"]]) == 0
    assert resumed(base + ["--adapter-path", adapters["b"]]) == 0
    assert resumed(base) == 0
    assert resumed(base + ["--adapter-path", adapters["a"]]) > 0
