import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import pytest

from conftest import tiny
from segcache.testing.statemachine import run_machine
from segcache.testing.store_machine import store_machine_for

# Item 9: fork/forward/commit/rollback/clone programs with publish/prefill/evict/reopen.
CASES = [("llama", 30), ("qwen3_5", 25), ("gemma3_text", 30)]


@pytest.mark.parametrize("family,examples", CASES)
def test_store_state_machine(family, examples):
    run_machine(store_machine_for(tiny(family)), examples=examples, steps=16)
