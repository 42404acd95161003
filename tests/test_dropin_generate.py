"""`segcache generate ARGS` prints what `mlx_lm.generate ARGS` prints, for each flag that changes the text (issue 25).

The reference is mlx-lm's own command (its `main`, in this process) on the
shipped target; chat-template flags run on a copy of it whose tokenizer has a
chat template, and --max-kv-size on a tiny qwen3 directory (the shipped target
makes its own cache, so mlx-lm ignores the flag there, as for llama). Speculative runs are
compared with mlx-lm's plain greedy text (mlx-lm cannot draft on a hybrid model).
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import contextlib
import importlib
import io
import json
import shutil
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from segcache.cli import main as segcache_main
from segcache.demo import MODELS_DIR
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer

TARGET = str(MODELS_DIR / "target")
DRAFT = str(MODELS_DIR / "draft")
PROMPT = "def parse(path):\\n    with open(path) as f:\\n"  # mlx_lm.generate turns \\n into newlines
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if not loop.last or "
            "m['role'] != 'assistant' %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
            "{% if think is defined and not think %}no thinking: {% endif %}{% endif %}")


def mlx_generate(argv, stdin: str | None = None) -> str:
    out, saved = io.StringIO(), (sys.argv, sys.stdin)
    sys.argv = ["mlx_lm.generate", *argv]
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            importlib.import_module("mlx_lm.generate").main()
    finally:
        sys.argv, sys.stdin = saved
    return out.getvalue()


def segcache_generate(argv, capsys, stdin: str | None = None) -> str:
    capsys.readouterr()
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        code = segcache_main(["generate", *argv])
    finally:
        sys.stdin = saved
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """The shipped target with a chat template in its tokenizer config."""
    path = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(TARGET, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """A tiny qwen3 (a model without a make_cache of its own) as a model directory."""
    path = tmp_path_factory.mktemp("qwen3") / "qwen3"
    path.mkdir()
    model = models.build("qwen3", seed=0)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(models.config("qwen3")))
    test_tokenizer.save(path)
    return str(path)


BASE = ["--prompt", PROMPT, "--max-tokens", "20", "--verbose", "False"]
FLAGS = [
    [],
    ["-m", "7", "-p", "class Parser:\\n"],
    ["--extra-eos-token", "Ċ", "<6th>"],  # a token by name, and the 6th token generated (by id): stops there
    ["--prefill-step-size", "5"],
    ["--kv-bits", "4", "--quantized-kv-start", "0"],
    ["--kv-bits", "2", "--kv-group-size", "32", "--quantized-kv-start", "12"],
    ["--kv-bits", "8", "--quantized-kv-start", "30"],  # switches during decoding
    ["--quantize-activations"],
    ["--temp", "0.9", "--seed", "11"],
    ["--temp", "0.9", "--seed", "11", "--top-k", "3", "--top-p", "0.8"],
    ["--temp", "0.9", "--seed", "11", "--min-p", "0.2", "--min-tokens-to-keep", "2"],
    ["--temp", "0.9", "--seed", "11", "--xtc-probability", "0.5", "--xtc-threshold", "0.05"],
]


@pytest.fixture(scope="module")
def sixth():
    """The id of the 6th token mlx-lm generates for the prompt (an --extra-eos-token that stops it)."""
    import mlx_lm

    model, tok = mlx_lm.load(TARGET)
    ids = tok.encode(PROMPT.replace("\\n", "\n"))
    return str([r.token for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=6)][5])


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: " ".join(f) or "plain")
def test_text_equals_mlx_lm_generate(flags, sixth, capsys):
    argv = ["--model", TARGET, *BASE, *(sixth if f == "<6th>" else f for f in flags)]
    assert segcache_generate(argv, capsys) == mlx_generate(argv)


def test_flags_change_the_text(sixth):
    """The comparisons above can fail: these flags change mlx-lm's own text on the shipped target."""
    plain = mlx_generate(["--model", TARGET, *BASE])
    for flags in (["--kv-bits", "2", "--quantized-kv-start", "0"], ["--extra-eos-token", sixth],
                  ["--temp", "0.9", "--seed", "11"]):
        assert mlx_generate(["--model", TARGET, *BASE, *flags]) != plain


CHAT_FLAGS = [
    [],
    ["--system-prompt", "You write Python."],
    ["--prefill-response", "    data = "],
    ["--chat-template-config", '{"think": false}'],
    ["--ignore-chat-template"],
    ["--use-default-chat-template"],
]


@pytest.mark.parametrize("flags", CHAT_FLAGS, ids=lambda f: " ".join(f) or "template")
def test_chat_template_flags_equal_mlx_lm(chat_target, flags, capsys):
    argv = ["--model", chat_target, *BASE, *flags]
    want = mlx_generate(argv)
    assert segcache_generate(argv, capsys) == want
    if flags and flags[0] != "--use-default-chat-template":  # each of these changes the prompt
        assert want != mlx_generate(["--model", chat_target, *BASE])


def test_prompt_from_stdin(capsys):
    argv = ["--model", TARGET, "--prompt", "-", "--max-tokens", "12", "--verbose", "False"]
    text = "import os\nimport sys\n"
    assert segcache_generate(argv, capsys, stdin=text) == mlx_generate(argv, stdin=text)


def test_max_kv_size_on_a_model_without_its_own_cache(plain_dir, capsys):
    argv = ["--model", plain_dir, "--prompt", "a b c d e f g h i j k l m n o p q r s t", "--max-tokens", "24",
            "--verbose", "False"]
    windowed = argv + ["--max-kv-size", "12"]
    want = mlx_generate(windowed)
    assert want != mlx_generate(argv)  # the window changes the text
    assert segcache_generate(windowed, capsys) == want
    assert segcache_generate(windowed + ["--prompt-lookup"], capsys) == want


def test_speculative_runs_print_mlx_lms_greedy_text(capsys):
    argv = ["--model", TARGET, *BASE]
    want = mlx_generate(argv)
    assert segcache_generate(argv + ["--draft-model", DRAFT, "--num-draft-tokens", "3"], capsys) == want
    assert segcache_generate(argv + ["--prompt-lookup", "--kv-bits", "4"], capsys) == mlx_generate(argv + ["--kv-bits", "4"])


def test_verbose_output_has_mlx_lms_shape(capsys):
    argv = ["--model", TARGET, "--prompt", PROMPT, "--max-tokens", "8"]
    mine, theirs = segcache_generate(argv, capsys).splitlines(), mlx_generate(argv).splitlines()
    assert mine[0] == theirs[0] == "=" * 10
    assert mine[: theirs.index("=" * 10, 1) + 1] == theirs[: theirs.index("=" * 10, 1) + 1]  # the text
    for prefix in ("Prompt: ", "Generation: ", "Peak memory: "):
        assert any(line.startswith(prefix) for line in mine)


@pytest.mark.parametrize("kv", [[], ["--kv-bits", "4", "--quantized-kv-start", "0"]], ids=["fp", "kv4"])
def test_prompt_cache_file_of_mlx_lm_cache_prompt(chat_target, kv, tmp_path, capsys):
    """A file mlx_lm.cache_prompt made (a chat template's start); the prompt is the rest (mlx-lm's <query> cut)."""
    path = str(tmp_path / "prompt.safetensors")
    saved = sys.argv
    sys.argv = ["mlx_lm.cache_prompt", "--model", chat_target, "--prompt", "def parse(path):\n", "--prompt-cache-file",
                path, *kv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module("mlx_lm.cache_prompt").main()
    finally:
        sys.argv = saved
    argv = ["--prompt-cache-file", path, "--prompt", "    with open(path) as f:", "--max-tokens", "16",
            "--verbose", "False", *kv]
    want = mlx_generate(argv)  # --model comes from the file
    assert segcache_generate(argv, capsys) == want
    assert segcache_generate(argv + ["--prompt-lookup"], capsys) == want
    assert segcache_generate(argv + ["--model", chat_target], capsys) == want


def test_flags_that_cannot_be_honoured_say_why(plain_dir, capsys, tmp_path):
    def fails(argv, says, code=2):
        capsys.readouterr()
        assert segcache_main(["generate", *argv]) == code
        err = capsys.readouterr().err
        assert says in err, err

    base = ["--model", TARGET, "--prompt", "x", "--max-tokens", "2"]
    fails(base + ["--image", str(tmp_path / "cat.png")], "does not take images")
    fails(base + ["--kv-bits", "7"], "kv_bits=7")
    fails(base + ["--chat-template-config", "[1]"], "JSON object")
    fails(base + ["--prompt-cache-file", str(tmp_path / "none.safetensors")], "no prompt cache file")
    fails(base + ["--prompt-cache-file", "f", "--prompt-cache-dir", str(tmp_path)], "exclude each other")
    fails(base + ["--adapter-path", str(tmp_path / "nothing")], "cannot load the model", code=1)
