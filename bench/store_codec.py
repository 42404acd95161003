"""Prefix-store substrate figures: codec, checksum, LMDB put/get, weights fingerprint.

Compares resume (LMDB get + checks + decode to mx.array) with mlx-lm's
save_prompt_cache/load_prompt_cache of the same bytes, measured in this run.
Run: .venv/bin/python bench/store_codec.py [--tokens 4096 [32768 ...]] [--resume-only]
"""

import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import argparse
import os
import shutil
import tempfile
import time
import zlib
import hashlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from segcache.store import Record, open_store, weights_fingerprint
from segcache.store import codec


def best(f, n=5):
    t = 1e9
    for _ in range(n):
        s = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - s)
    return t


def kv(dtype, layers=8, tokens=4096, heads=8, dim=64):
    mx.random.seed(0)
    scale = mx.exp(mx.random.normal((1, heads, 1, dim)))  # per-channel scale, like real keys
    out = {}
    for i in range(layers):
        out[f"{i}.k"] = (mx.random.normal((1, heads, tokens, dim)) * scale).astype(dtype)
        out[f"{i}.v"] = mx.random.normal((1, heads, tokens, dim)).astype(dtype)
    mx.eval(list(out.values()))
    return out


def resume_state(tokens: int, layers: int = 24, heads: int = 8, dim: int = 128, page: int = 256) -> None:
    """get_many of a whole prompt state (pages of every layer's K/V, bf16) vs load_prompt_cache."""
    mx.random.seed(0)
    pages = []
    for _ in range(tokens // page):
        arrays = {}
        for i in range(layers):
            arrays[f"{i}.k"] = mx.random.normal((1, heads, page, dim)).astype(mx.bfloat16)
            arrays[f"{i}.v"] = mx.random.normal((1, heads, page, dim)).astype(mx.bfloat16)
        mx.eval(list(arrays.values()))
        pages.append(arrays)
    nbytes = sum(a.nbytes for p in pages for a in p.values())
    d = tempfile.mkdtemp()
    try:
        caches = []
        for i in range(layers):
            c = KVCache()
            c.update_and_fetch(mx.concatenate([p[f"{i}.k"] for p in pages], axis=2), mx.concatenate([p[f"{i}.v"] for p in pages], axis=2))
            caches.append(c)
        f = os.path.join(d, "p.safetensors")
        save_prompt_cache(f, caches)
        del caches
        tl = best(lambda: mx.eval([x for c in load_prompt_cache(f) for x in c.state]), 3)
        s = open_store(os.path.join(d, "s"), ram_bytes=0, disk_bytes=max(8 << 30, 3 * nbytes))
        keys = [b"page-%d" % j for j in range(len(pages))]
        for k, p in zip(keys, pages):
            s.put(k, Record("page", page, p))
        s.flush()
        del pages
        expects = [{n: ("bfloat16", (1, heads, page, dim)) for i in range(layers) for n in (f"{i}.k", f"{i}.v")}] * len(keys)

        def resume():
            recs = s.get_many(keys, expects=expects)
            mx.eval([a for r in recs for a in r.arrays.values()])
            s.evict_ram(0)  # clean records: dropped from RAM, so the next round reads disk again

        tg = best(resume, 3)
        value = s._disk._run(lambda txn: bytes(txn.get(keys[0], db=s._disk.records)))
        tcrc = best(lambda: zlib.crc32(value), 5) * len(keys)
        s.close()
        print(f"  {tokens} tokens x {layers} layers x {heads} heads x {dim} bf16 = {nbytes / 1e6:.0f} MB in {len(keys)} records: "
              f"load_prompt_cache {nbytes / tl / 1e6:6.0f} MB/s, store get_many {nbytes / tg / 1e6:6.0f} MB/s "
              f"({tg / tl:.2f}x its time); CRC-32 alone {nbytes / tcrc / 1e6:6.0f} MB/s on one thread")
    finally:
        shutil.rmtree(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096])
    ap.add_argument("--resume-only", action="store_true")
    args = ap.parse_args()
    print("== resume a prompt state: one get_many (one read transaction) vs mlx-lm load_prompt_cache")
    for t in args.tokens:
        resume_state(t)
    if args.resume_only:
        return
    print("== codec (zstd level 1), KV-like arrays, one array of 8 heads x 4096 x 64")
    for name, dt in (("fp32", mx.float32), ("bf16", mx.bfloat16)):
        a = kv(dt, layers=1)["0.k"]
        raw = np.asarray(a.view(mx.uint16) if dt == mx.bfloat16 else a).reshape(-1).view(np.uint8)
        n, item = raw.nbytes, dt.size
        for label, src in (("plain", raw), ("shuffle", codec.shuffle(raw, item))):
            c = codec._cctx().compress(src)
            tc = best(lambda: codec._cctx().compress(src))
            td = best(lambda: codec._dctx().decompress(c, max_output_size=n))
            print(f"  {name} {label:<8} ratio {n / len(c):.3f}  compress {n / tc / 1e6:6.0f} MB/s  decompress {n / td / 1e6:6.0f} MB/s")
        sh = codec.shuffle(raw, item)
        print(f"  {name} shuffle {n / best(lambda: codec.shuffle(raw, item)) / 1e6:.0f} MB/s, unshuffle {n / best(lambda: codec.unshuffle(sh, item)) / 1e6:.0f} MB/s")
    buf = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    print(f"  checksum crc32 {buf.nbytes / best(lambda: zlib.crc32(buf)) / 1e6:.0f} MB/s, blake2b {buf.nbytes / best(lambda: hashlib.blake2b(buf).digest(), 2) / 1e6:.0f} MB/s")

    print("== resume vs mlx-lm, 8 layers x (k, v) x 4096 tokens; store with compress on / off")
    for name, dt in (("fp32", mx.float32), ("bf16", mx.bfloat16)):
        arrays = kv(dt)
        nbytes = sum(a.nbytes for a in arrays.values())
        d = tempfile.mkdtemp()
        try:
            caches = []
            for i in range(8):
                c = KVCache()
                c.update_and_fetch(arrays[f"{i}.k"], arrays[f"{i}.v"])
                caches.append(c)
            f = os.path.join(d, "p.safetensors")
            ts = best(lambda: save_prompt_cache(f, caches), 3)
            tl = best(lambda: mx.eval([x for c in load_prompt_cache(f) for x in c.state]))
            print(f"  {name} {nbytes / 1e6:.0f} MB  mlx-lm save {nbytes / ts / 1e6:6.0f} MB/s  load {nbytes / tl / 1e6:6.0f} MB/s")
            for compress in (True, False):
                p = os.path.join(d, f"s{compress}")
                s = open_store(p, ram_bytes=0, disk_bytes=8 << 30, compress=compress)
                rec = Record("kv", 4096, arrays)
                value = codec.encode(rec, key=b"k", compress=compress)
                te = best(lambda: codec.encode(rec, key=b"k", compress=compress), 3)
                tdec = best(lambda: codec.decode(value, key=b"k"))
                tput = best(lambda: s.put(b"k", rec), 3)  # ram_bytes=0: encode + one LMDB txn
                tget = best(lambda: mx.eval(list(s._disk.get(b"k").arrays.values())))
                traw = best(lambda: s._disk._run(lambda txn: bytes(txn.get(b"k", db=s._disk.records))))
                s.close()
                print(
                    f"    store compress={compress!s:<5} ratio {nbytes / len(value):.3f}  encode {nbytes / te / 1e6:6.0f} MB/s  "
                    f"decode {nbytes / tdec / 1e6:6.0f} MB/s  suspend(put) {nbytes / tput / 1e6:6.0f} MB/s  "
                    f"resume(get) {nbytes / tget / 1e6:6.0f} MB/s ({tget / tl:.2f}x load_prompt_cache)  "
                    f"LMDB raw get {len(value) / traw / 1e6:6.0f} MB/s"
                )
        finally:
            shutil.rmtree(d)

    print("== weights fingerprint")

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(4096, 4096, bias=False) for _ in range(16)]

    big = Big()
    mx.eval(big.parameters())
    t = best(lambda: weights_fingerprint(big))
    print(f"  {16 * 4096 * 4096 * 4 / 1e9:.2f} GB fp32 in 16 tensors: {t * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
