"""Automatic prefix cache figures on a hybrid model, against mlx-lm's own prompt-cache path.

* time to first token of a 4k-token prompt: cold prefill, warm from RAM, warm
  from disk (zstd and raw records), mlx-lm's load_prompt_cache + last-token forward
* suspend / resume MB/s against save_prompt_cache / load_prompt_cache, compression ratio
* bytes on disk for 10 prompts sharing a 4k prefix vs 10 save_prompt_cache files
* hit rate over a multi-turn chat trace: checkpoints at prompt ends and branch
  points ("auto") vs only on the page grid ("grid")
* the remote tier: time to first token of a host with an empty disk resuming the
  prompt from a redis-server on loopback, next to local disk and cold, and the
  bytes the server sent per hit (skipped without a redis-server/valkey-server)

Run: .venv/bin/python bench/apc.py [--quick]
"""

from __future__ import annotations

import segcache  # noqa: I001  (first: binds OpenBLAS before mlx loads)

import argparse
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from segcache import Runtime, open_store
from segcache.store import PrefixCache
from segcache.testing import models

TARGET = Path(segcache.__file__).parent / "models" / "target"
RANDOM_HYBRID = dict(
    hidden_size=256, num_hidden_layers=8, intermediate_size=704, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=4, vocab_size=2048,
)
BIG = 1 << 34


class GridCache(PrefixCache):
    """The baseline policy: checkpoints only on the page grid (no prompt ends, no branch points)."""

    def stops(self, plan, start, length):
        P = self.layout.page_tokens
        return list(range((start // P + 1) * P, length, P)) if self.layout.stateful else []

    def chosen(self, snaps):
        return [s for s in snaps if s.length % self.layout.page_tokens == 0]


def load_model():
    if TARGET.exists():
        model, _ = mlx_lm.load(str(TARGET))
        return model, f"demo target {TARGET}"
    model = models.build("qwen3_5", seed=0, **RANDOM_HYBRID)
    return model, "random qwen3_5 (" + ", ".join(f"{k}={v}" for k, v in RANDOM_HYBRID.items()) + ")"


def median_of(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out), min(out), max(out)


def fmt(t):
    return f"{t[0] * 1e3:9.2f} ms [{t[1] * 1e3:.2f}-{t[2] * 1e3:.2f}]"


def cache_bytes(cache):
    total = 0
    for c in cache:
        for a in c.state if isinstance(c.state, (list, tuple)) else []:
            if isinstance(a, mx.array):
                total += a.nbytes
            elif isinstance(a, list):
                total += sum(x.nbytes for x in a if isinstance(x, mx.array))
    return total


def _hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True


def _redis(work: Path):
    exe = shutil.which("redis-server") or shutil.which("valkey-server")
    if exe is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    c = redis.Redis(port=port)
    for _ in range(200):
        try:
            c.ping()
            return proc, c
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def remote_section(model, prompt, work, reps, cold, disk_store):
    """Interleaved per repeat: a local disk hit, a serving host's remote hit, a new host's remote hit.

    The machine may be shared: each repeat measures all three back to back, and the
    ratios are medians of per-repeat ratios, so load that shifts between repeats
    cancels out.
    """
    print("\n## remote tier: resuming the prompt from redis-server on loopback, interleaved with local disk hits")
    proc, c = _redis(work)
    if proc is None:
        print("  skipped: no redis-server or valkey-server on PATH (make redis installs it with apt)")
        return
    url = f"redis://127.0.0.1:{c.connection_pool.connection_kwargs['port']}/0"
    try:
        with open_store(work / "pub", ram_bytes=1 << 31, disk_bytes=BIG, remote=url) as s:
            Runtime(model, store=s).prefill(prompt)
            s.drain_remote()  # waits for the write-through
            written = s.stats()["remote_writes"]
        # A serving host (one warm handle, as the local disk figure uses) whose local copies are gone.
        serving = open_store(work / "serving", ram_bytes=1 << 31, disk_bytes=BIG, remote=url)
        serving.remote_info()

        def timed(s):
            t0 = time.perf_counter()
            mx.eval(Runtime(model, store=s).prefill(prompt))
            return time.perf_counter() - t0

        def disk_hit():
            disk_store.evict_ram(0)
            return timed(disk_store)

        def serving_hit():
            for e in serving.entries():
                serving.delete(e.key)
            return timed(serving)

        sent, hosts, opens = [], [0], []

        def new_host_hit():
            hosts[0] += 1
            before = c.info("stats")["total_net_output_bytes"]
            t0 = time.perf_counter()
            s = open_store(work / f"host{hosts[0]}", ram_bytes=1 << 31, disk_bytes=BIG, remote=url)
            opens.append(time.perf_counter() - t0)
            try:
                t = timed(s)  # the first prefill of a fresh handle (its connection is made at open, off this thread)
                sent.append(c.info("stats")["total_net_output_bytes"] - before)
                assert s.stats()["hit_tokens"] == len(prompt), s.stats()
            finally:
                s.close()
            return t

        # A fresh handle over a local disk that holds the prompt: what a new host pays apart from the remote.
        with open_store(work / "fresh-disk", ram_bytes=1 << 31, disk_bytes=BIG) as fd:
            Runtime(model, store=fd).prefill(prompt)

        def fresh_disk_hit():
            s = open_store(work / "fresh-disk", ram_bytes=1 << 31, disk_bytes=BIG)
            try:
                return timed(s)
            finally:
                s.close()

        disk_hit(), serving_hit(), fresh_disk_hit()  # warm-up
        d, w, n, fdk = [], [], [], []
        for _ in range(reps):
            d.append(disk_hit())
            w.append(serving_hit())
            n.append(new_host_hit())
            fdk.append(fresh_disk_hit())
        assert serving.stats()["hit_tokens"] == len(prompt) * (reps + 1)
        serving.close()

        def m(xs):
            return statistics.median(xs), min(xs), max(xs)

        rw = statistics.median(b / a for a, b in zip(d, w))
        rn = statistics.median(b / a for a, b in zip(d, n))
        rf = statistics.median(b / a for a, b in zip(fdk, n))
        used = c.info("memory")["used_memory"]
        print(f"  published {written} records; remote holds {c.dbsize()} keys, {used / 1e6:.1f} MB")
        print(f"  local disk hit (raw)    {fmt(m(d))}   (same run, interleaved)")
        print(f"  serving host, remote    {fmt(m(w))}   {cold[0] / m(w)[0]:7.1f}x faster than cold, {rw:.2f}x a local disk hit"
              "   (one warm handle, local copies dropped before each hit)")
        print(f"  new host, remote        {fmt(m(n))}   {cold[0] / m(n)[0]:7.1f}x faster than cold, {rn:.2f}x a local disk hit"
              f"   (first prefill of a fresh handle; open_store itself {statistics.median(opens) * 1e3:.1f} ms)")
        print(f"  new host, local disk    {fmt(m(fdk))}   (a fresh handle over a disk holding the prompt); "
              f"new host remote / this: {rf:.2f}x")
        print(f"  bytes sent per hit      {statistics.median(sent) / 1e6:.2f} MB (server to host, incl. protocol)")
        keys = list(c.scan_iter(match=b"segcache:1:*"))
        dt = median_of(lambda: c.mget(keys), reps)
        print(f"  of which one MGET       {fmt(dt)}   (redis-py{' + hiredis' if _hiredis() else ', no hiredis'})")
    finally:
        proc.kill()
        proc.wait(10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a shorter chat trace (~1-2 min)")
    ap.add_argument("--remote-only", action="store_true", help="stop after the time-to-first-token and remote sections")
    ap.add_argument("--reps", type=int, default=None, help="repeats per figure (default 3 with --quick, else 7)")
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 7)
    model, what = load_model()
    vocab = model.language_model.args.vocab_size if hasattr(model, "language_model") else model.args.vocab_size
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print("# bench/apc.py: automatic prefix cache")
    print(f"segcache {segcache.__version__} | mlx {mx.__version__} | mlx-lm {mlx_lm.__version__} | python {platform.python_version()}")
    print(f"device: {mx.default_device()} | cpus: {os.cpu_count()} | load avg: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"BLAS: {segcache.BLAS}")
    print(f"model: {what}, {params / 1e6:.1f}M params")
    rnd = random.Random(0)
    prompt = [rnd.randrange(vocab) for _ in range(4096)]
    work = Path(tempfile.mkdtemp(prefix="segcache-bench-apc-"))
    try:
        # -- time to first token ------------------------------------------------
        print("\n## time to first token, 4096-token prompt (median [min-max] of", reps, "runs)")
        cold = median_of(lambda: mx.eval(Runtime(model).prefill(prompt)), max(1, reps // 2))
        stores = {name: open_store(work / name, ram_bytes=1 << 31, disk_bytes=BIG, compress=c) for name, c in (("zstd", True), ("raw", False))}
        for s in stores.values():
            Runtime(model, store=s).prefill(prompt)
        ram = median_of(lambda: mx.eval(Runtime(model, store=stores["raw"]).prefill(prompt)), reps)
        suspend = {}
        for name, s in stores.items():
            t0 = time.perf_counter()
            s.flush()
            suspend[name] = time.perf_counter() - t0
        raw_bytes = sum(e.nbytes for e in stores["raw"].entries())
        disk = {}
        for name, s in stores.items():
            def warm(s=s):
                s.evict_ram(0)
                mx.eval(Runtime(model, store=s).prefill(prompt))
            disk[name] = median_of(warm, reps)
            assert s.stats()["hit_tokens"] >= len(prompt) * reps
        # mlx-lm: save the cache of prompt[:-1], then load it and forward the last token
        cache = make_prompt_cache(model)
        for i in range(0, len(prompt) - 1, 2048):
            model(mx.array(prompt[i : min(i + 2048, len(prompt) - 1)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        f = str(work / "prompt.safetensors")
        t0 = time.perf_counter()
        save_prompt_cache(f, cache)
        t_save = time.perf_counter() - t0
        file_bytes = os.path.getsize(f)

        def mlx_path():
            c = load_prompt_cache(f)
            mx.eval(model(mx.array(prompt[-1:])[None], cache=c)[:, -1])

        mlx = median_of(mlx_path, reps)
        t_load = median_of(lambda: mx.eval([c.state for c in load_prompt_cache(f)]), reps)
        print(f"  cold prefill            {fmt(cold)}")
        print(f"  warm from RAM           {fmt(ram)}   {cold[0] / ram[0]:7.1f}x faster than cold, {ram[0] / mlx[0]:.2f}x mlx-lm's path")
        for name in stores:
            print(f"  warm from disk ({name:<4})  {fmt(disk[name])}   {cold[0] / disk[name][0]:7.1f}x faster than cold, {disk[name][0] / mlx[0]:.2f}x mlx-lm's path")
        print(f"  mlx-lm load + 1 token   {fmt(mlx)}   {cold[0] / mlx[0]:7.1f}x faster than cold")
        remote_section(model, prompt, work, reps, cold, stores["raw"])
        if args.remote_only:
            return

        # -- suspend / resume throughput --------------------------------------------
        print("\n## suspend / resume of the same state (raw bytes / second)")
        print(f"  state: {raw_bytes / 1e6:.1f} MB in {len(stores['raw'].entries())} records; save_prompt_cache file {file_bytes / 1e6:.1f} MB")
        for name, s in stores.items():
            on_disk = sum(e.nbytes for e in s.entries())
            print(f"  suspend ({name:<4}) {raw_bytes / suspend[name] / 1e6:8.0f} MB/s   resume {raw_bytes / disk[name][0] / 1e6:8.0f} MB/s   "
                  f"ratio {raw_bytes / on_disk:.3f}")
        print(f"  save_prompt_cache {file_bytes / t_save / 1e6:6.0f} MB/s   load_prompt_cache {file_bytes / t_load[0] / 1e6:8.0f} MB/s")
        for s in stores.values():
            s.close()

        # -- deduplication ------------------------------------------------------------
        print("\n## 10 prompts sharing the 4096-token prefix (+ 200 own tokens each)")
        dedup = open_store(work / "dedup", ram_bytes=1 << 31, disk_bytes=BIG, compress=False)
        Runtime(model, store=dedup).prefill(prompt)
        files = 0
        for k in range(10):
            own = prompt + [rnd.randrange(vocab) for _ in range(200)]
            Runtime(model, store=dedup).prefill(own)
            c = load_prompt_cache(f)
            model(mx.array(own[len(prompt) - 1 :])[None], cache=c)
            mx.eval([x.state for x in c])
            g = str(work / f"p{k}.safetensors")
            save_prompt_cache(g, c)
            files += os.path.getsize(g)
        dedup.flush()
        ours = dedup.stats()["disk_bytes"]
        dedup.close()
        print(f"  prefix store {ours / 1e6:8.1f} MB   10 save_prompt_cache files {files / 1e6:8.1f} MB   ({files / ours:.1f}x less)")

        # -- chat trace ------------------------------------------------------------------
        convs, turns = (3, 3) if args.quick else (6, 5)
        print(f"\n## hit rate over a chat trace: {convs} conversations x {turns} turns, shared 600-token system prompt, pages of 256")
        system = [rnd.randrange(vocab) for _ in range(600)]
        trace = []
        for c in range(convs):
            r2 = random.Random(100 + c)
            turns_ = [([r2.randrange(vocab) for _ in range(r2.randint(30, 150))], [r2.randrange(vocab) for _ in range(r2.randint(50, 250))]) for _ in range(turns)]
            trace.append(turns_)
        for policy in ("auto", "grid"):
            s = open_store(work / f"chat-{policy}", ram_bytes=1 << 31, disk_bytes=BIG, compress=False)
            t0 = time.perf_counter()
            for turns_ in trace:
                history = list(system)
                for user, reply in turns_:
                    history = history + user
                    rt = Runtime(model, store=s)
                    if policy == "grid":
                        rt._prefix = GridCache(rt)  # the runtime's prefix cache, with the baseline policy
                    rt.prefill(history, step_size=2048)
                    rt.forward(reply)  # what the model would have generated
                    if policy == "auto":
                        rt.publish()
                    history = history + reply
            st = s.stats()
            s.close()
            print(f"  {policy:<5} hit rate {st['hit_tokens'] / st['prefill_tokens']:6.1%}  ({st['hit_tokens']} of {st['prefill_tokens']} prompt tokens, "
                  f"{st['hits']}/{st['prefills']} prefills hit)  {time.perf_counter() - t0:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
