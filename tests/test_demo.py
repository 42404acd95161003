"""`segcache demo` end to end: twice in one cache directory, the second run resumes from disk."""

import segcache  # noqa: F401

import json
import os
import subprocess
import sys

import pytest

from segcache.demo import MODELS_DIR

SHIPPED = (MODELS_DIR / "target" / "config.json").exists() and (MODELS_DIR / "draft" / "config.json").exists()


def _demo(*args, cwd=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "segcache.cli", "demo", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


@pytest.mark.skipif(not SHIPPED, reason="the demo models are not in src/segcache/models")
def test_demo_twice_second_run_hits_disk_and_outputs_match(tmp_path):
    reports = []
    for run in range(2):
        report = tmp_path / f"run{run}.json"
        done = _demo("--prompt-cache-dir", str(tmp_path / "store"), "--max-tokens", "48", "--report", str(report))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "BLAS:" in done.stdout and "outputs identical: yes" in done.stdout
        ways = 3
        if (MODELS_DIR / "target" / "mtp.safetensors").exists():  # the target's own head drafts too
            assert "MTP head" in done.stdout
            ways += 1
        if (MODELS_DIR / "dflash" / "config.json").exists():  # DFlash blocks, alone and beside prompt lookup
            assert "DFlash drafter:" in done.stdout and "DFlash + lookup" in done.stdout
            ways += 2
        count = {3: "three", 4: "four", 5: "five", 6: "six"}[ways]
        assert f"all {count} outputs identical: yes" in done.stdout
        assert "segcache/models/target" in done.stdout and str(MODELS_DIR.resolve()) not in done.stdout
        reports.append(json.loads(report.read_text()))
    first, second = reports
    for r in reports:
        assert r["identical"] and r["request2"]["same_first_token"]
        assert r["request2"]["hit_tokens"] > 0  # the continuation resumes from the first request
    assert first["request1"]["hit_tokens"] == 0  # an empty store: computed
    assert second["request1"]["hit_tokens"] > 0 and second["request1"]["tier"].startswith("disk")
    texts = lambda r: {name: c["text"] for name, c in r["completions"].items()}  # noqa: E731
    assert texts(first) == texts(second)
    assert len(set(texts(first).values())) == 1


def test_runtime_walkthrough():
    done = _demo("--runtime", "--prompt-tokens", "48")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "same greedy token: True" in done.stdout


def test_demo_without_models_says_what_to_do(tmp_path):
    done = _demo("--model", str(tmp_path / "none"), "--draft-model", str(tmp_path / "none"))
    assert done.returncode == 2 and "--model" in done.stderr


def test_paths_are_shown_as_a_user_reads_them(tmp_path, monkeypatch):
    from pathlib import Path

    from segcache.serve.paths import shown

    monkeypatch.setenv("HOME", str(tmp_path))
    assert shown(MODELS_DIR / "target") == "segcache/models/target"
    assert shown(tmp_path / ".cache" / "segcache" / "demo") == "~/.cache/segcache/demo"
    assert shown(tmp_path) == "~"
    assert shown(Path("/opt/elsewhere/models")) == "/opt/elsewhere/models"
