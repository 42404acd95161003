import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import select
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


NODE_CHILD = r"""
import segcache, sys
from segcache import Runtime, open_store
from segcache.testing import models
path, k = sys.argv[1], int(sys.argv[2])
model = models.build("llama")
shared = list(range(3, 19))  # one whole page of 16
own = [(7 * k + 5 * i + 1) % models.VOCAB for i in range(8)]  # k-th continuation past the page
with open_store(path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=16) as store:
    print("ready", flush=True)
    sys.stdin.readline()  # "go", once all four are ready: they extend node 1 at once
    Runtime(model, store=store).prefill(shared + own)
print("ok")
"""


def test_four_processes_extending_one_node_keep_every_continuation(tmp_path):
    """Issue 9, defect 4: four processes publish past the same page boundary at once; afterwards
    every continuation hits (a dense prompt resumes inside the page only through the node)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", NODE_CHILD, str(tmp_path), str(k)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in range(4)
    ]
    try:
        for p in procs:  # after their imports and model builds (a child that dies reads as "")
            assert select.select([p.stdout], [], [], 300)[0], "a child was not ready in 300 s"
            assert p.stdout.readline().strip() == "ready", p.communicate(timeout=300)[1]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0 and out.strip() == "ok", err
    finally:
        for p in procs:
            p.kill()
    model, shared = tiny("llama"), list(range(3, 19))
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=16) as store:
        for k in range(4):
            own = [(7 * k + 5 * i + 1) % 64 for i in range(8)]
            prompt = shared + own[:5] + [63, 62]
            before = store.stats()["hit_tokens"]
            got = Runtime(model, store=store).prefill(prompt)
            assert store.stats()["hit_tokens"] - before == len(shared) + 5, f"continuation {k} was lost"
            want = Runtime(model).prefill(prompt)
            assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
