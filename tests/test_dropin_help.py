"""`segcache generate` / `segcache serve` take every flag of `mlx_lm.generate` / `mlx_lm.server` (issue 25).

Generated from the installed mlx-lm's own parsers, so a flag a new mlx-lm
release adds fails here until segcache takes it. For every mlx-lm flag: the
same option strings appear in segcache's `--help`, a value mlx-lm accepts is
accepted and parsed to the same value, and the default is mlx-lm's unless
listed below with the reason it differs.
"""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import argparse
import importlib

import pytest

from segcache.cli import build_parser

# (command, option) -> why segcache's default differs from mlx-lm's
DEFAULTS_THAT_DIFFER = {
    ("generate", "--num-draft-tokens"): "drafts change the speed only; 4 was the fastest setting measured",
    ("serve", "--num-draft-tokens"): "drafts change the speed only; 4 was the fastest setting measured",
    ("serve", "--allowed-origins"): "no cross-origin caller unless asked for (mlx-lm allows every origin)",
    ("serve", "--chat-template"): "None instead of '': both mean the tokenizer's template",
    ("serve", "--prompt-cache-size"): "accepted and ignored: the store is bounded by bytes, not a count",
}
# options whose parsed value segcache keeps in another form (what the value means is the same)
VALUES_THAT_DIFFER = {
    ("serve", "--prompt-cache-size"): "ignored (see above)",
}


class _Captured(Exception):
    pass


def mlx_parser(command: str) -> argparse.ArgumentParser:
    """mlx-lm's own parser: generate's from its setup function, server's caught as main() parses."""
    if command == "generate":
        return importlib.import_module("mlx_lm.generate").setup_arg_parser()
    server = importlib.import_module("mlx_lm.server")

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        server.main()
    except _Captured as got:
        return got.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError("mlx_lm.server.main() built no parser")


def segcache_parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def options(parser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}


def sample(action: argparse.Action) -> list[str]:
    """Arguments that give `action` a value other than its default."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [list(action.choices)[-1]]
    kind = getattr(action.type, "__name__", "")
    value = {"int": "7", "float": "0.25", "loads": '{"enable_thinking": false}', "_parse_size": "2G",
             "str2bool": "False", "<lambda>": "http://a.test,http://b.test"}.get(kind, "abc")
    return [value, "def"] if action.nargs == "+" else [value]


REQUIRED = {"generate": [], "serve": ["--model", "m"]}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_mlx_lm_flag_is_taken_with_its_meaning(command):
    theirs, ours = mlx_parser(command), segcache_parser(command)
    mine = options(ours)
    missing = sorted(set(options(theirs)) - set(mine))
    assert not missing, f"segcache {command} lacks mlx-lm's {missing}"
    helptext = ours.format_help()
    assert all(o in helptext for o in options(theirs))
    base = theirs.parse_args([])
    for opt, action in options(theirs).items():
        argv = [opt, *sample(action)]
        want = getattr(theirs.parse_args(argv), action.dest)
        assert want != getattr(base, action.dest), f"{opt}: the sample {argv} does not change mlx-lm's value"
        mine_action = mine[opt]
        got = getattr(ours.parse_args(REQUIRED[command] + argv), mine_action.dest)
        if (command, opt) not in VALUES_THAT_DIFFER:
            assert got == want, f"{opt} {argv[1:]}: mlx-lm parses {want!r}, segcache {got!r}"
        default = getattr(ours.parse_args(REQUIRED[command]), mine_action.dest)
        if (command, opt) in DEFAULTS_THAT_DIFFER:
            assert default != getattr(base, action.dest), f"{opt}: listed as differing but it does not"
        elif opt != "--model":  # serve's --model is required; generate's defaults to mlx-lm's as well
            assert default == getattr(base, action.dest), f"{opt}: default {default!r}, mlx-lm's {getattr(base, action.dest)!r}"


def test_defaults_written_out_are_mlx_lms():
    """cli_generate writes mlx_lm.generate's DEFAULT_* out (no mlx-lm import to build the parser)."""
    from segcache import cli_generate

    theirs = importlib.import_module("mlx_lm.generate")
    names = [n for n in vars(theirs) if n.startswith("DEFAULT_") and n != "DEFAULT_QUANTIZED_KV_START"]
    assert names
    for name in names:
        assert getattr(cli_generate, name) == getattr(theirs, name), name
    from segcache.kvquant import DEFAULT_START

    assert DEFAULT_START == theirs.DEFAULT_QUANTIZED_KV_START


def test_kv_bits_serves_one_row_at_a_time_and_says_so(caplog):
    """Batched rows hold unquantized KV: with --kv-bits the server decodes one request at a time (as
    mlx_lm.server serves kv_bits), says so in --help and logs it, rather than ignoring the flag."""
    from segcache.serve import cli

    parser = segcache_parser("serve")
    args = parser.parse_args(["--model", "m", "--kv-bits", "4", "--decode-concurrency", "8"])
    refusal, kv = cli._mlx_lm_flags_check(args)
    assert refusal is None and (kv.bits, kv.group_size, kv.start) == (4, 64, 5000)
    with caplog.at_level("WARNING", logger="segcache.serve"):
        cli._apply_mlx_lm_flags(args, None, kv)
    assert args.decode_concurrency == 1
    assert "--kv-bits" in caplog.text and "one at a time" in caplog.text
    helptext = " ".join(parser.format_help().split())
    assert "with --kv-bits requests decode one at a time" in helptext
    plain = parser.parse_args(["--model", "m", "--decode-concurrency", "8"])
    cli._apply_mlx_lm_flags(plain, None, None)
    assert plain.decode_concurrency == 8
