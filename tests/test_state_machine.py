import segcache  # noqa: F401

import os

import pytest

from conftest import tiny
from segcache.testing.statemachine import machine_for, run_machine

LONG = os.environ.get("SEGCACHE_LONG") == "1"
# 3 models x 2 recurrent strategies where they matter: >= 200 programs in all under
# `make test-long` (SEGCACHE_LONG=1), half of each (the same programs every run) by default.
CASES = [
    ("llama", "auto", 70),
    ("qwen3_5", "states", 45),
    ("qwen3_5", "replay", 45),
    ("gemma3_text", "auto", 60),
]
if not LONG:
    CASES = [(family, strategy, examples // 2) for family, strategy, examples in CASES]


@pytest.mark.parametrize("family,strategy,examples", CASES)
def test_runtime_state_machine(family, strategy, examples):
    run_machine(machine_for(tiny(family), strategy=strategy), examples=examples, steps=20)
