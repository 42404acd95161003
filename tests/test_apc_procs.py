import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import subprocess
import sys

import mlx.core as mx
import numpy as np

from conftest import tiny
from segcache import Runtime, open_store

PROMPT = list(range(3, 43))  # 40 tokens: two pages of 16 and a tail
CHILD = r"""
import segcache, sys, hashlib, numpy as np, mlx.core as mx
from segcache import Runtime, open_store
from segcache.testing import models
out = []
with open_store(sys.argv[1], ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=16) as store:
    for family in ("llama", "qwen3_5"):
        logits = Runtime(models.build(family), store=store).prefill(list(range(3, 43)))
        out.append(hashlib.sha256(np.asarray(logits.astype(mx.float32)).tobytes()).hexdigest())
    out.append(str(store.stats()["hit_tokens"]))
print(" ".join(out))
"""


def digest(a):
    import hashlib

    return hashlib.sha256(np.asarray(a.astype(mx.float32)).tobytes()).hexdigest()


def test_a_second_process_hits_what_the_first_published(tmp_path):
    """Item 3: a later process resumes the published state bit-exactly, no index rebuilt."""
    want = []
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=16) as store:
        for family in ("llama", "qwen3_5"):
            want.append(digest(Runtime(tiny(family), store=store).prefill(PROMPT)))
    got = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    *logits, hit = got.stdout.split()
    assert logits == want
    assert int(hit) == 2 * len(PROMPT)
