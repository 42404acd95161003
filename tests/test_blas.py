"""`import segcache` binds OpenBLAS and cuts its idle-worker spin, but only when it loads the library."""

import json
import os
import subprocess
import sys

CHILD = "import json, os, segcache; print(json.dumps([segcache.BLAS, os.environ.get('OPENBLAS_THREAD_TIMEOUT')]))"


def _child(**env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "SEGCACHE_BLAS", "LD_PRELOAD")}
    env.update(env_changes)
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_thread_timeout_set_only_when_segcache_loads_openblas():
    blas, timeout = _child()
    if blas.startswith("OpenBLAS ("):
        assert timeout == "4", blas
    else:  # no system OpenBLAS here (macOS, or none installed): nothing loaded, nothing set
        assert timeout is None, blas


def test_thread_timeout_the_user_set_is_kept():
    blas, timeout = _child(OPENBLAS_THREAD_TIMEOUT="9")
    assert timeout == "9", blas


def test_blas_off_loads_nothing_and_sets_nothing():
    blas, timeout = _child(SEGCACHE_BLAS="off")
    assert not blas.startswith("OpenBLAS"), blas
    assert timeout is None
