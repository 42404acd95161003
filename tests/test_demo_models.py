"""The shipped demo models load with mlx_lm and reproduce their recorded held-out numbers."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import eval_demo  # noqa: E402

MODELS_DIR = eval_demo.MODELS_DIR
MODEL_NAMES = ("target", "draft")
LOSS_TOLERANCE = 2e-3  # nats/token; covers BLAS/summation-order differences
MAX_UNIGRAM_RATIO = 0.9
MAX_TOTAL_BYTES = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def record():
    return eval_demo.load_training_record()


@pytest.fixture(scope="module")
def loaded():
    return {name: eval_demo.load_demo_model(name) for name in MODEL_NAMES}


@pytest.fixture(scope="module")
def recomputed(loaded, record):
    max_tokens = record["eval"]["max_tokens"]
    return {
        name: eval_demo.evaluate_model(model, tokenizer, max_tokens=max_tokens)
        for name, (model, tokenizer) in loaded.items()
    }


def test_package_files_present_and_small():
    total = 0
    for name in MODEL_NAMES:
        directory = MODELS_DIR / name
        for required in ("config.json", "model.safetensors", "tokenizer.json",
                         "tokenizer_config.json"):
            assert (directory / required).is_file(), f"{name}/{required} missing"
        config = json.loads((directory / "config.json").read_text())
        assert "eos_token_id" in config
        total += sum(f.stat().st_size for f in directory.iterdir())
    assert total <= MAX_TOTAL_BYTES
    for text_file in eval_demo.HELDOUT_FILES.values():
        assert (MODELS_DIR / text_file).stat().st_size <= 100 * 1024


def test_target_is_hybrid_and_draft_is_dense(loaded):
    target, _ = loaded["target"]
    draft, _ = loaded["draft"]
    kinds = [layer.is_linear for layer in target.layers]
    assert any(kinds) and not all(kinds), "target must mix Gated DeltaNet and attention"
    assert target.model_type == "qwen3_5"
    assert draft.model_type in ("llama", "qwen3")
    target_params = sum(v.size for _, v in tree_flatten(target.parameters()))
    draft_params = sum(v.size for _, v in tree_flatten(draft.parameters()))
    assert draft_params < target_params / 2


def test_tokenizers_agree_and_round_trip(loaded):
    text = eval_demo.read_heldout_text("other")[:5000]
    target_ids = loaded["target"][1].encode(text, add_special_tokens=False)
    draft_ids = loaded["draft"][1].encode(text, add_special_tokens=False)
    assert list(target_ids) == list(draft_ids)
    assert loaded["target"][1].decode(target_ids) == text
    assert loaded["target"][1].eos_token_id == loaded["draft"][1].eos_token_id


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("which", sorted(eval_demo.HELDOUT_FILES))
def test_heldout_loss_beats_unigram_and_matches_record(name, which, recomputed, record):
    numbers = recomputed[name][which]
    recorded = record["models"][name]["heldout"][which]
    assert numbers["tokens"] == recorded["tokens"] == record["eval"]["max_tokens"]
    assert math.isclose(numbers["unigram_entropy_nats_per_token"],
                        recorded["unigram_entropy_nats_per_token"], abs_tol=1e-9)
    assert math.isclose(numbers["loss_nats_per_token"], recorded["loss_nats_per_token"],
                        abs_tol=LOSS_TOLERANCE)
    assert numbers["loss_nats_per_token"] <= (
        MAX_UNIGRAM_RATIO * numbers["unigram_entropy_nats_per_token"])


def test_target_beats_draft_in_distribution(recomputed):
    assert (recomputed["target"]["stdlib"]["loss_nats_per_token"]
            < recomputed["draft"]["stdlib"]["loss_nats_per_token"])


def test_greedy_agreement_recorded(record):
    for which in eval_demo.HELDOUT_FILES:
        agreement = record["greedy_agreement"][which]
        assert 0.0 <= agreement["rate"] <= 1.0
        assert agreement["positions"] == agreement["prompts"] * agreement["new_tokens"]


def test_generation_runs_with_cache(loaded):
    from mlx_lm import generate

    model, tokenizer = loaded["target"]
    text = generate(model, tokenizer, prompt="def main():\n", max_tokens=8)
    assert isinstance(text, str)
    mx.clear_cache()
