"""`segcache check`: passes on the shipped target, on a saved tiny model of every family
tests/test_families.py covers and on a 4-bit conversion; fails, exit 1, with a short program
that reproduces the failure when a defect is planted; refuses unsupported and too-large models.

Everything runs in this process (the defects are planted by monkeypatching segcache's layer
classes), with few examples: the default budgets are measured by hand (docs/check.md).
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import dataclasses
import json
import re

import mlx_lm.utils
import pytest
from mlx_lm.convert import convert
from mlx_lm.utils import save_config, save_model

from segcache import check, dropin
from segcache.adapters import state as hooks
from segcache.cli import main
from segcache.demo import MODELS_DIR
from segcache.layers.kv import KVLayer
from segcache.layers.offset_branches import OffsetBranches
from segcache.layers.recurrent import RecurrentLayer
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from test_families import FAMILIES, NOT_BATCHED

TARGET, DRAFT = MODELS_DIR / "target", MODELS_DIR / "draft"
# transformers validates a config before it loads the tokenizer; these tiny configs leave out a field
# mlx-lm ignores and transformers checks (hidden_size * expand == heads * head_dim)
FOR_TRANSFORMERS = {"granitemoehybrid": {"mamba_expand": 1}, "mamba2": {"expand": 1}}
# transformers 5 rejects gear's own layer type ("conv_mixer") when it loads the tokenizer, so
# mlx_lm.load cannot open a gear directory here at all: the test hands mlx-lm the tokenizer
TOKENIZER_REFUSED = {"gear"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a directory holding its tiny model as mlx-lm saves one (weights, config, tokenizer)."""
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(family):
        if family not in made:
            directory = root / family
            save_model(directory, models.build(family))
            save_config({**models.config(family), **FOR_TRANSFORMERS.get(family, {})}, directory / "config.json")
            test_tokenizer.save(directory)
            made[family] = directory
        return made[family]

    return get


def run_cli(capsys, *args):
    rc = main(["check", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_passes_on_the_shipped_target_with_every_drafter(capsys, tmp_path):
    stores = tmp_path / "stores"
    rc, out, _ = run_cli(capsys, "--model", TARGET, "--draft-model", DRAFT, "--examples", 3, "--store-dir", stores)
    assert rc == 0, out
    for name in check.PROPERTIES:  # none skipped: it batches, and has a draft and an MTP head
        assert re.search(rf"^  {re.escape(name)} +pass +\d+ examples +[\d.]+ s", out, re.M), (name, out)
    assert "verdict: PASS: 6 properties hold, 0 skipped" in out
    assert stores.is_dir() and not any(stores.iterdir()), "the temporary stores are removed"


@pytest.mark.parametrize("family", FAMILIES)
def test_passes_on_a_saved_tiny_model_of_every_family(saved, family, monkeypatch):
    if family in TOKENIZER_REFUSED:
        monkeypatch.setattr(mlx_lm.utils, "load_tokenizer", lambda *a, **k: test_tokenizer.tokenizer())
    subject = check.load(str(saved(family)))
    # two examples of 8 steps a property: what the command runs, smaller (test_families.py goes deep)
    budget = dataclasses.replace(check.budget_for(subject, examples=2), steps=8)
    results = {r.name: r for r in check.run(subject, budget, seed=1)}
    assert list(results) == list(check.PROPERTIES)
    for r in results.values():
        assert r.status in ("pass", "skip"), (family, r)
    assert (results["batch"].status == "skip") == (family in NOT_BATCHED)
    assert results["speculative: prompt lookup"].status == "pass"
    assert results["speculative: draft model"].detail == "no --draft-model given"


def test_passes_on_a_4_bit_conversion_and_json_lists_every_property(saved, capsys, tmp_path):
    quantized = tmp_path / "qwen3_5-4bit"
    convert(str(saved("qwen3_5")), str(quantized), quantize=True, q_bits=4, q_group_size=32)
    capsys.readouterr()
    rc, out, _ = run_cli(capsys, "--model", quantized, "--examples", 3, "--json")
    report = json.loads(out)
    assert rc == 0 and report["verdict"] == "pass", out
    assert report["quantization"] == "4-bit" and report["family"] == "qwen3_5"
    assert [p["name"] for p in report["properties"]] == list(check.PROPERTIES)
    statuses = {p["name"]: p["status"] for p in report["properties"]}
    assert statuses == {"runtime": "pass", "batch": "pass", "store": "pass", "speculative: prompt lookup": "pass",
                        "speculative: draft model": "skip", "speculative: MTP head": "skip"}
    assert all(p["examples"] >= 3 for p in report["properties"] if p["status"] == "pass")


def _kv_commits_one_too_many(monkeypatch):
    def commit(self, n):
        OffsetBranches.commit(self, n)
        if n:
            self.offset += 1

    monkeypatch.setattr(KVLayer, "commit", commit)


def _recurrent_commit_drops_the_conv_slot(monkeypatch):
    rebuild = RecurrentLayer._commit_prefix

    def commit_prefix(self, mark, n):
        rebuild(self, mark, n)
        if n:
            self.cache = [mark.conv, self.cache[1]]  # slot 0 (conv tail) left as it was before the branch

    monkeypatch.setattr(RecurrentLayer, "_commit_prefix", commit_prefix)


@pytest.mark.parametrize("defect", [_kv_commits_one_too_many, _recurrent_commit_drops_the_conv_slot])
def test_a_planted_defect_fails_with_a_short_program_that_reproduces_it(saved, capsys, monkeypatch, defect):
    model = str(saved("qwen3_5"))
    monkeypatch.setattr(check, "SHRINK_SECONDS", 3)  # a shorter shrinking pass: the test's time
    with monkeypatch.context() as planted:
        defect(planted)
        rc, out, _ = run_cli(capsys, "--model", model, "--examples", 20, "--json")
        report = json.loads(out)
        assert rc == 1 and report["verdict"] == "fail", out
        failed = [p for p in report["properties"] if p["status"] == "fail"]
        assert [p["name"] for p in failed] == ["runtime"]  # the lowest floor fails first; the rest are not run
        assert [p["status"] for p in report["properties"][1:]] == ["not run"] * 5
        program = failed[0]["program"]
        assert 1 <= failed[0]["calls"] <= 5, program
        assert sum(line.startswith("state.") and line != "state.teardown()" for line in program) == failed[0]["calls"]
        with pytest.raises(AssertionError):  # the program, pasted, fails the same way
            exec("\n".join(program), {})
        rc, out, _ = run_cli(capsys, "--model", model, "--examples", 20)
        assert rc == 1 and "verdict: FAIL: runtime" in out and "shrunk counterexample (" in out
        assert "state = check.machine('runtime', " in out and f"reproduce: segcache check --model {model}" in out
    exec("\n".join(program), {})  # and runs clean without the defect


def test_an_unsupported_layer_is_named_with_what_to_do(saved, capsys, monkeypatch):
    directory = saved("nemotron_h")
    monkeypatch.setattr(hooks, "_by_class", {h.module_class: h for h in hooks.HOOKS if h.family != "nemotron_h"})
    rc, out, err = run_cli(capsys, "--model", directory)
    assert rc == 2 and out == ""
    assert "not supported: the model at " in err and ": layer 0 (" in err and "uses ArraysCache" in err
    assert "what to do:" in err and "segcache/adapters/state.py" in err
    rc, out, _ = run_cli(capsys, "--model", directory, "--json")
    report = json.loads(out)
    assert rc == 2 and report["verdict"] == "refused" and "layer 0" in report["error"]


def test_a_model_too_large_for_memory_is_refused_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(check, "memory", lambda: (8 << 20, 16 << 30))
    monkeypatch.setattr(dropin, "load", lambda *a, **k: pytest.fail("loaded a model too large for memory"))
    rc, out, err = run_cli(capsys, "--model", TARGET, "--draft-model", DRAFT)
    assert rc == 2 and out == ""
    weights = check.weight_bytes(TARGET) + check.weight_bytes(DRAFT)
    need = int(weights * check.MEMORY_HEADROOM) + check.MEMORY_SLACK
    assert f"needs about {need / (1 << 20):.1f} MiB" in err and "but 8.0 MiB of 16.00 GiB is available" in err
    assert "the model at segcache/models/target" in err and "the draft at segcache/models/draft" in err
    assert "nothing was loaded" in err


def test_budgets_scale_with_the_weights_and_examples_overrides(saved):
    subject = check.load(str(saved("gemma3_text")))  # a sliding window of 8 tokens
    small = check.budget_for(subject)
    assert small.scale == 1 and small.examples == check.BASE
    assert small.context >= 2 * 8 and small.batch_prompt > 8 and small.batch_chunk > 8  # crosses the window
    big = check.budget_for(dataclasses.replace(subject, weight_bytes=100 * check.REFERENCE_BYTES, window=None))
    assert big.scale == pytest.approx(0.1)
    assert big.examples == {k: max(check.FLOOR[k], round(check.BASE[k] * 0.1)) for k in check.BASE}
    assert check.MIN_CONTEXT <= big.context < small.context and big.prompt < small.prompt
    assert big.shrink_seconds > small.shrink_seconds
    assert set(check.budget_for(subject, examples=7).examples.values()) == {7}
