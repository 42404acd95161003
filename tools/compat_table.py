"""Write the compatibility table (docs/compatibility.md and README.md) from the test matrix.

Runs tests/test_families.py (or reads a JUnit XML file of an earlier run),
maps every test to its column through the test module's `COLUMNS`, and its
first parameter to the family. A cell says "yes" only if every test of that
family and column ran and passed; "FAIL" if one failed; "-" if none ran. The
refused families come from the test of the refusals (`REFUSED` in the test
module, each asserted to raise UnsupportedModelError with that reason).

    python tools/compat_table.py            # run the tests, then write the table
    python tools/compat_table.py --junit X  # from an earlier run's JUnit XML
    python tools/compat_table.py --check    # exit 1 if the files differ from what the tests give
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "test_families.py"
DOC = ROOT / "docs" / "compatibility.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- compat:begin (tools/compat_table.py) -->", "<!-- compat:end -->"


def _module_constant(name: str):
    """A literal constant of the test module, read without importing it (no mlx needed)."""
    tree = ast.parse(TESTS.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{TESTS.name} defines no literal {name}")


def run_tests(junit: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "pytest", str(TESTS), "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)


def results(junit: Path) -> list[tuple[str, str, str]]:
    """(test function, first parameter, outcome) per test case."""
    out = []
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("name", "")
        func, _, params = name.partition("[")
        first = params.rstrip("]").split("-")[0] if params else ""
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        out.append((func, first, outcome))
    return out


def table(cases: list[tuple[str, str, str]]) -> str:
    columns = _module_constant("COLUMNS")
    kernels = _module_constant("KERNELS")
    refused = _module_constant("REFUSED")
    not_batched = _module_constant("NOT_BATCHED")
    names = list(dict.fromkeys(columns.values()))
    cells: dict[tuple[str, str], list[str]] = {}
    families = []
    for func, family, outcome in cases:
        if func in columns and family:
            cells.setdefault((family, columns[func]), []).append(outcome)
            if family not in families:
                families.append(family)
    refusal_ok = {family: outcome for func, family, outcome in cases if func == "test_refused_families"}

    def cell(family, column):
        got = cells.get((family, column), [])
        if not got or all(o == "skipped" for o in got):
            return "-"
        if any(o == "failed" for o in got):
            return "FAIL"
        return "yes"

    lines = [
        "| family | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for family in families:
        row = []
        for column in names:
            c = cell(family, column)
            if column == "kernel kept on the hot path" and c == "yes":
                c = f"yes (`{kernels[family]}`)"
            if column == "batched rows" and c == "yes" and family in not_batched:
                c = "refused (below)"  # the test checked the refusal
            row.append(c)
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    lines.append("")
    if not_batched:
        lines.append(
            "Refused by `BatchRuntime` (continuous batching) with `UnsupportedModelError`, before any module "
            "is adapted; serve them with `--decode-concurrency 1`: "
            + "; ".join(f"{family}: {why}" for family, why in not_batched.items()) + "."
        )
        lines.append("")
    if not refused:
        lines.append(
            "Refused: none of mlx-lm 0.32.2's recurrent families (the tests check that every model "
            "module whose `make_cache()` makes an `ArraysCache` or a `CacheList` is in this table, "
            "except deepseek_v32, longcat_flash and minimax_m3_vl, whose lists hold attention caches only). "
            "A model whose recurrent module has no hook is refused at `Runtime(model)` with "
            "`UnsupportedModelError` naming the layer and its cache, before anything is changed "
            "(`test_a_family_without_a_hook_is_refused_before_anything_changes`)."
        )
        lines.append("")
    if refused:
        lines.append("Refused at `Runtime(model)` with `UnsupportedModelError`, before anything is changed:")
        lines.append("")
        lines.append("| family | refused (test) | why |")
        lines.append("|---|---|---|")
        for family, reason in refused.items():
            ok = {"passed": "yes", "failed": "FAIL"}.get(refusal_ok.get(family, ""), "-")
            lines.append(f"| {family} | {ok} | {reason} |")
        lines.append("")
    return "\n".join(lines)


PREAMBLE = """# Compatibility

Generated by `tools/compat_table.py` from the results of `tests/test_families.py`
(do not edit by hand: run the tool). "yes" means every test of that column
passed for that family's tiny random model built from mlx-lm 0.32.2's own
classes:

- **fork/commit/rollback**: `commit(n)` for every n is bit-identical whatever the
  rejected tail, matches a recompute (and, fed token by token, is bit for bit
  the tokens fed one at a time), both recurrent strategies, block and token by
  token; rollback, nesting, clones and misuse exact; the runtime state machine;
- **prefix store**: a prompt published and resumed bit-identically from RAM, from
  disk and from another store handle; a longer prompt resumes and matches a
  cold prefill;
- **speculative target / draft**: greedy `segcache.stream_generate` (prompt
  lookup and a draft model; or as the draft of a dense target) token-identical
  to `mlx_lm.stream_generate`;
- **kernel kept on the hot path**: outside a branch the family's recurrence
  (named) gets exactly the arguments the unpatched model passes, so on Metal
  the same kernel runs;
- **batched rows**: in a `BatchRuntime`, rows (one of them empty) decode a step,
  verify drafts in one ragged round and each commit its own count, every row
  as a single `Runtime` fed its kept tokens (logits allclose at 1e-4, same greedy
  tokens: batched products round otherwise).

"""

# mlx-lm's cache calls beyond the model's, on a Runtime's layers: (call, what segcache does,
# tests that prove it). Every named test must exist (checked on each run, `--check` included).
PROTOCOL = (
    ("`save_prompt_cache` / `load_prompt_cache`", "round trip of every kind's committed state; loaded layers fork",
     ["test_save_load_round_trip_and_fork", "test_quantized_layers_round_trip_through_mlx_lm_files"]),
    ("`trim_prompt_cache`", "exact; inside a branch down to its base (`BranchError` below)",
     ["test_trims_keep_every_invariant", "test_trim_below_an_open_branch_is_refused"]),
    ("`generate_step(kv_bits=...)`",
     ("`KVLayer` -> `QuantizedKVLayer` (branches, commit bit-exact vs mlx-lm's `QuantizedKVCache` fed the kept "
      "tokens), adopted by the runtime; refused inside a branch and on sliding windows; the prefix store "
      "refuses a quantized runtime (`UnsupportedOperationError`)"),
     ["test_a_quantized_branch_commits_to_mlx_lm_fed_exactly_the_kept_tokens",
      "test_kv_bits_generate_step_on_rt_cache_then_fork_and_commit",
      "test_to_quantized_inside_a_branch_is_refused_and_swaps_nothing",
      "test_the_prefix_store_refuses_a_quantized_runtime",
      "test_kv_bits_on_a_sliding_window_model_is_refused_before_anything_is_swapped"]),
    ("`merge` / `extract` / `filter` / `extend` (`BatchGenerator`, `batch_generate`)",
     ("`KVLayer` -> `BatchKVLayer`, `RecurrentLayer` -> `BatchRecurrentLayer`, `StateLayer` -> "
      "`BatchStateLayer`, `CompositeLayer` -> `BatchCompositeLayer`, `WindowLayer` -> `BatchWindowLayer`; "
      "`extract` gives the single-sequence kind back; `batch_generate` on Runtimes' caches gives mlx-lm's tokens (dense, GDN, SSM / short-conv, "
      "composites). `QuantizedKVLayer`, a window that dropped tokens merged by `KVLayer.merge` (as full "
      "attention) and a still-growing n-gram context refuse (`UnsupportedOperationError`); open branches refuse (`BranchError`)"),
     ["test_merge_keeps_every_row_and_extract_gives_it_back", "test_filter_and_extend_keep_the_rows_they_name",
      "test_mlx_lm_batch_generate_on_runtime_caches", "test_merge_refusals_change_nothing",
      "test_kinds_without_a_batched_form_refuse_merge",
      "test_window_layer_merge_gives_a_batched_layer_whose_rows_extract_back"]),
)
PROTOCOL_TESTS = ("test_compat.py", "test_compat_kinds.py", "test_batch_window.py")


def protocol_section() -> str:
    """The table of mlx-lm's cache calls; raises if it names a test that does not exist."""
    defined = set()
    for name in PROTOCOL_TESTS:
        tree = ast.parse((ROOT / "tests" / name).read_text())
        defined |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    lines = [
        "",
        "## mlx-lm's cache calls on a Runtime's layers",
        "",
        ("Beyond the model's own calls (tests/test_compat.py, tests/test_compat_kinds.py, "
         "tests/test_batch_window.py; mlx-lm's own "
         "test_prompt_cache.py and test_models.py pass on segcache's layers in tests/test_compat_mlx_lm.py):"),
        "",
        "| mlx-lm call | on segcache's layers | tests |",
        "|---|---|---|",
    ]
    for call, what, tests in PROTOCOL:
        missing = [t for t in tests if t not in defined]
        if missing:
            raise SystemExit(f"PROTOCOL names tests that do not exist: {missing}")
        lines.append(f"| {call} | {what} | " + ", ".join(f"`{t}`" for t in tests) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="JUnit XML of an earlier run of tests/test_families.py")
    parser.add_argument("--check", action="store_true", help="exit 1 if the written files would change")
    args = parser.parse_args()
    if args.junit:
        cases = results(args.junit)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "families.xml"
            run_tests(junit)
            cases = results(junit)
    body = table(cases)
    doc = PREAMBLE + body + protocol_section()
    readme = README.read_text()
    if BEGIN not in readme:
        raise SystemExit(f"README.md lacks the markers {BEGIN} ... {END}")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new_readme = f"{head}{BEGIN}\n{body}{END}{tail}"
    if args.check:
        stale = [p.name for p, text in ((DOC, doc), (README, new_readme)) if not p.exists() or p.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}; run python tools/compat_table.py")
            return 1
        return 0
    DOC.write_text(doc)
    README.write_text(new_readme)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
