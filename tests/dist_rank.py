"""One rank of the distributed tests (tests/test_distributed.py runs it on two ranks over loopback).

    python dist_rank.py SCENARIO MODELS_DIR [ARGS...]

Every scenario prints `RESULT <json>` lines that the test reads; the checks
that need both ranks (are the logits the same on every rank?) run here over
the group, the comparisons against the unsharded model too (each rank loads
the whole tiny model as its reference).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import segcache  # noqa: F401  (binds BLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_load

from segcache import Runtime, stream_generate
from segcache.distributed import Channel, fingerprint, load, open_rank_store, shard_of
from segcache.errors import RankFailedError
from segcache.testing import lockstep

CONFIGS = [("llama", "tensor"), ("qwen3_5", "tensor"), ("qwen3_5", "pipeline"), ("qwen3_next", "pipeline")]
LONG = bool(os.environ.get("SEGCACHE_LONG"))  # make test-long: many more programs
PROMPT = [5, 9, 12, 7, 30, 31, 5, 9, 12, 7, 30, 31, 5, 9, 12, 40, 41, 42, 5, 9, 12]


def result(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def digest(arrays) -> int:
    """A fingerprint of the arrays' bytes (compared across ranks: bitwise equality)."""
    return fingerprint(*[bytes(memoryview(mx.contiguous(a.astype(mx.float32)))) for a in arrays])


def reference_tokens(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens (its cache, its loop): the independent reference."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=make_prompt_cache(model)):
        out.append(int(tok))
    return out


def program(seed: int, steps: int = 14) -> list[tuple]:
    """A random fork / forward / commit / rollback program (the same on every rank for a seed)."""
    rnd = random.Random(seed)
    ops, depth, lengths = [("forward", [rnd.randrange(2, 60) for _ in range(11)])], 0, []
    for _ in range(steps):
        choice = rnd.random()
        if choice < 0.25 and depth < 2:
            ops.append(("fork",))
            depth += 1
            lengths.append(0)
        elif choice < 0.6 or not depth:
            k = rnd.choice([1, 1, 3, 5])
            ops.append(("forward", [rnd.randrange(2, 60) for _ in range(k)]))
            if depth:
                lengths[-1] += k
        elif choice < 0.85:
            n = rnd.randrange(0, lengths[-1] + 1)
            ops.append(("commit", n))
            depth -= 1
            kept = lengths.pop()
            if lengths:
                lengths[-1] += n if kept else 0
        else:
            ops.append(("rollback",))
            depth -= 1
            lengths.pop()
    ops += [("commit", None)] * depth
    ops.append(("forward", [7, 8]))
    return ops


def run_program(rt, ops) -> list[mx.array]:
    """The logits of every forward; each forward is evaluated before the next (pipeline: send/recv
    pairs match by order, so no two forwards may sit in one graph)."""
    outs, branches = [], []
    for op in ops:
        if op[0] == "forward":
            logits = rt.forward(op[1])[0]
            mx.eval(logits)
            outs.append(logits)
        elif op[0] == "fork":
            branches.append(rt.fork())
        elif op[0] == "commit":
            branches.pop().commit(op[1])
        else:
            branches.pop().rollback()
    rt.check()
    return outs


def slice_gap(rt, ref_rt, shard) -> float:
    """Largest difference between this rank's committed segments and its slice of the unsharded
    runtime's: pipeline, the same layers; tensor, its share of the heads (K/V heads; Gated
    DeltaNet value heads of the state, and q / k / v channel groups of the conv tail)."""
    worst = 0.0
    r, n = shard.rank, shard.size
    start = shard.layers[0]

    def part(a, axis, pieces=None):
        pieces = pieces or [a.shape[axis]]
        chunks, at = [], 0
        for size in pieces:
            step = size // n
            index = [slice(None)] * a.ndim
            index[axis] = slice(at + r * step, at + (r + 1) * step)
            chunks.append(a[tuple(index)])
            at += size
        return mx.concatenate(chunks, axis=axis)

    for i, layer in enumerate(rt.cache):
        whole = ref_rt.cache[start + i]
        if hasattr(layer, "keys"):
            mine = [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]
            theirs = [whole.keys[..., : whole.offset, :], whole.values[..., : whole.offset, :]]
            if shard.parallel == "tensor":
                theirs = [part(a, 1) for a in theirs]
        else:
            mine, theirs = [layer.cache[0], layer.cache[1]], [whole.cache[0], whole.cache[1]]
            if shard.parallel == "tensor":
                module = ref_rt.model.layers[i].linear_attn
                kd, vd = module.key_dim, module.value_dim
                theirs = [part(theirs[0], 2, [kd, kd, vd]), part(theirs[1], 1)]
        for a, b in zip(mine, theirs):
            worst = max(worst, mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())
    return worst


def scenario_models(models_dir: str) -> None:
    """Every family and mode: programs against the unsharded model, greedy tokens against one process."""
    channel = Channel()
    for family, mode in CONFIGS:
        path = os.path.join(models_dir, family)
        model, tokenizer, shard = load(path, pipeline=mode == "pipeline")
        ref, _ = mlx_load(path)
        worst_abs, worst_rel, worst_slice, same_as_native = 0.0, 0.0, 0.0, True
        digests = []
        for seed, strategy in [(k, ("states", "replay")[k % 2]) for k in range(1, 25 if LONG else 3)]:
            ops = program(seed)
            rt = Runtime(model, recurrent_strategy=strategy)
            got = run_program(rt, ops)
            ref_rt = Runtime(ref, recurrent_strategy=strategy)
            want = run_program(ref_rt, ops)
            worst_slice = max(worst_slice, slice_gap(rt, ref_rt, shard))
            for a, b in zip(got, want):
                d = mx.abs(a - b)
                worst_abs = max(worst_abs, d.max().item())
                worst_rel = max(worst_rel, (d / (mx.abs(b) + 1e-6)).max().item())
            digests.append(digest(got))
            # The committed state against mlx-lm's own caches on the same shard, fed only
            # the committed tokens in one block, then the last forward's tokens.
            committed = rt.tokens
            native = make_prompt_cache(model)
            mx.eval(model(mx.array([committed[:-2]]), cache=native))
            last = model(mx.array([committed[-2:]]), cache=native)[0]
            mx.eval(last)
            same_as_native &= bool(mx.allclose(last, got[-1], rtol=1e-5, atol=1e-5).item())
        # The chunked Gated DeltaNet prefill on the rank's heads (its all_sum at the end).
        chunked = Runtime(model, gdn_prefill="chunked").forward(PROMPT * 2)[0, -4:]
        want = Runtime(ref, gdn_prefill="chunked").forward(PROMPT * 2)[0, -4:]
        mx.eval(chunked, want)
        chunked_abs = mx.abs(chunked - want).max().item()
        digests.append(digest([chunked]))
        verdict = channel.check(True, fingerprint(*digests))

        plain = lockstep.generate(Runtime(model), channel, PROMPT, max_tokens=12)
        spec_rt = Runtime(model)
        rounds: dict = {}
        spec = lockstep.generate(spec_rt, channel, PROMPT, max_tokens=12, width=3, stats=rounds)
        held_ok = spec_rt.tokens == PROMPT + spec[:-1] and spec_rt.depth == 0
        engine = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=12)]
        engine_lookup = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=12,
                                                          prompt_lookup=True, num_draft_tokens=3)]
        result(family=family, mode=mode, shard=shard.describe(), worst_abs=worst_abs, worst_rel=worst_rel,
               chunked_abs=chunked_abs, worst_slice=worst_slice,
               same_as_native=same_as_native, ranks_bitwise_equal=verdict.ok, plain=plain, lookup=spec,
               held_ok=held_ok, rounds=rounds, reference=reference_tokens(ref, PROMPT, 12), engine=engine,
               engine_lookup=engine_lookup)


def scenario_batch(models_dir: str) -> None:
    """segcache's batched decoder on the shards: rows joining and leaving, plain and prompt
    lookup, every rank deciding alone (their logits are the same bits), against each row's
    greedy tokens on the unsharded model."""
    from segcache.drafters import make_decoder

    channel = Channel()
    prompts = [PROMPT, PROMPT[3:] + [7, 8], [9, 9, 12, 7, 30, 9, 12, 7], PROMPT[::-1]]
    for family, mode in CONFIGS:
        model, _, _ = load(os.path.join(models_dir, family), pipeline=mode == "pipeline")
        ref, _ = mlx_load(os.path.join(models_dir, family))
        for width in (0, 3):
            dec = make_decoder(model, num_draft_tokens=width, gate=False)
            got = {i: [] for i in range(len(prompts))}
            waiting, steps = [2, 3], 0
            def join(i):
                rt = Runtime(model)
                rt.prefill(prompts[i][:-1])  # evaluated: under pipeline one forward per evaluation
                dec.add(i, rt, prompts[i][-1], max_tokens=10)

            for i in (0, 1):
                join(i)
            while dec.rows or waiting:
                if steps == 2 and waiting:  # rows join mid-generation
                    for i in waiting:
                        join(i)
                    waiting = []
                for rid, emitted in dec.step().items():
                    got[rid].extend(t for t, _, _ in emitted)
                    if len(got[rid]) >= 10:
                        dec.remove(rid)
                steps += 1
            want = {i: reference_tokens(ref, p, 10) for i, p in enumerate(prompts)}
            same = channel.check(True, fingerprint(*[got[i][:10] for i in range(len(prompts))])).ok
            result(family=family, mode=mode, width=width, got={i: g[:10] for i, g in got.items()},
                   want=want, ranks_equal=same)


def scenario_fault(models_dir: str) -> None:
    """A step that fails on one rank fails on every rank; every rank keeps its state and goes on."""
    channel = Channel()
    for family, mode, fail_step in [("qwen3_5", "tensor", 2), ("qwen3_5", "pipeline", 3), ("llama", "tensor", 5)]:
        model, _, _ = load(os.path.join(models_dir, family), pipeline=mode == "pipeline")
        ref, _ = mlx_load(os.path.join(models_dir, family))
        rt = Runtime(model)
        error, held = None, None
        try:
            lockstep.generate(rt, channel, PROMPT, max_tokens=8, width=3, fail=(1, fail_step), step_size=8)
        except RankFailedError as exc:
            error = str(exc)
            while rt.depth:  # a round's branch, empty again
                rt.rollback()
            held = rt.tokens
        rt.check()
        # Every rank holds what it held before the failed step, and nothing of that step
        # runs later: the next forward gives the unsharded model's logits for the same tokens.
        after = rt.forward([3, 4])[0]
        mx.eval(after)
        ref_rt = Runtime(ref)
        want = ref_rt.forward(held + [3, 4])[0, -2:] if held else None
        close = held is not None and bool(mx.allclose(after, want, atol=1e-4).item())
        again = lockstep.generate(Runtime(model), channel, PROMPT, max_tokens=8, width=3)
        result(family=family, mode=mode, error=error, held=held, close=close, again=again,
               reference=reference_tokens(ref, PROMPT, 8))


def scenario_store(models_dir: str, store_dir: str, phase: str) -> None:
    """Per-rank stores: publish, then (in a new launch) resume; and the one-process store is refused."""
    channel = Channel()
    for family, mode in [("qwen3_5", "tensor"), ("qwen3_next", "pipeline")]:
        model, _, shard = load(os.path.join(models_dir, family), pipeline=mode == "pipeline")
        root = os.path.join(store_dir, f"{family}-{mode}")
        fields = dict(family=family, mode=mode, phase=phase)
        if phase == "single-dir":  # a one-process store lies at root: the deployment refuses it
            try:
                open_rank_store(root, shard)
                fields["refused"] = None
            except segcache.StoreError as exc:
                fields["refused"] = str(exc)
            result(**fields)
            continue
        store = open_rank_store(root, shard, ram_bytes=0, page_tokens=8)
        rt = Runtime(model, store=store, group=channel)
        tic = time.perf_counter()
        logits = rt.prefill(PROMPT * 2)
        mx.eval(logits)
        fields.update(seconds=time.perf_counter() - tic, stats=store.stats(), logits=digest([logits]))
        fields["ranks_equal"] = channel.check(True, fields["logits"]).ok
        fresh = Runtime(model)
        want = fresh.forward(PROMPT * 2)[:, -1, :]
        mx.eval(want)
        fields["close"] = bool(mx.allclose(logits, want, atol=1e-5).item())
        store.close()
        fields["dirs"] = sorted(os.listdir(root))
        result(**fields)


def scenario_kill(models_dir: str) -> None:
    """Rank 1 dies after the first message; rank 0 must stop with an error (or its watchdog
    must end it, saying why), never hang."""
    channel = Channel(timeout=20)
    model, _, _ = load(os.path.join(models_dir, "qwen3_5"))
    channel.check()  # both ranks connected
    if channel.rank == 1:
        result(rank=1, exiting=True)
        os._exit(3)
    tic = time.perf_counter()
    try:
        with channel.deadline("generating", 20):
            lockstep.generate(Runtime(model), channel, PROMPT, max_tokens=50)
        result(rank=0, error=None)
    except Exception as exc:  # what the engine turns into a failed request and an exit
        result(rank=0, error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - tic)


def scenario_stuck() -> None:
    """Rank 1 stays alive but stops taking part; rank 0's watchdog ends it with LOST_EXIT."""
    channel = Channel(timeout=3)
    channel.check()
    if channel.rank == 1:
        time.sleep(60)  # the test stops it long before
    result(rank=channel.rank, waiting=True)
    channel.check()
    result(rank=channel.rank, error=None)  # never reached


def scenario_launch(models_dir: str) -> None:
    """Under mlx.launch: the group, the shard, and one greedy generation."""
    channel = Channel()
    model, _, shard = load(os.path.join(models_dir, "qwen3_5"))
    tokens = lockstep.generate(Runtime(model), channel, PROMPT, max_tokens=6, width=2)
    result(rank=channel.rank, size=channel.size, shard=shard.describe() if shard else None, tokens=tokens)


def scenario_channel() -> None:
    """The channel's messages, frames overflowing included."""
    channel = Channel(frame=4)
    r = channel.rank
    rows = channel.gather(list(range(r * 10, r * 10 + 2 + 5 * r)))
    long = channel.broadcast(list(range(100)) if channel.leader else [9])
    payload = channel.share(bytes(range(256)) * 3 + b"end" if channel.leader else b"ignored")
    empty = channel.share(b"" if channel.leader else b"x")
    request = channel.share_data({"prompt": [1, 2, 3], "max_tokens": 5, "salt": b"\x00k", "t": 0.5}
                                 if channel.leader else {"ignored": True})
    least = channel.least(10 - 3 * r)
    same = channel.check(True, 42)
    failed = channel.check(r != 1, 42)
    diverged = channel.check(True, r)
    result(rank=r, rows=rows, long=long, payload=payload.hex(), empty=empty.hex(), least=least,
           request={k: (v.hex() if isinstance(v, bytes) else v) for k, v in request.items()},
           same=same.ok, failed=list(failed.failed), diverged=diverged.ok,
           collectives=channel.stats.collectives, sent_bytes=channel.stats.sent_bytes)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    {"models": scenario_models, "batch": scenario_batch, "fault": scenario_fault, "store": scenario_store, "kill": scenario_kill,
     "stuck": scenario_stuck, "launch": scenario_launch, "channel": scenario_channel}[name](*args)
