"""Publish time per prompt: a publish's node merges in one write transaction against one per node.

    python bench/publish.py [--rounds 5] [--page 16] [--families llama,qwen3_5] [--dir PATH]
    python bench/publish.py --model src/segcache/models/target --page 256

A published prompt merges the index nodes it extends (`PrefixCache.publish`); each
merge used to be its own LMDB write transaction (`PrefixStore.update`, an fsync each),
on the model thread, before the first token. Now `update_many` does all of a
publish's merges in one transaction, and a node already holding the prompt's
additions begins none. Here two stores on the same disk (--dir, default the system's
temporary directory) get the same prompts: "batched" (the shipped path)
and "one-by-one" (update_many patched to one transaction per node, the old path).
Each round, per family (tiny models of `segcache.testing.models`, or --model, pages
of --page tokens): a cold burst of 8 prompts sharing a 3-page system prompt (each 2 pages of
its own), then a 6-turn chat (each turn about a page more), then every prompt
republished (`Runtime.publish`, nothing new). Prompts go to the two stores one after
another, in an order that alternates, and the time inside `PrefixCache.publish` is
taken, and that of the whole `Runtime.prefill` (resume, compute, publish: the time
to the first token's logits in process; a chat turn resumes the turn before from RAM).
Printed: medians per kind of publish, the ratios batched / one-by-one, and the
write transactions begun per publish. On a shared machine only ratios of one run
mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import mlx_lm
import numpy as np

from segcache import Runtime
from segcache.store import open_store
from segcache.store.prefix_cache import PrefixCache
from segcache.store.store import PrefixStore
from segcache.testing import models

_publish = PrefixCache.publish
TIMES: dict[int, list[float]] = {}  # id(store) -> seconds of the last publishes


def timed_publish(self, rt, ids, snaps):
    tic = time.perf_counter()
    try:
        return _publish(self, rt, ids, snaps)
    finally:
        TIMES.setdefault(id(self.store), []).append(time.perf_counter() - tic)


class Counting:
    """An LMDB environment counting the write transactions begun on it."""

    def __init__(self, env):
        self._env, self.writes = env, 0

    def begin(self, *args, write=False, **kw):
        self.writes += bool(write)
        return self._env.begin(*args, write=write, **kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


def workload(rng, P: int, vocab: int) -> list[tuple[str, list[int]]]:
    system = rng.integers(3, vocab, 3 * P).tolist()
    out = [("cold", system + rng.integers(3, vocab, 2 * P + 5).tolist()) for _ in range(8)]
    chat = system + rng.integers(3, vocab, P // 2).tolist()
    for _ in range(6):
        chat = chat + rng.integers(3, vocab, P + 3).tolist()
        out.append(("chat", list(chat)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--families", default="llama,qwen3_5")
    ap.add_argument("--model", type=Path, default=None, help="an mlx-lm model directory instead of the tiny families")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    PrefixCache.publish = timed_publish
    print(f"# publish time per prompt, pages of {args.page} tokens, {args.rounds} rounds, disk at {args.dir} (shared machine)")
    print(f"{'family':9} {'publish':10} {'n':>4} {'one-by-one ms':>14} {'batched ms':>11} {'ratio':>6}"
          f" {'prefill one ms':>15} {'batched ms':>11} {'ratio':>6} {'writes/publish (one, batched)':>30}")
    for fam in [args.model.name] if args.model else args.families.split(","):
        if args.model:
            model, _ = mlx_lm.load(str(args.model))
            vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
        else:
            model, vocab = models.build(fam), models.VOCAB
        rows: dict[str, dict[str, list]] = {}
        for r in range(args.rounds):
            rng = np.random.default_rng(100 + r)
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                stores = {m: open_store(Path(tmp) / m, ram_bytes=1 << 28, disk_bytes=1 << 30, page_tokens=args.page)
                          for m in ("one", "batched")}
                one = stores["one"]
                one.update_many = lambda items, s=one: [PrefixStore.update_many(s, [it])[0] for it in items]
                envs = {m: Counting(s._disk.env) for m, s in stores.items()}
                for m, s in stores.items():
                    s._disk.env = envs[m]
                runtimes: dict[str, list[Runtime]] = {m: [] for m in stores}
                for i, (kind, ids) in enumerate(workload(rng, args.page, vocab)):
                    order = ["one", "batched"] if (i + r) % 2 == 0 else ["batched", "one"]
                    for m in order:
                        rt = Runtime(model, store=stores[m])
                        w0 = envs[m].writes
                        tic = time.perf_counter()
                        rt.prefill(ids)
                        seconds = time.perf_counter() - tic
                        row = rows.setdefault(kind, {"one": [], "batched": [], "w_one": [], "w_batched": [], "p_one": [], "p_batched": []})
                        row["p_" + m].append(seconds)
                        row[m].append(TIMES[id(stores[m])][-1])
                        row["w_" + m].append(envs[m].writes - w0)
                        runtimes[m].append(rt)
                for k in range(len(runtimes["one"])):
                    order = ["one", "batched"] if (k + r) % 2 == 0 else ["batched", "one"]
                    for m in order:
                        w0 = envs[m].writes
                        tic = time.perf_counter()
                        runtimes[m][k].publish()
                        seconds = time.perf_counter() - tic
                        row = rows.setdefault("republish", {"one": [], "batched": [], "w_one": [], "w_batched": [], "p_one": [], "p_batched": []})
                        row["p_" + m].append(seconds)
                        row[m].append(TIMES[id(stores[m])][-1])
                        row["w_" + m].append(envs[m].writes - w0)
                for s in stores.values():
                    s.close()
        for kind, row in rows.items():
            a, b = statistics.median(row["one"]) * 1e3, statistics.median(row["batched"]) * 1e3
            pa, pb = statistics.median(row["p_one"]) * 1e3, statistics.median(row["p_batched"]) * 1e3
            w = f"{statistics.mean(row['w_one']):.2f}, {statistics.mean(row['w_batched']):.2f}"
            print(f"{fam:9} {kind:10} {len(row['one']):4d} {a:14.2f} {b:11.2f} {b / a:6.2f} {pa:15.2f} {pb:11.2f} {pb / pa:6.2f} {w:>30}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
