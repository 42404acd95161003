"""Bind an optimized system BLAS ahead of the reference BLAS in Linux `mlx[cpu]`.

The `mlx[cpu]` wheel links a reference BLAS (a few GFLOP/s of fp32 GEMM). A
system OpenBLAS loaded with RTLD_GLOBAL before `mlx.core` is imported wins the
symbol lookup, so MLX's CPU matmuls run on it (45-200 GFLOP/s measured on a
2-core x86 machine). This must run before anything imports `mlx`; once `mlx`
is loaded it only reports what is active.

Set SEGCACHE_BLAS=off to keep the wheel's BLAS, or SEGCACHE_BLAS=/path/lib.so
to choose a library.

OpenBLAS's idle worker threads spin (sched_yield) for 2^28 cycles after each
call by default. Forwards of a few tokens make threaded GEMM calls back to
back, so on a 2-core machine the worker kept a core busy doing nothing: it
burned 4.3 ms of CPU per 3-token forward of the demo target (as long as the
forward itself) against 1.1 ms with the spin cut to 2^4 cycles; large GEMMs
still use both threads (22 ms for 2048x1024x1024, 43 ms single-threaded).
Wall-clock decode speed moved within this machine's run-to-run noise. So
unless OPENBLAS_THREAD_TIMEOUT is already set, it is set to 4 before the
library loads.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

# log2 of the cycles an idle OpenBLAS worker spins before sleeping (4 is OpenBLAS's minimum).
_THREAD_TIMEOUT = "4"

_active: str | None = None


def _find_library() -> str | None:
    choice = os.environ.get("SEGCACHE_BLAS", "")
    if choice.lower() in ("off", "0", "no", "none"):
        return None
    if choice:
        return choice
    for pattern in _CANDIDATES:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def _preloaded() -> str | None:
    """An OpenBLAS already mapped into this process (LD_PRELOAD or earlier load)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "openblas" in line.lower():
                    return line.split()[-1]
    except OSError:
        pass
    return None


def preload() -> str:
    """Load the system OpenBLAS globally if possible; return a description of the active BLAS."""
    global _active
    if _active is not None:
        return _active
    if not sys.platform.startswith("linux"):
        _active = "Accelerate (macOS)" if sys.platform == "darwin" else "mlx default"
        return _active
    already = _preloaded()
    if already:
        _active = f"OpenBLAS ({already})"
        return _active
    path = _find_library()
    if path is None:
        _active = "reference BLAS of the mlx[cpu] wheel (slow; install libopenblas0-pthread)"
        return _active
    if "mlx.core" in sys.modules:
        _active = (
            "reference BLAS of the mlx[cpu] wheel: mlx was imported before segcache, "
            f"so {path} could not be bound (import segcache first, or LD_PRELOAD it)"
        )
        return _active
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", _THREAD_TIMEOUT)
    try:
        ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError as exc:
        _active = f"reference BLAS of the mlx[cpu] wheel ({path} failed to load: {exc})"
        return _active
    _active = f"OpenBLAS ({path})"
    return _active


def describe() -> str:
    """The BLAS that MLX's CPU matmuls use in this process."""
    return _active if _active is not None else preload()
