"""Resume throughput of the prefix store against mlx-lm's load_prompt_cache, at a realistic KV width.

A llama with 8 KV heads of 128 dims in bfloat16 (16 KiB of K/V per token over
4 layers) holds a 4k- and a 32k-token context. The context is filled with
random K/V (resume speed does not depend on the values, and a 32k-token
prefill would take minutes here); the runtime publishes it and a fresh runtime
resumes it from RAM and from disk. mlx-lm's path saves the same cache with
save_prompt_cache and reads it back with load_prompt_cache.

Every timed run starts with MLX's buffer cache emptied, so neither path
recycles memory the other freed. Both paths are timed to the first token: the state in memory and one new
token's logits evaluated (mlx-lm: load_prompt_cache, then a 1-token forward;
segcache: prefill of the context + 1 token). The rate is state bytes / that time.

Run: .venv/bin/python bench/resume.py [--tokens 4096 32768] [--repeats 5]
"""

from __future__ import annotations

import segcache  # noqa: I001  (first: binds OpenBLAS before mlx loads)

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from segcache import Runtime, open_store
from segcache.testing import models

WIDE = dict(
    hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
    num_key_value_heads=8, head_dim=128, vocab_size=256,
)
PAGE_TOKENS = 256


def median(fn, n):
    times = []
    for _ in range(n):
        mx.clear_cache()  # every run starts from an empty MLX buffer cache: neither path reuses the other's memory
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def filled(model, tokens: int, seed: int):
    """A runtime holding `tokens` random token ids with random K/V in every layer."""
    mx.random.seed(seed)
    rt = Runtime(model)
    shape = (1, WIDE["num_key_value_heads"], tokens, WIDE["head_dim"])
    states = [(mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16)) for _ in rt.cache]
    mx.eval(states)
    ids = [int(t) for t in mx.random.randint(0, WIDE["vocab_size"], (tokens,)).tolist()]
    rt.restore(ids, states)
    return rt, ids, states


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = models.build("llama", seed=0, dtype=mx.bfloat16, **WIDE)
    print("# bench/resume.py: resume throughput, prefix store vs load_prompt_cache")
    print(f"segcache {segcache.__version__} | mlx {mx.__version__} | mlx-lm {mlx_lm.__version__} | python {platform.python_version()}")
    print(f"device: {mx.default_device()} | cpus: {os.cpu_count()} | load avg: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"model: llama, {WIDE['num_hidden_layers']} layers x {WIDE['num_key_value_heads']} KV heads x "
          f"{WIDE['head_dim']} dims, bfloat16; pages of {PAGE_TOKENS} tokens; median of {args.repeats}")
    print(f"\n{'tokens':>7} {'state MB':>9} {'mlx-lm load':>12} {'mlx-lm +1 tok':>14} {'store RAM':>12} {'store disk':>12} {'disk vs mlx-lm':>15}")
    work = Path(tempfile.mkdtemp(prefix="segcache-bench-resume-"))
    try:
        for n in args.tokens:
            rt, ids, states = filled(model, n, seed=n)
            nbytes = sum(k.nbytes + v.nbytes for k, v in states)
            store = open_store(work / f"s{n}", ram_bytes=4 * nbytes, disk_bytes=8 * nbytes, page_tokens=PAGE_TOKENS)
            rt.store = store
            rt.publish()
            store.flush()
            fresh = iter(range(WIDE["vocab_size"]))

            def resume():
                # One new token past the context (another each time, so no checkpoint of an
                # earlier probe answers it): the whole context resumes, the token is computed.
                warm = Runtime(model, store=store)
                warm.prefill(ids + [next(fresh)])
                assert warm.offset == n + 1
                mx.eval([c.state for c in warm.cache])

            before = store.stats()["hit_tokens"]
            t_ram = median(resume, args.repeats)

            def resume_disk():
                store.evict_ram(0)
                resume()

            t_disk = median(resume_disk, args.repeats)
            assert store.stats()["hit_tokens"] - before == 2 * args.repeats * n, "a resume missed"
            store.close()

            caches = []
            for k, v in states:
                c = KVCache()
                c.keys, c.values, c.offset = k, v, k.shape[2]
                caches.append(c)
            f = str(work / f"p{n}.safetensors")
            save_prompt_cache(f, caches)
            t_load = median(lambda: mx.eval([c.state for c in load_prompt_cache(f)]), args.repeats)

            def mlx_first_token():
                loaded = load_prompt_cache(f)
                mx.eval(model(mx.array([[1]]), cache=loaded)[:, -1], [c.state for c in loaded])

            t_mlx = median(mlx_first_token, args.repeats)
            mb = nbytes / 1e6
            rate = lambda t: f"{mb / t:8.0f} MB/s"  # noqa: E731
            print(f"{n:>7} {mb:>9.1f} {rate(t_load):>12} {rate(t_mlx):>14} {rate(t_ram):>12} {rate(t_disk):>12} "
                  f"{t_mlx / t_disk:>14.2f}x")
            os.remove(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n'mlx-lm load' is load_prompt_cache alone; the other columns include one new token's forward;")
    print("'disk vs mlx-lm' is mlx-lm's time to first token over the store's from disk (above 1: the store is faster)")


if __name__ == "__main__":
    main()
