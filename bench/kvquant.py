"""Quantized KV pages in the prefix store (--kv-bits) against unquantized pages.

For one prompt on the shipped hybrid target (fp32 K/V, as shipped, and cast to
float16, the K/V dtype of most checkpoints) and on a random llama with wide
K/V: the bytes the store keeps per prompt token on disk, and the time to resume
the prompt from the disk tier in a fresh store handle (lookup, read, decode,
load), as tokens/s and as record MB/s, for unquantized pages and for kv_bits 8
and 4 (group size 64, quantized_kv_start 0, so every page is quantized).

Run: .venv/bin/python bench/kvquant.py [--tokens 2048] [--reps 5]
"""

from __future__ import annotations

import segcache  # noqa: I001  (first: binds OpenBLAS before mlx loads)

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

from segcache import Runtime, open_store
from segcache.kvquant import KVQuantization
from segcache.testing import models

MODELS = Path(segcache.__file__).parent / "models"
# K/V of a 7B-class model's width on a few layers: resume time is then the bytes', not the records'
WIDE = dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=1024, num_attention_heads=8,
            num_key_value_heads=8, head_dim=128, vocab_size=1536)


def _runtime(model, store, kv_bits) -> Runtime:
    rt = Runtime(model, store=store)
    if kv_bits is not None:
        rt.quantize_kv(KVQuantization(kv_bits, 64, 0))
    return rt


def publish(model, ids, path, kv_bits) -> int:
    """Prefill ids[:-1] (what generation prefills) into a new store at `path`; its bytes on disk."""
    with open_store(path) as store:
        _runtime(model, store, kv_bits).prefill(ids[:-1])
    with open_store(path) as store:
        return store.stats()["disk_bytes"]


def resume(model, ids, path, kv_bits) -> float:
    """Seconds to resume ids[:-1] from disk in a fresh store handle (lookup, read, decode, load)."""
    with open_store(path) as store:
        rt = _runtime(model, store, kv_bits)
        tic = time.perf_counter()
        steps = rt.prefill_steps(ids[:-1])
        held = next(steps).restored
        mx.eval([layer.state for layer in rt.cache])
        seconds = time.perf_counter() - tic
        steps.close()
        assert held == len(ids) - 1, f"resumed {held} of {len(ids) - 1} tokens"
        return seconds


def table(title: str, model, ids, reps: int) -> None:
    print(f"\n{title}, prompt of {len(ids)} tokens, {reps} resumes each (median)")
    print(f"{'pages':>12} {'disk B/token':>13} {'x unquant.':>10} {'resume ms':>10} {'tokens/s':>10} {'MB/s':>8}")
    plain = None
    for bits in (None, 8, 4):
        with tempfile.TemporaryDirectory() as d:
            nbytes = publish(model, ids, d, bits)
            t = statistics.median(resume(model, ids, d, bits) for _ in range(reps))
        plain = plain or nbytes
        name = "unquantized" if bits is None else f"{bits}-bit"
        print(f"{name:>12} {nbytes / len(ids):>13.1f} {nbytes / plain:>10.3f} {t * 1e3:>10.1f} "
              f"{(len(ids) - 1) / t:>10.0f} {nbytes / t / 1e6:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    _, tok = mlx_lm.load(str(MODELS / "target"))
    text = (MODELS / "heldout_stdlib.txt").read_text()
    ids = list(tok.encode(text[: args.tokens * 8]))[: args.tokens]
    for dtype in (mx.float32, mx.float16):
        model, _ = mlx_lm.load(str(MODELS / "target"))
        model.set_dtype(dtype)
        table(f"shipped target (2 attention layers, 2 KV heads of 64), K/V {dtype}", model, ids, args.reps)
    wide = models.build("llama", dtype=mx.float16, **WIDE)
    table("random llama (8 layers, 8 KV heads of 128), K/V float16", wide, [t % WIDE["vocab_size"] for t in ids],
          args.reps)


if __name__ == "__main__":
    main()
