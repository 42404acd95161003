"""MTP self-speculation on the shipped hybrid target: plain, MTP depth 1-3, gated MTP,
prompt lookup and the draft model, one row and 8 rows, on held-out code.

    python bench/mtp.py [--rows 1,8] [--tokens 64] [--repeats 3] [--prompts 8] [--head PATH]

The head: --head PATH (a head file), else the shipped target's own
(models/target/mtp.safetensors), else one fitted here for --fit-steps steps on
the frozen target's own next-token distributions over mlx-lm's Python sources
(not the held-out files), cached in ~/.cache/segcache/bench-mtp-head.safetensors
(the output says which). Prompts: 400-character slices of models/heldout_stdlib.txt.

Configurations, each on freshly prefilled rows (prefill not timed), rotated per
repeat: plain | mtp1 mtp2 mtp3 (ungated, non-adaptive: every round drafts k) |
mtp-gated (depth up to 3, the cost gate choosing per step) | lookup (4, adaptive) |
draft (the shipped draft model, 4, min-prob 0.25). Every row's tokens are checked
equal to plain decoding. Reports median tok/s (min-max) and the ratio to plain,
acceptance per draft position (position j: rounds that reached j and accepted it),
and the verify cost here: one row's forward of 1..5 positions relative to one.
From the measured acceptance it prints what the head would give where a verify of
k+1 positions costs about one forward (a GPU): expected tokens per verify.
"""

from __future__ import annotations

import _common  # noqa: F401  (first: binds OpenBLAS before mlx loads)

import argparse
import glob
import math
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm

from segcache.batch.decoder import BatchDecoder
from segcache.drafters import make_decoder
from segcache.batch.gate import Gate
from segcache.mtp import HEAD_FILE, MTPHead, forward_with_hidden, load_head, save_head
from segcache.runtime import Runtime

MODELS = Path(__file__).resolve().parents[1] / "src" / "segcache" / "models"
CACHED_HEAD = Path(os.path.expanduser("~/.cache/segcache/bench-mtp-head.safetensors"))


def warm_start(head, model) -> None:
    """Start from the target's last full-attention layer, with fc passing the hidden state
    through (plus a little of the next token): the head begins as 'one more layer'."""
    from mlx.utils import tree_flatten

    from segcache.mtp.module import _text_parts

    args, text_model, _, _ = _text_parts(model)
    last = max(i for i, layer in enumerate(text_model.layers) if not getattr(layer, "is_linear", False))
    head.module.layers[0].load_weights(tree_flatten(text_model.layers[last].parameters()))
    H = args.hidden_size
    eye = mx.eye(H)
    head.module.fc.weight = mx.concatenate([0.1 * eye, eye], axis=1)


def fit_head(model, tok, steps: int, seq: int = 256, batch: int = 4):
    """A head fitted to the frozen target's own next-token distributions (soft labels)."""
    src = Path(mlx_lm.__file__).parent
    text = "\n".join(Path(f).read_text() for f in sorted(glob.glob(str(src / "models" / "*.py"))))
    ids = tok.encode(text)
    n = (len(ids) // seq) * seq
    data = mx.array(ids[:n]).reshape(-1, seq)
    head = MTPHead.build(model)
    warm_start(head, model)
    head.module.set_dtype(mx.float32)
    opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.0)

    def loss(module, x, hidden, target_lp):
        logits, _ = head(hidden[:, :-1], x[:, 1:])
        lq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -(mx.exp(target_lp[:, 1:]) * lq).sum(-1).mean()

    step = nn.value_and_grad(head.module, loss)
    tic = time.perf_counter()
    for i in range(steps):
        rows = mx.random.randint(0, data.shape[0], (batch,))
        x = data[rows]
        logits, hidden = forward_with_hidden(model, x)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        value, grads = step(head.module, x, mx.stop_gradient(hidden), mx.stop_gradient(lp))
        opt.learning_rate = 1e-3 * min(1.0, (i + 1) / 50) * (1 - i / steps) + 1e-5
        opt.update(head.module, grads)
        mx.eval(head.module.parameters(), opt.state)
        if i % 25 == 0 or i == steps - 1:
            print(f"  fit step {i}: loss {value.item():.3f} ({time.perf_counter() - tic:.0f} s)", flush=True)
    head.module.eval()
    return head


def the_head(model, tok, args):
    if args.head:
        return load_head(model, mtp_weights=args.head), args.head
    shipped = load_head(model, MODELS / "target")
    if shipped is not None:
        return shipped, f"the shipped head (models/target/{HEAD_FILE})"
    if CACHED_HEAD.is_file() and not args.refit:
        return load_head(model, mtp_weights=CACHED_HEAD), f"fitted earlier ({CACHED_HEAD})"
    print(f"no shipped head: fitting one for {args.fit_steps} steps (target frozen)", flush=True)
    head = fit_head(model, tok, args.fit_steps)
    CACHED_HEAD.parent.mkdir(parents=True, exist_ok=True)
    save_head(head, CACHED_HEAD, source="bench/mtp.py fit_head")
    return head, f"fitted here for {args.fit_steps} steps ({CACHED_HEAD})"


def decoder(cfg: str, model, draft, head, rows: int):
    one = rows == 1
    if cfg == "plain":
        return BatchDecoder(model, one_row=one)
    if cfg.startswith("mtp") and cfg != "mtp-gated":
        k = int(cfg[3:])
        return make_decoder(model, num_draft_tokens=k, mtp=head, gate=False, adaptive=False, one_row=one)
    if cfg == "mtp-gated":
        return make_decoder(model, num_draft_tokens=3, mtp=head, gate=Gate(), adaptive=False, one_row=one)
    if cfg == "lookup":
        return make_decoder(model, num_draft_tokens=4, gate=not one, one_row=one)
    if cfg == "draft":
        return make_decoder(model, num_draft_tokens=4, draft_model=draft, draft_min_prob=0.25, gate=not one,
                            one_row=one)
    raise ValueError(cfg)


def run(cfg, model, draft, head, toks, n, rows):
    """Decode every prompt, `rows` at a time; returns tok/s, tokens and per-round stats."""
    dec = decoder(cfg, model, draft, head, rows)
    got = {i: [] for i in range(len(toks))}
    rounds = []
    elapsed = 0.0
    for at in range(0, len(toks), rows):
        group = list(range(at, min(at + rows, len(toks))))
        for i in group:
            rt = Runtime(model)
            mx.eval(rt.forward(toks[i][:-1]))
            drt = None
            if cfg == "draft":
                drt = Runtime(draft)
                mx.eval(drt.forward(toks[i][:-1]))
            dec.add(i, rt, toks[i][-1], max_tokens=n, draft_runtime=drt)
        if cfg.startswith("mtp"):  # the head's prompt pairs (lazy after add) are not timed
            mx.eval([c.keys_and_values() for r in dec.drafter.rows.values() for c in r.cache if c.keys is not None])
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
    return {"tps": total / elapsed, "tokens": {i: g[:n] for i, g in got.items()}, "rounds": rounds}


def per_position(rounds, depth=3) -> list[str]:
    """Acceptance at draft position j: of the rounds that drafted j and accepted j-1, those accepting j."""
    out = []
    for j in range(1, depth + 1):
        reached = [(d, a) for d, a in rounds if d >= j and a >= j - 1]
        out.append(f"{sum(a >= j for _, a in reached) / len(reached):.2f}" if reached else "-")
    return out


def verify_costs(model, tok, prompt, repeats=9) -> list[float]:
    """One row's verify forward of 1..5 positions (median seconds), in a branch rolled back."""
    rt = Runtime(model)
    mx.eval(rt.forward(prompt))
    costs = []
    for w in range(1, 6):
        samples = []
        for _ in range(repeats):
            b = rt.fork()
            t0 = time.perf_counter()
            mx.eval(rt.forward(prompt[-w:]), [layer.state for layer in rt.cache])
            samples.append(time.perf_counter() - t0)
            b.rollback()
        costs.append(statistics.median(samples))
    return costs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--configs", default="plain,mtp1,mtp2,mtp3,mtp-gated,lookup,draft")
    ap.add_argument("--head", help="a head file (default: the shipped one, else a fitted one)")
    ap.add_argument("--fit-steps", type=int, default=300)
    ap.add_argument("--refit", action="store_true", help="fit a new head even if one is cached")
    args = ap.parse_args()

    model, tok = mlx_lm.load(str(MODELS / "target"))
    draft, _ = mlx_lm.load(str(MODELS / "draft"))
    head, where = the_head(model, tok, args)
    text = (MODELS / "heldout_stdlib.txt").read_text()
    toks = [tok.encode(text[i * 2000 : i * 2000 + 400]) for i in range(args.prompts)]
    configs = args.configs.split(",")
    print(f"target: models/target; head: {where}; {len(toks)} held-out prompts, {args.tokens} tokens each")

    costs = verify_costs(model, tok, toks[0])
    print("verify cost here (one row, positions 1..5, relative to 1): "
          + " ".join(f"{c / costs[0]:.2f}" for c in costs) + f"  ({1000 * costs[0]:.1f} ms for 1)")

    for rows in [int(r) for r in args.rows.split(",")]:
        results = {c: [] for c in configs}
        last = {}
        for r in range(args.repeats):
            for c in configs[r % len(configs):] + configs[: r % len(configs)]:
                out = run(c, model, draft, head, toks, args.tokens, rows)
                results[c].append(out["tps"])
                last[c] = out
        plain = last.get("plain")
        print(f"\n{rows} row(s) at a time:")
        print(f"{'config':10} {'tok/s median (min-max)':28} {'vs plain':8} {'accepted/drafted':17} acceptance at 1,2,3")
        base = statistics.median(results["plain"]) if "plain" in results else None
        for c in configs:
            tps = results[c]
            out = last[c]
            if plain is not None and out["tokens"] != plain["tokens"]:
                raise SystemExit(f"{c}: tokens differ from plain decoding")
            drafted = sum(d for d, _ in out["rounds"])
            accepted = sum(a for _, a in out["rounds"])
            ratio = f"{statistics.median(tps) / base:.2f}x" if base else "-"
            acc = f"{accepted}/{drafted}" if drafted else "-"
            print(f"{c:10} {statistics.median(tps):7.1f} ({min(tps):.1f}-{max(tps):.1f}){'':8} {ratio:8} {acc:17} "
                  + " ".join(per_position(out["rounds"])) if drafted else
                  f"{c:10} {statistics.median(tps):7.1f} ({min(tps):.1f}-{max(tps):.1f}){'':8} {ratio:8} -")
        if "mtp3" in last:
            a = [float(x) if x != "-" else 0.0 for x in per_position(last["mtp3"]["rounds"])]
            for k in (1, 2, 3):
                expected = 1 + sum(math.prod(a[:j]) for j in range(1, k + 1))
                print(f"  depth {k}: {expected:.2f} tokens per verify where a verify of {k + 1} positions costs one "
                      f"forward (a GPU), before the head's own cost; here a verify of {k + 1} costs "
                      f"{costs[k] / costs[0]:.2f} forwards")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
