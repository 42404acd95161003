import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import argparse
import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from segcache import cli_generate
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer

PROMPT = "def add(a, b):\n    return a + b\n\ndef add("


def write_model(directory, family, seed):
    """A tiny random model as an mlx-lm model directory (config, weights, tokenizer)."""
    directory.mkdir()
    model = models.build(family, seed=seed)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(models.config(family)))
    test_tokenizer.save(directory)
    return str(directory)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": write_model(root / "target", "qwen3_5", 0),
        "draft": write_model(root / "draft", "llama", 1),
    }


def parse(argv):
    parser = argparse.ArgumentParser(prog="segcache")
    cli_generate.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def run(argv, capsys):
    code = cli_generate.run(parse(argv))
    return code, capsys.readouterr()


def test_cli_generate_matches_mlx_lm(dirs, capsys):
    model, tokenizer = mlx_lm.load(dirs["target"])
    expected = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=15)
    base = ["generate", "--model", dirs["target"], "--prompt", PROMPT, "--max-tokens", "15", "--verbose", "False"]
    for extra in ([], ["--draft-model", dirs["draft"], "--num-draft-tokens", "3"], ["--prompt-lookup"],
                  ["--prompt-lookup", "--draft-tree", "8"], ["--draft-model", dirs["draft"], "--draft-tree", "8"],
                  ["--draft-model", dirs["draft"], "--num-draft-tokens", "5", "--draft-min-prob", "0.5"]):
        code, out = run(base + extra, capsys)
        assert code == 0, out.err
        assert out.out == expected + "\n"
    code, out = run(base + ["--prompt-lookup", "--verbose"], capsys)  # a bare --verbose is True
    assert code == 0 and expected in out.out
    assert "Speculative (lookup)" in out.out and "tokens-per-sec" in out.out


def test_cli_sampling_is_seeded(dirs, capsys):
    argv = ["generate", "--model", dirs["target"], "--prompt", PROMPT, "--max-tokens", "12",
            "--draft-model", dirs["draft"], "--temp", "0.9", "--seed", "5", "--verbose", "F"]
    first = run(argv, capsys)
    again = run(argv, capsys)
    assert first[0] == again[0] == 0 and first[1].out == again[1].out


def test_cli_errors(dirs, capsys, tmp_path):
    code, out = run(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"], capsys)
    assert code == 1 and "cannot load the model" in out.err
    code, out = run(["generate", "--model", dirs["target"], "--prompt", "x", "--max-tokens", "0"], capsys)
    assert code == 2 and "--max-tokens" in out.err
    code, out = run(["generate", "--model", dirs["target"], "--prompt", "x", "--draft-tree", "4"], capsys)
    assert code == 2 and "--draft-tree" in out.err
    code, out = run(["generate", "--model", dirs["target"], "--prompt", "x", "--draft-model", dirs["draft"],
                     "--draft-min-prob", "1.5"], capsys)
    assert code == 2 and "draft_min_prob" in out.err
    with pytest.raises(SystemExit):  # argparse: the two drafters exclude each other
        parse(["generate", "--model", "m", "--prompt", "x", "--draft-model", "d", "--prompt-lookup"])


def test_cli_generate_prompt_cache_dir_hits_on_the_second_run(dirs, capsys, tmp_path):
    model, tokenizer = mlx_lm.load(dirs["target"])
    expected = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=12)
    cache = str(tmp_path / "apc")
    argv = ["generate", "--model", dirs["target"], "--prompt", PROMPT, "--max-tokens", "12",
            "--prompt-lookup", "--prompt-cache-dir", cache, "--verbose"]
    resumed = []
    for _ in range(2):  # each run is a new process's worth of state: a fresh load and store handle
        code, out = run(argv, capsys)
        assert code == 0, out.err
        assert expected in out.out
        resumed.append(int(out.err.split("prompt cache: ")[1].split()[0]))
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert resumed[0] == 0
    assert resumed[1] >= prompt_tokens - 1  # all but (at most) the last prompt token
    from segcache.store import open_store

    with open_store(cache) as store:
        assert store.stats()["entries"] > 0
