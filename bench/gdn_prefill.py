"""Gated DeltaNet prefill: the chunked recurrence against mlx-lm's per-token loop.

Run through `python bench/hotpath.py --gdn [--long] [--crossover]`.

Three tables:
  recurrence   chunked_gated_delta vs mlx-lm's gated_delta_ops alone, at
               Qwen3-Next's linear-attention sizes (16 key heads, 32 value
               heads, 128 dims), in steps of 2048 tokens, with the peak
               memory each adds over its inputs.
  crossover    the same for short blocks, at those sizes and at the tiny test
               models' sizes: where the chunked form starts to win (-> CHUNKED_FROM).
  prefill      whole-model prefill tok/s, Runtime(gdn_prefill="native") vs
               "chunked" vs a llama of about the same parameter count, on the
               shipped target and on a random Qwen3-Next-shaped hybrid.

Prefills feed the prompt in steps of 2048 tokens with an eval between (as
mlx-lm's generate and Runtime.prefill do). Sides alternate within a round,
after a short warm-up prefill each; chunked and llama run 3 rounds, the slow
native side once (--repeats N: every side N). 16384 tokens only with --long
(native takes minutes there; the MoE model is left out at that length).
"""

from __future__ import annotations

import _common as C  # noqa: I001  (first: binds OpenBLAS before mlx loads)

import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import gated_delta as gd

import segcache
from segcache.adapters import chunked

# Qwen3-Next's linear attention (16 key heads, 32 value heads, 128 dims) in a
# 4-layer hybrid, 3 GDN : 1 attention, hidden 1024; with a dense MLP (qwen3_5)
# and with Qwen3-Next's own MoE block (2 of 8 experts).
QWEN3_NEXT_SHAPE = dict(
    hidden_size=1024, num_hidden_layers=4, full_attention_interval=4,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=8192,
)
QWEN3_NEXT_DENSE = dict(family="qwen3_5", intermediate_size=4096, **QWEN3_NEXT_SHAPE)
QWEN3_NEXT = dict(
    family="qwen3_next", intermediate_size=2048, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, **QWEN3_NEXT_SHAPE,
)
# llamas of about the same parameter count (intermediate size chosen to match)
_LLAMA = dict(family="llama", hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=8192)
LLAMA_FOR_DENSE = dict(intermediate_size=7680, **_LLAMA)
LLAMA_FOR_MOE = dict(intermediate_size=8192, **_LLAMA)
LLAMA_FOR_TARGET = dict(  # the shipped target's sizes, all attention
    family="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=768, vocab_size=1536, tie_word_embeddings=True,
)
TARGET = Path(segcache.__file__).parent / "models" / "target"
STEP = 2048


def _inputs(T: int, Hk: int, Hv: int, D: int):
    mx.random.seed(0)
    q, k = gd.normalize_qk(mx.random.normal((1, T, Hk, D)), mx.random.normal((1, T, Hk, D)), inv_scale=D**-0.5, eps=1e-6)
    v = mx.random.normal((1, T, Hv, D))
    g = gd.compute_g(mx.log(mx.random.uniform(0.5, 16, (Hv,))), mx.random.normal((1, T, Hv)), mx.ones(Hv))
    beta = mx.sigmoid(mx.random.normal((1, T, Hv)))
    state = mx.zeros((1, Hv, D, D))
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def _run(fn, args) -> tuple[float, float]:
    """(seconds, peak bytes added) of `fn` over the inputs in steps of STEP tokens.

    Each step is evaluated before the next, carrying the state, as a prefill
    in steps does: one call of gated_delta_ops over 16384 tokens would hold
    every step's state in its lazy graph (~2 MiB a token at these sizes).
    """
    q, k, v, g, beta, state = args
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    start = time.perf_counter()
    for a in range(0, q.shape[1], STEP):
        part = slice(a, a + STEP)
        y, state = fn(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state)
        mx.eval(y, state)
    return time.perf_counter() - start, mx.get_peak_memory() - base


def recurrence(lengths: list[int], repeats: int) -> None:
    rows = []
    for T in lengths:
        args = _inputs(T, 16, 32, 128)
        _run(chunked.chunked_gated_delta, _inputs(256, 16, 32, 128))  # warm-up
        _run(gd.gated_delta_ops, _inputs(16, 16, 32, 128))
        fast = [_run(chunked.chunked_gated_delta, args) for _ in range(max(repeats, 3))]
        slow = [_run(gd.gated_delta_ops, args) for _ in range(repeats)]
        tc, ts = statistics.median(t for t, _ in fast), statistics.median(t for t, _ in slow)
        rows.append([
            T, f"{T / ts:.0f}", f"{T / tc:.0f}", f"{ts / tc:.1f}x",
            f"{max(m for _, m in slow) / 2**20:.0f}", f"{max(m for _, m in fast) / 2**20:.0f}",
        ])
        C.flush()
    print("## recurrence alone, Hk=16 Hv=32 Dk=Dv=128, batch 1, fp32")
    print(C.table(rows, ["tokens", "gated_delta_ops tok/s", "chunked tok/s", "speedup", "ops peak MiB", "chunked peak MiB"]))
    print()


def crossover(repeats: int = 7) -> None:
    rows = []
    for heads in [(2, 4, 32), (16, 32, 128)]:
        for T in (1, 2, 4, 6, 8, 12, 16, 32, 64):
            args = _inputs(T, *heads)
            times = {}
            for name, fn in (("ops", gd.gated_delta_ops), ("chunked", chunked.chunked_gated_delta)):
                samples = [_run(fn, args)[0] for _ in range(repeats)]
                times[name] = statistics.median(samples[2:])
            rows.append([f"{heads}", T, f"{times['ops'] * 1e3:.2f}", f"{times['chunked'] * 1e3:.2f}",
                         f"{times['ops'] / times['chunked']:.2f}"])
    print(f"## crossover: short blocks (Hk, Hv, D); CHUNKED_FROM = {chunked.CHUNKED_FROM}")
    print(C.table(rows, ["heads", "tokens", "ops ms", "chunked ms", "ops / chunked"]))
    print()


def _prefill_side(model, mode, prompt):
    def run():
        rt = segcache.Runtime(model, gdn_prefill=mode) if mode else segcache.Runtime(model)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        start = time.perf_counter()
        C.prefill(model, rt.cache, prompt, chunk=STEP)
        return time.perf_counter() - start, mx.get_peak_memory() - base

    return run


def prefill(lengths: list[int], repeats: int, native_repeats: int = 1, moe: bool = True) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm import load

    target = load(str(TARGET))[0]
    pairs = [
        ("shipped target", target, sum(v.size for _, v in tree_flatten(target.parameters())), LLAMA_FOR_TARGET),
        ("Qwen3-Next-shaped dense", *C.build(QWEN3_NEXT_DENSE), LLAMA_FOR_DENSE),
    ] + ([("Qwen3-Next-shaped MoE", *C.build(QWEN3_NEXT), LLAMA_FOR_MOE)] if moe else [])
    rows = []
    for name, model, params, llama_spec in pairs:
        llama, llama_params = C.build(llama_spec)
        vocab = llama_spec["vocab_size"]
        print(f"{name}: {params / 1e6:.1f}M params; llama {llama_params / 1e6:.1f}M")
        for T in lengths:
            prompt = C.tokens(T, vocab, seed=3)
            setups = {"native": (model, "native"), "chunked": (model, "chunked"), "llama": (llama, None)}
            sides = {s: _prefill_side(m, mode, prompt) for s, (m, mode) in setups.items()}
            for m, mode in setups.values():  # warm-up: compile and allocate on a short prompt
                _prefill_side(m, mode, prompt[:64])()
            got = {s: [] for s in sides}
            for r in range(repeats):
                for s in C.rotated(list(sides), r):
                    if s != "native" or r < native_repeats:
                        got[s].append(sides[s]())
            med = {s: statistics.median(t for t, _ in v) for s, v in got.items()}
            mem = {s: max(m for _, m in v) / 2**20 for s, v in got.items()}
            rows.append([
                name, T, f"{T / med['native']:.0f}", f"{T / med['chunked']:.0f}", f"{T / med['llama']:.0f}",
                f"{med['native'] / med['chunked']:.2f}x", f"{med['llama'] / med['chunked']:.2f}x",
                f"{mem['native']:.0f} / {mem['chunked']:.0f} / {mem['llama']:.0f}",
            ])
            print("  " + " | ".join(str(x) for x in rows[-1]))
            C.flush()
    print(f"## prefill tok/s (steps of {STEP}; median of {repeats}, native {native_repeats})")
    print(C.table(rows, ["model", "tokens", "native", "chunked", "llama", "chunked / native",
                         "chunked / llama", "peak MiB native / chunked / llama"]))
    print()


def main(long: bool, do_crossover: bool, repeats: int | None) -> None:
    C.header("GDN prefill: chunked vs mlx-lm's gated_delta_ops", [])
    extra = [16384] if long else []
    if do_crossover:
        crossover()
    recurrence([1024, 4096] + extra, repeats or 1)
    # native takes ~10-60 s per prefill of 4096 tokens here: once, unless --repeats
    prefill([512, 4096], repeats or 3, native_repeats=repeats or 1)
    if long:  # the MoE model's native prefill would take ~7 minutes more
        prefill(extra, repeats or 2, native_repeats=repeats or 1, moe=False)
