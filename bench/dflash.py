"""DFlash block drafting against plain decoding, the MTP head and prompt lookup, on held-out code.

    python bench/dflash.py --dflash PATH [--blocks 4,8,16] [--rows 1,8] [--tokens 48]
                           [--prompts 8] [--repeats 3] [--drafters mtp,lookup,dflash,lookup+dflash]
    python bench/dflash.py ... [--gate-clock default|wall|cpu|both]   (the gated rows' clock;
                                          both: a "gated" row on the default and a "gated-cpu"
                                          row on the process's CPU time, in the same repeats)
    python bench/dflash.py --random      (a random drafter of the target's width: a smoke run
                                          of the bench itself; its drafts are almost never accepted)
    python bench/dflash.py ... --target wide [--wide-layers 16] [--wide-mlp 12288] [--wide-bits 4]
                                         (the shipped target's function at a ~155M model's cost: a
                                          drafter tapping layer i reads the same states; built once
                                          into bench/.cache)

One run, per row count (one row: `one_row`, the target's Runtime; 8 rows: a BatchRuntime), for
each drafter (the shipped MTP head, prompt lookup, DFlash, and DFlash beside prompt lookup,
each row taking the proposal it expects more of):
  * at every block size B (ungated, non-adaptive: every round drafts B-1, the MTP head B-1
    deep) and gated (the cost gate choosing each step's width from measured costs, 0: plain;
    widths up to B-1 of the drafter's own block, 4 for prompt lookup and the head, as the
    server runs them), gated-warm (one gate kept across the repeats, as `segcache serve` keeps
    its decoder's gate across requests: it explores once, where a fresh gate explores in every
    48-token run), and at one row adaptive (the width halved / doubled per round, as
    `stream_generate` runs it) for the DFlash drafters:
      tokens per step (emitted / steps, plain steps counted), acceptance per block position
      (rounds that reached position j and accepted it), end-to-end tokens per second and its
      ratio to plain decoding's in the same repeat (median, min-max);
  * the drafting cost per block: the drafter's work in one round of B-1 drafts for every row
    (`offer` + `draft`, its drafts and q evaluated; the verify not included) in one-token
    target forwards of the same rows, medians of several interleaved, by the process's CPU time.
Every configuration of a repeat runs once, the order rotated per repeat, and every row's tokens
are checked equal to plain decoding's. Prompts: 400-character slices of
models/heldout_stdlib.txt. The machine may be shared: read ratios, not absolute figures.
"""

from __future__ import annotations

import _common  # (first: binds OpenBLAS before mlx loads)

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
from segcache.drafters import make_decoder
from segcache.mtp import load_head
from segcache.runtime import Runtime
from segcache.testing.dflash import random_drafter

MODELS = Path(segcache.__file__).parent / "models"
GATED_WIDTH = 4  # the gated width of prompt lookup and the MTP head (the server's --num-draft-tokens)


GATE_CLOCK = None  # --gate-clock: None is the gate's default (the wall clock)
CLOCKS = {"default": None, "wall": time.perf_counter, "cpu": time.process_time}


def decoder(model, kinds: dict, name: str, rows: int, how, warm: dict | None = None):
    """`how`: a block size B (ungated, B-1 drafts a round), "gated", "gated-cpu" (timed by the
    process's CPU time), "gated-warm" (one gate kept in `warm` across the repeats, as a server's
    decoder keeps its gate across requests: what it measured and learned, exploring once) or
    "adaptive"."""
    one = rows == 1
    if name == "plain":
        return BatchDecoder(model, one_row=one)
    extra = {"dflash": kinds["dflash"]} if "dflash" in name else {"mtp": kinds["mtp"]} if name == "mtp" else {}
    if name == "lookup+dflash":
        extra["prompt_lookup"] = True
    if how in ("gated", "gated-cpu", "gated-warm"):
        width = 0 if "dflash" in name else GATED_WIDTH
        clock = time.process_time if how == "gated-cpu" else GATE_CLOCK
        gate = Gate(clock=clock) if how != "gated-warm" else warm.setdefault((name, rows), Gate(clock=clock))
        return make_decoder(model, num_draft_tokens=width, gate=gate, adaptive=False, one_row=one, **extra)
    if how == "adaptive":
        return make_decoder(model, gate=False, adaptive=True, one_row=one, **extra)
    return make_decoder(model, num_draft_tokens=how - 1, gate=False, adaptive=False, one_row=one, **extra)


def drafter_arrays(dec) -> list:
    """What a drafter made lazily at `add` (a row's context, the head's pairs): not timed."""
    if dec.mode in ("dflash", "lookup+dflash"):
        blocks = dec.drafter.dflash if dec.mode == "lookup+dflash" else dec.drafter
        return [r.kv.keys for r in blocks.rows.values() if r.kv.keys is not None]
    if dec.mode == "mtp":
        rows = dec.drafter.rows
        return [(layer.keys, layer.values) for layer in rows.layers if layer.keys is not None] + [rows.tail]
    return []


def join(dec, model, toks, group, n):
    for i in group:
        rt = Runtime(model)
        mx.eval(rt.forward(toks[i][:-1]))
        dec.add(i, rt, toks[i][-1], max_tokens=n)
    mx.eval(drafter_arrays(dec))


def run(dec, model, toks, n, rows):
    """Decode every prompt, `rows` at a time: tok/s, the tokens, (drafted, accepted) per step."""
    got = {i: [] for i in range(len(toks))}
    rounds, elapsed = [], 0.0
    for at in range(0, len(toks), rows):
        join(dec, model, toks, range(at, min(at + rows, len(toks))), n)
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
        out.append(f"{sum(a >= j for a in reached) / len(reached):.2f}" if reached else "-")
    return " ".join(out)


def draft_cost(dec, model, toks, rows: int, width: int, repeats: int = 7) -> float:
    """The drafter's round of `width` drafts for `rows` joined rows (offer + draft, evaluated), in
    one-token target forwards of the same rows (in a branch rolled back); CPU-time medians."""
    join(dec, model, toks, range(rows), -1)
    states = [dec.rows[r] for r in dec.batch.ids]
    drafter, batch = dec.drafter, dec.batch

    def drafting():
        c0 = time.process_time()
        drafter.offer(states, [width] * rows)
        d = drafter.draft(states, [width] * rows)
        mx.eval(d.tokens if d.lazy else [], [q for q in d.q if q is not None])
        dt = time.process_time() - c0
        drafter.rollback()
        return dt

    def plain():
        batch.fork()
        c0 = time.process_time()
        mx.eval(batch.forward([[s.history[-1]] for s in states]))
        dt = time.process_time() - c0
        batch.rollback()
        return dt

    drafting(), plain()  # warm-up
    d, t = [], []
    for _ in range(repeats):
        d.append(drafting())
        t.append(plain())
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
    ap.add_argument("--gate-clock", choices=("default", "wall", "cpu", "both"), default="default",
                    help="the gated rows' clock: the gate's default (the wall clock), the wall clock, the "
                         "process's CPU time, or both (the default and a gated-cpu row)")
    ap.add_argument("--drafters", default="mtp,lookup,dflash,lookup+dflash")
    _common.add_target_args(ap)
    args = ap.parse_args()
    global GATE_CLOCK
    GATE_CLOCK = CLOCKS.get(args.gate_clock)
    target = _common.target_dir(args)
    model, tok = mlx_lm.load(str(target))
    if args.dflash:
        drafter, source = load_dflash(args.dflash, model), args.dflash
    elif args.random:
        drafter, source = random_drafter(model, tempfile.mkdtemp(), layers=1, block_size=16), "random"
    else:
        print("bench/dflash.py: pass --dflash PATH (or --random for a smoke run)", file=sys.stderr)
        return 2
    kinds = {"dflash": drafter, "mtp": load_head(model, target)}
    names = [d for d in args.drafters.split(",") if d != "mtp" or kinds["mtp"] is not None]
    blocks = [int(x) for x in args.blocks.split(",")]
    text = (MODELS / "heldout_stdlib.txt").read_text()
    toks = [tok.encode(text[i * 1500 : i * 1500 + 400]) for i in range(args.prompts)]
    print(f"BLAS {segcache.BLAS}; drafter {source} (blocks of {drafter.cfg.block_size}); {args.prompts} prompts, "
          f"{args.tokens} tokens, {args.repeats} repeats; drafters {', '.join(names)}; machine may be shared")
    print(f"target: {_common.target_label(args)}")
    _common.print_verify_costs(model, toks[0], _common.target_label(args))
    _, want, _ = run(BatchDecoder(model, one_row=True), model, toks, args.tokens, 1)
    for rows in [int(x) for x in args.rows.split(",")]:
        configs = [("plain", None)] + [(nm, b) for nm in names for b in blocks] + [(nm, "gated") for nm in names]
        configs += [(nm, "gated-warm") for nm in names]
        if args.gate_clock == "both":
            configs += [(nm, "gated-cpu") for nm in names]
        if rows == 1:
            configs += [(nm, "adaptive") for nm in names if "dflash" in nm]
        costs = {(nm, b): draft_cost(decoder(model, kinds, nm, rows, b), model, toks, rows, b - 1)
                 for nm in names for b in blocks}
        warm: dict = {}  # the gated-warm rows' gates, one per drafter, kept across the repeats
        tps = {c: [] for c in configs}
        rounds = {c: [] for c in configs}
        chosen = {c: {"lookup": 0, "dflash": 0} for c in configs}
        for r in range(args.repeats):
            for c in configs[r % len(configs):] + configs[: r % len(configs)]:  # rotated per repeat
                dec = decoder(model, kinds, c[0], rows, c[1], warm)
                t, got, steps = run(dec, model, toks, args.tokens, rows)
                assert got == want, f"{rows} rows, {c}: not plain decoding's tokens"
                tps[c].append(t)
                rounds[c] += steps
                for kind, count in getattr(dec.drafter, "chosen", {}).items():
                    chosen[c][kind] += count
        plain = statistics.median(tps["plain", None])
        print(f"\n{rows} row(s): plain {plain:.1f} tok/s (median of {args.repeats})")
        print(f"  {'drafter':<14}{'B':>9}{'tok/step':>9}{'draft cost':>11}{'tok/s':>8}  {'vs plain':<19}"
              "acceptance per position 1, 2, ...")
        for c in configs[1:]:
            nm, how = c
            ratios = [s / p for s, p in zip(tps[c], tps["plain", None])]
            steps = rounds[c]
            per_step = sum(a + 1 for _, a in steps) / max(len(steps), 1)
            top = max((d for d, _ in steps), default=0)
            cost = f"{costs[c]:.2f}" if c in costs else "-"
            split = chosen[c]
            note = (f"  (rows' rounds: lookup {split['lookup']}, block {split['dflash']})"
                    if nm == "lookup+dflash" else "")
            print(f"  {nm:<14}{str(how):>9}{per_step:>9.2f}{cost:>11}{statistics.median(tps[c]):>8.1f}  "
                  f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})  "
                  f"{per_position(steps, top)}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
