"""mlx-lm's own cache tests (test_prompt_cache.py, test_models.py) run on segcache's layers.

`make mlx-lm-tests` (a dependency of `make test`) fetches the test files from
the PyPI sdist of the installed mlx-lm into tests/.upstream (gitignored; mlx-lm's
code is never committed here). This module loads test_prompt_cache.py with its
names rebound: `KVCache` -> `KVLayer`, `RotatingKVCache` -> `WindowLayer`,
`make_prompt_cache(model)` -> `Runtime(model).cache`, and its model download
(`load("mlx-community/Qwen1.5-0.5B-Chat-4bit")`) -> segcache's shipped draft
model (llama, with a real tokenizer). mlx-lm's other classes (ArraysCache with
arbitrary slots, CacheList, the batch and quantized caches) stay mlx-lm's; the
tests reach segcache's quantized and batched kinds through `to_quantized` and
`merge` / `extract` of the rebound classes. test_models.py (random-init models, no downloads) runs with
`make_prompt_cache(model)` -> `Runtime(model).cache` wherever segcache supports
the model (mlx-lm's caches otherwise; `SEGCACHE` / `NATIVE` list the families).

Tests that exercise what segcache refuses on purpose are expected failures,
with the reason; an expected failure that starts passing fails the run.
"""

import importlib.metadata
import importlib.util
import unittest
from pathlib import Path

import pytest
from mlx_lm.models.cache import make_prompt_cache

import segcache
from segcache.layers import KVLayer, WindowLayer

VERSION = importlib.metadata.version("mlx-lm")
UPSTREAM_DIR = Path(__file__).parent / ".upstream" / f"mlx_lm-{VERSION}" / "tests"
UPSTREAM = UPSTREAM_DIR / "test_prompt_cache.py"
MODEL = Path(segcache.__file__).parent / "models" / "draft"

# test -> why it fails on segcache's layers (each a refusal tested in test_compat.py); none today:
# kv_bits gives a QuantizedKVLayer, and merge / extract give segcache's batched kinds
REFUSED: dict[str, str] = {}

# test -> why it is skipped: it fails the same way with mlx-lm's own caches on this machine
UPSTREAM_FAILS = {
    "test_bitnet": "needs a Metal kernel (fails with mlx-lm's caches without Metal)",
    "test_gated_delta": "calls the Metal kernel directly (None without Metal)",
    "test_gated_delta_masked": "calls the Metal kernel directly (None without Metal)",
    "test_gemma3n_kv_shared_layers_ignore_chunking": "fails with mlx-lm's own make_cache here (allclose at default tolerance)",
}

if not UPSTREAM.exists():
    pytest.skip(
        f"mlx-lm {VERSION}'s tests are not in {UPSTREAM.parent} (run `make mlx-lm-tests`; it needs PyPI)",
        allow_module_level=True,
    )


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(f"_mlx_lm_upstream_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runtime_cache(model, max_kv_size=None):
    """`Runtime(model).cache`; mlx-lm's own caches for a model segcache refuses (counted)."""
    try:
        cache = segcache.Runtime(model).cache
    except segcache.UnsupportedModelError:
        NATIVE.append(type(model).__module__.rsplit(".", 1)[-1])
        return make_prompt_cache(model, max_kv_size)
    SEGCACHE.append(type(model).__module__.rsplit(".", 1)[-1])
    return cache


SEGCACHE, NATIVE = [], []  # model families each make_prompt_cache call served


def _load_upstream():
    from mlx_lm.utils import load

    module = _import(UPSTREAM)
    module.KVCache = KVLayer
    module.RotatingKVCache = WindowLayer
    module.make_prompt_cache = lambda model, max_kv_size=None: segcache.Runtime(model).cache
    module.load = lambda path: load(str(MODEL))
    return module


_upstream = _load_upstream()
_models = _import(UPSTREAM_DIR / "test_models.py")
_models.make_prompt_cache = _runtime_cache


class TestModelsOnSegcache(_models.TestModels):
    """mlx-lm's TestModels (random-init models, no downloads) on `Runtime(model).cache`
    wherever segcache supports the model, and on segcache's KVLayer / WindowLayer."""


class TestPromptCacheOnSegcache(_upstream.TestPromptCache):
    """mlx-lm's TestPromptCache with segcache's layers in place of mlx-lm's caches."""


for _name, _reason in REFUSED.items():
    _test = getattr(_upstream.TestPromptCache, _name)  # a renamed upstream test fails here, loudly
    setattr(TestPromptCacheOnSegcache, _name, unittest.expectedFailure(_test))


for _name, _reason in UPSTREAM_FAILS.items():
    _test = getattr(_models.TestModels, _name)
    setattr(TestModelsOnSegcache, _name, unittest.skip(_reason)(_test))
