"""The batched state machine against per-row mlx-lm caches (few examples by default)."""

import pytest

from conftest import tiny
from segcache.testing.batch_machine import batch_machine_for
from segcache.testing.statemachine import run_machine


@pytest.mark.parametrize("family,strategy", [("qwen3_5", "states"), ("qwen3_next", "replay"), ("llama", "auto")])
def test_batch_machine(family, strategy):
    run_machine(batch_machine_for(tiny(family), strategy=strategy), examples=10, steps=20)
