"""Batched speculation in process: plain vs prompt lookup vs draft model, gated and ungated.

    python bench/batch_spec.py [--rows 8] [--tokens 64] [--repeats 5] [--workload ordinary,repeat]

8 rows of the shipped target (src/segcache/models/target; draft: models/draft)
decode --tokens greedy tokens each in one BatchDecoder. Workloads:

  ordinary  the --sweep prompts of bench/serve.py (400-character slices of heldout_stdlib.txt)
  high      high acceptance, per drafter: of 48 other 400-character slices of
            heldout_stdlib.txt (every 1,500 characters from 13,500), the 8 whose rows accepted the most drafts (that
            drafter, ungated, --tokens tokens). (The tiny target does not copy text
            repeated in its prompt: such prompts gave lookup 28-44% acceptance.)

Configurations run interleaved (rotated each repeat), each on freshly prefilled
rows (prefill not timed); every row's tokens are checked equal to plain batching.
Reports median tok/s (min-max), steps, ms per step, accepted / drafted, and for
the gated decoder the mean verify width and the steps that drafted.
"""

from __future__ import annotations

import _common  # noqa: F401  (first: binds OpenBLAS before mlx loads)

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

from segcache.drafters import make_decoder
from segcache.runtime import Runtime

MODELS = Path(__file__).resolve().parents[1] / "src" / "segcache" / "models"
DRAFT_MIN_PROB = 0.25  # as the server's


def prompts(first: int, rows: int, stride: int = 2000) -> list[str]:
    text = (MODELS / "heldout_stdlib.txt").read_text()
    return [text[i * stride : i * stride + 400] for i in range(first, first + rows)]


def select(mode: str, model, draft, tok, rows: int, count: int, n: int, K: int) -> list[list[int]]:
    """The `count` of 48 candidate prompts (after the ordinary ones) where `mode` accepted the most drafts."""
    cands = [tok.encode(p) for p in prompts(9, 48, 1500)]
    score = []
    for at in range(0, len(cands), rows):
        r = run(mode, model, draft, cands[at : at + rows], n, K)
        score += [(a / max(1, d), at + i) for i, (a, d) in sorted(r["rows"].items())]
    best = sorted(score, reverse=True)[:count]
    print(f"  {mode}: chosen prompts accept {min(a for a, _ in best):.2f}..{max(a for a, _ in best):.2f} "
          f"of their drafts (all 48: median {statistics.median(a for a, _ in score):.2f})")
    return [cands[i] for _, i in sorted(best, key=lambda x: x[1])]


def _settle(batch) -> None:
    """Evaluate what joining left lazy (the prefill), so the first timed step does not carry it."""
    arrays = []
    for layer in batch.cache:
        for v in vars(layer).values():
            vs = v if isinstance(v, (list, tuple)) else [v]
            arrays += [a for a in vs if isinstance(a, mx.array)]
    mx.eval(arrays)


def run(cfg: str, model, draft, toks: list[list[int]], n: int, K: int, rows: int = 0) -> dict:
    """Decode every prompt, at most `rows` at once (0: all at once); a row that finishes is
    replaced by the next prompt, prefilled beforehand (untimed), as a server under load does."""
    mode, gated = cfg.split("-") if "-" in cfg else (cfg, "ungated")
    dec = make_decoder(model, num_draft_tokens=0 if mode == "plain" else K,
                       draft_model=draft if mode == "draft" else None,
                       draft_min_prob=DRAFT_MIN_PROB if mode == "draft" else 0.0, gate=gated == "gated")
    ready = []
    for t in toks:
        rt = Runtime(model)
        out = [rt.forward(t[:-1])]
        drt = None
        if mode == "draft":
            drt = Runtime(draft)
            out.append(drt.forward(t[:-1]))
        mx.eval(out)
        ready.append((rt, t[-1], drt))
    rows = rows or len(toks)
    queue = list(enumerate(ready))[::-1]

    def admit():
        while queue and len(dec.rows) < rows:
            i, (rt, last, drt) = queue.pop()
            dec.add(i, rt, last, max_tokens=n, draft_runtime=drt)

    admit()
    _settle(dec.batch)
    if dec.mode == "draft":
        _settle(dec.drafter.rows)
    got = {i: [] for i in range(len(toks))}
    steps, widths, done = 0, [], {}
    t0 = time.perf_counter()
    while dec.rows or queue:
        admit()
        out = dec.step()
        steps += 1
        if dec.gate is not None:
            widths.append(dec.gate.last.get("width", 0))
        for rid, emitted in out.items():
            got[rid].extend(t for t, _, _ in emitted)
            if len(got[rid]) >= n:
                done[rid] = dec.rows[rid]
                dec.remove(rid)
    dt = time.perf_counter() - t0
    total = sum(min(n, len(g)) for g in got.values())
    return {"tps": total / dt, "steps": steps, "ms": 1000 * dt / steps, "tokens": {i: g[:n] for i, g in got.items()},
            "drafted": sum(s.drafted for s in done.values()), "accepted": sum(s.accepted for s in done.values()),
            "widths": widths, "rows": {i: (s.accepted, s.drafted) for i, s in done.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--workload", default="ordinary,high")
    ap.add_argument("--queue", type=int, default=0,
                    help="prompts per workload, --rows at a time, a finished row replaced at once (0: one batch of --rows)")
    ap.add_argument("--configs", default="plain,lookup,lookup-gated,draft,draft-gated")
    args = ap.parse_args()
    model, tok = mlx_lm.load(str(MODELS / "target"))
    draft, _ = mlx_lm.load(str(MODELS / "draft"))
    configs = args.configs.split(",")
    work, count = [], args.queue or args.rows
    for kind in args.workload.split(","):
        if kind == "ordinary":
            work.append((kind, [tok.encode(p) for p in prompts(0, count)], configs))
        else:  # one workload per drafter, chosen where it accepts most; plain as the reference
            for mode in ("lookup", "draft"):
                mine = [c for c in configs if c == "plain" or c.startswith(mode)]
                work.append((f"high for {mode}", select(mode, model, draft, tok, args.rows, count, args.tokens, args.K), mine))
    for kind, toks, configs in work:
        run("plain", model, draft, toks, 8, args.K)  # warm-up
        res = {c: [] for c in configs}
        for r in range(args.repeats):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for c in order:
                res[c].append(run(c, model, draft, toks, args.tokens, args.K, args.rows))
        ref = res[configs[0]][0]["tokens"]
        print(f"\n{kind}: {len(toks)} prompts, {args.rows} rows at a time, {args.tokens} tokens each, K={args.K}, {args.repeats} repeats interleaved")
        print(f"{'config':<14}{'tok/s median (min-max)':>26}{'steps':>7}{'ms/step':>9}{'acc/drafted':>14}{'drafting steps, mean K':>24}")
        for c in configs:
            rs = res[c]
            assert all(x["tokens"] == ref for x in rs), f"{c}: tokens differ from {configs[0]}"
            tps = [x["tps"] for x in rs]
            mid = sorted(rs, key=lambda x: x["tps"])[len(rs) // 2]
            w = [k for x in rs for k in x["widths"]]
            wcell = f"{sum(1 for k in w if k) / len(rs):.1f}, {statistics.mean(w):.2f}" if w else "-"
            acc = f"{mid['accepted']}/{mid['drafted']}" if mid["drafted"] else "-"
            print(f"{c:<14}{statistics.median(tps):>12.0f} ({min(tps):.0f}-{max(tps):.0f}){'':>6}"
                  f"{mid['steps']:>7}{mid['ms']:>9.1f}{acc:>14}{wcell:>24}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
