"""The batched state machine against per-row mlx-lm caches (few examples by default)."""

import pytest

from conftest import tiny
from segcache.testing.batch_machine import batch_machine_for
from segcache.testing.statemachine import run_machine


@pytest.mark.parametrize("family,strategy", [("qwen3_5", "states"), ("qwen3_next", "replay"), ("llama", "auto")])
def test_batch_machine(family, strategy):
    run_machine(batch_machine_for(tiny(family), strategy=strategy), examples=10, steps=20)


@pytest.mark.parametrize("family,strategy", [("nemotron_h", "replay"), ("lfm2", "states"), ("mamba2", "auto")])
def test_batch_machine_on_state_families(family, strategy):
    """StateLayer families (Mamba-2 hybrid, short conv, Mamba-2): ragged rounds, joins of empty and
    prompted rows, leaves and extracts in a branch, against mlx-lm's own caches per row."""
    run_machine(batch_machine_for(tiny(family), strategy=strategy), examples=10, steps=20)


@pytest.mark.parametrize("family", ["gemma3_text", "llama_swa"])
def test_batch_machine_on_sliding_window_models(family):
    """Prompts and forwards past the 8-token window: rows cross it, branches straddle it, layers compact."""
    from test_batch_window import window_model

    run_machine(batch_machine_for(window_model(family), prompt=20, chunk=10), examples=10, steps=20)
