"""DFlash block drafting on the shipped hybrid target, on held-out code.

    python bench/dflash.py --dflash PATH [--blocks 4,8,16] [--rows 1,8] [--tokens 48]
                           [--prompts 8] [--repeats 3]
    python bench/dflash.py --random      (a random drafter of the target's width: a smoke run
                                          of the bench itself; its drafts are almost never accepted)

Prints, in one run:
  * per block size B (ungated, non-adaptive: every round drafts B-1), one row: tokens per
    round (emitted / rounds) and acceptance per block position (rounds that reached position
    j and accepted it);
  * the drafter's cost per block in target forwards: one drafter forward of a block of B
    positions (context of the prompt) against a one-token forward of the target on the same
    row, each the median of several, by the process's CPU time;
  * gated DFlash (the cost gate choosing the width per step from measured costs, 0: plain) and,
    at one row, adaptive DFlash (the width halved / doubled per round, as `stream_generate`
    runs it) against plain decoding at each row count: tok/s and the median of each repeat's
    ratio, the sides interleaved (order rotated per repeat).
Every row's tokens are checked equal to plain decoding's. Prompts: 400-character slices of
models/heldout_stdlib.txt. The machine may be shared: read ratios, not absolute figures.
"""

from __future__ import annotations

import _common  # noqa: F401  (first: binds OpenBLAS before mlx loads)

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

import segcache
from segcache.batch import BatchDecoder
from segcache.batch.gate import Gate
from segcache.dflash import load_dflash
from segcache.dflash.tap import install
from segcache.drafters import make_decoder
from segcache.runtime import Runtime
from segcache.testing.dflash import random_drafter

MODELS = Path(segcache.__file__).parent / "models"


def decoder(model, drafter, rows: int, block: int | None, gated: bool):
    one = rows == 1
    if drafter is None:
        return BatchDecoder(model, one_row=one)
    if block is not None:  # ungated, every round B-1 drafts
        return make_decoder(model, dflash=drafter, num_draft_tokens=block - 1, gate=False, adaptive=False,
                            one_row=one)
    if gated:  # the cost gate picks each step's width (0: plain) from measured costs
        return make_decoder(model, dflash=drafter, gate=Gate(), adaptive=False, one_row=one)
    return make_decoder(model, dflash=drafter, gate=False, adaptive=True, one_row=one)  # stream_generate's


def run(model, drafter, toks, n, rows, block=None, gated=True):
    dec = decoder(model, drafter, rows, block, gated)
    got = {i: [] for i in range(len(toks))}
    rounds, elapsed = [], 0.0
    for at in range(0, len(toks), rows):
        for i in range(at, min(at + rows, len(toks))):
            rt = Runtime(model)
            mx.eval(rt.forward(toks[i][:-1]))
            dec.add(i, rt, toks[i][-1], max_tokens=n)
        if drafter is not None:  # the rows' contexts (lazy after add) are not timed
            mx.eval([r.kv.keys for r in dec.drafter.rows.values() if r.kv.keys is not None])
        t0 = time.perf_counter()
        while dec.rows:
            for rid, emitted in dec.step().items():
                got[rid].extend(t for t, _, _ in emitted)
                if dec.rows[rid].finished or len(got[rid]) >= n:
                    s = dec.rows[rid].stats
                    rounds += list(zip(s.drafted_per_round, s.accepted_per_round))
                    dec.remove(rid)
        elapsed += time.perf_counter() - t0
    total = sum(min(n, len(g)) for g in got.values())
    return total / elapsed, {i: g[:n] for i, g in got.items()}, rounds


def per_position(rounds, width) -> str:
    out = []
    for j in range(1, width + 1):
        reached = [a for d, a in rounds if d >= j and a >= j - 1]
        out.append(f"{sum(a >= j for a in reached) / max(len(reached), 1):.2f}")
    return " ".join(out)


def block_cost(model, drafter, toks, block: int, repeats: int = 7) -> float:
    """One drafter block forward over a prompt's context, in one-token target forwards (CPU time)."""
    tap = install(model, drafter.cfg.target_layer_ids)
    rt = Runtime(model)
    mx.eval(rt.forward(toks[:-1]))
    h = tap.take()
    keys, values = drafter.context_kv(drafter.context(h), 0)
    mx.eval(keys, values)
    x = mx.array([[toks[-1]] + [drafter.cfg.mask_token_id] * (block - 1)], dtype=mx.uint32)
    d, t = [], []
    for _ in range(repeats):
        c0 = time.process_time()
        mx.eval(drafter.block(x, keys, values, len(toks) - 1))
        d.append(time.process_time() - c0)
        with rt.fork():
            c0 = time.process_time()
            mx.eval(rt.forward([toks[-1]]))
            t.append(time.process_time() - c0)
    return statistics.median(d) / statistics.median(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dflash", help="the drafter's checkpoint directory")
    ap.add_argument("--random", action="store_true", help="a random drafter (a smoke run of the bench)")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, tok = mlx_lm.load(str(MODELS / "target"))
    if args.dflash:
        drafter, source = load_dflash(args.dflash, model), args.dflash
    elif args.random:
        drafter, source = random_drafter(model, tempfile.mkdtemp(), layers=1, block_size=16), "random"
    else:
        print("bench/dflash.py: pass --dflash PATH (or --random for a smoke run)", file=sys.stderr)
        return 2
    text = (MODELS / "heldout_stdlib.txt").read_text()
    toks = [tok.encode(text[i * 1500 : i * 1500 + 400]) for i in range(args.prompts)]
    print(f"BLAS {segcache.BLAS}; drafter {source}; {args.prompts} prompts, {args.tokens} tokens; machine may be shared")
    _, want, _ = run(model, None, toks, args.tokens, 1)
    for b in [int(x) for x in args.blocks.split(",")]:
        _, got, rounds = run(model, drafter, toks, args.tokens, 1, block=b)
        assert got == want, f"block {b}: not plain decoding's tokens"
        emitted = sum(a + 1 for _, a in rounds)
        cost = block_cost(model, drafter, toks[0], b)
        print(f"B={b:2d}  tokens/round {emitted / max(len(rounds), 1):.2f}  draft cost {cost:.2f} target "
              f"forwards/block  acceptance per position: {per_position(rounds, b - 1)}")
    for rows in [int(x) for x in args.rows.split(",")]:
        sides = ["plain", "gated"] + (["adaptive"] if rows == 1 else [])
        tps: dict = {s: [] for s in sides}
        for r in range(args.repeats):
            for side in sides[r % len(sides):] + sides[: r % len(sides)]:  # rotated per repeat
                d = None if side == "plain" else drafter
                t, got, _ = run(model, d, toks, args.tokens, rows, gated=side == "gated")
                assert got == want, f"{rows} rows, {side}: not plain decoding's tokens"
                tps[side].append(t)
        for side in sides[1:]:
            ratios = [s / p for s, p in zip(tps[side], tps["plain"])]
            print(f"{rows} row(s): plain {statistics.median(tps['plain']):.1f} tok/s, {side} DFlash "
                  f"{statistics.median(tps[side]):.1f} tok/s, ratio median {statistics.median(ratios):.2f}x "
                  f"(min {min(ratios):.2f}, max {max(ratios):.2f}; {args.repeats} repeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
