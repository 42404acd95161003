"""A DFlash block drafter's training for a frozen target (tools/train_dflash.py).

Data: the target's own greedy continuations of code windows (the training corpus of the
MTP head: the standard library without the held-out files), so that every label is what
the target itself would emit after the tokens before it. Per sequence
[prompt (P tokens) | continuation (C tokens)] the target's tapped layer outputs are
computed once (frozen; kept for the whole run).

A step trains many blocks of each sequence in one drafter forward:

    context   ctx K/V of every position of the sequence (rotary at its position)
    block a   tokens [x_a, mask x (L_a - 1)] at positions a .. a+L_a-1, anchors a >= P - 1
              L_a drawn from the block sizes (4, 8, 16): the drafter meets every size it serves
    mask      block a's queries see context positions < a and block a's own first L_a keys
    loss      cross-entropy of position j of block a against x_{a+j} (the target's greedy
              token), plus `kl` times KL(target || drafter) against the target's own distribution
              for x_{a+j} (its logits at a+j-1), each weighted exp(-(j-1)/gamma) (the reference
              recipe's position decay)

The drafter may start warm (`warm_start`): its layer a copy of the target's last
full-attention layer (the query half of its gated q_proj), its final norm the target's, and
fc reading mostly the last tapped layer.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from segcache.batch import BatchDecoder
from segcache.dflash.config import DFlashConfig
from segcache.dflash.load import save_dflash
from segcache.dflash.model import DFlashModule, Drafter, _target_parts
from segcache.dflash.tap import install
from segcache.drafters import make_decoder
from segcache.runtime import Runtime
from training.common import PACKAGE_MODELS

SIZES = (4, 8, 16)


def drafter_config(model, *, layers: int, taps: tuple[int, ...], block_size: int) -> DFlashConfig:
    """A drafter of the target's width: its heads, its MLP width, a mask id past the text tokens."""
    inner, _, _ = _target_parts(model)
    vocab, hidden = inner.embed_tokens.weight.shape
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None) or {}
    heads = text.get("num_attention_heads", 4) if isinstance(text, dict) else 4
    kv = text.get("num_key_value_heads", 2) if isinstance(text, dict) else 2
    inter = text.get("intermediate_size", 3 * hidden) if isinstance(text, dict) else 3 * hidden
    raw = {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "torch_dtype": "float32"}
    return DFlashConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv, head_dim=hidden // heads, intermediate_size=inter,
                        vocab_size=vocab, target_layer_ids=tuple(taps), mask_token_id=vocab - 1,
                        block_size=block_size, num_target_layers=len(inner.layers),
                        max_position_embeddings=4096, raw=raw)


def greedy_data(model, windows: mx.array, *, prompt: int, cont: int, rows: int = 16, seed: int = 0):
    """[N, prompt + cont] token ids: windows' first `prompt` tokens, then the target's greedy tokens."""
    mx.random.seed(seed)
    picks = windows[:, :prompt]
    out = []
    dec = BatchDecoder(model)
    for at in range(0, picks.shape[0], rows):
        ids = picks[at : at + rows].tolist()
        got = {i: [] for i in range(len(ids))}
        for i, p in enumerate(ids):
            rt = Runtime(model)
            rt.forward(p[:-1])
            dec.add(i, rt, p[-1], max_tokens=cont)
        while dec.rows:
            for rid, emitted in dec.step().items():
                got[rid].extend(t for t, _, _ in emitted)
                if dec.rows[rid].finished or len(got[rid]) >= cont:
                    dec.remove(rid)
        for i, p in enumerate(ids):
            c = (got[i] + [0] * cont)[:cont]
            out.append(p + c)
    return mx.array(out, dtype=mx.uint32)


def tapped_states(model, data: mx.array, taps: tuple[int, ...], batch: int = 16, log_probs: bool = False):
    """The target's tapped layer outputs [N, T, m*H] of every sequence (float32, frozen), and
    with `log_probs` its next-token log-probabilities [N, T, V] (float16; else None)."""
    tap = install(model, taps)
    parts, lps = [], []
    for at in range(0, data.shape[0], batch):
        logits = model(data[at : at + batch])
        h = tap.take()
        lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float16) if log_probs else None
        mx.eval(h, lp)
        parts.append(h)
        lps.append(lp)
    return mx.concatenate(parts, axis=0), (mx.concatenate(lps, axis=0) if log_probs else None)


def warm_start(module: DFlashModule, model, taps: tuple[int, ...]) -> None:
    """The drafter's layer(s) from the target's last full-attention layer (the query half of its
    gated q_proj per head), its final norm the target's, fc passing the last tap through."""
    inner, _, _ = _target_parts(model)
    last = max(i for i, layer in enumerate(inner.layers) if not getattr(layer, "is_linear", False))
    src = inner.layers[last]
    for layer in module.layers:
        att, tatt = layer.self_attn, src.self_attn
        d = att.q_norm.weight.shape[0]
        q = tatt.q_proj.weight.reshape(att.heads, -1, tatt.q_proj.weight.shape[-1])[:, :d]
        att.q_proj.weight = q.reshape(att.heads * d, -1)
        for name in ("k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            getattr(att, name).weight = getattr(tatt, name).weight  # arrays: updates replace them
        layer.input_layernorm.weight = src.input_layernorm.weight
        layer.post_attention_layernorm.weight = src.post_attention_layernorm.weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight = getattr(src.mlp, name).weight
    module.norm.weight = inner.norm.weight
    H = module.norm.weight.shape[0]
    eye = mx.eye(H)
    module.fc.weight = mx.concatenate([0.1 * eye] * (len(taps) - 1) + [eye], axis=1)


def _blocks(data, hidden, log_probs, rows, *, prompt: int, anchors: int, gamma: float, mask_id: int):
    """One batch: per row `anchors` blocks at random anchors with random sizes; returns the arrays
    the loss needs (the target's log-probabilities for each slot's token, or None)."""
    B, T = rows.shape[0], data.shape[1]
    Lmax = max(SIZES)
    lo, hi = prompt - 1, T - Lmax  # block a's labels x_{a+1} .. x_{a+Lmax-1} lie in the continuation
    # (slot j of block a sits at position a + j and drafts the token there, x_{a+j})
    a = mx.random.randint(lo, hi + 1, (B, anchors))  # [B, A]
    sizes = mx.array(SIZES)[mx.random.randint(0, len(SIZES), (B, anchors))]  # [B, A]
    x = data[rows]  # [B, T]
    j = mx.arange(Lmax)
    pos = a[..., None] + j  # [B, A, Lmax] positions of the block
    first = mx.take_along_axis(x, a, axis=1)  # x_a
    tokens = mx.where(j == 0, first[..., None], mask_id).astype(mx.uint32)  # [B, A, Lmax]
    labels = mx.take_along_axis(x, pos.reshape(B, -1), axis=1).reshape(pos.shape)  # slot j drafts x_{a+j}
    inside = j[None, None] < sizes[..., None]  # [B, A, Lmax]
    weight = mx.where((j >= 1) & inside, mx.exp(-(j - 1).astype(mx.float32) / gamma), 0.0)
    # the mask: query (anchor q, slot s) sees context keys k < a_q and block keys (anchor q, slot < L_q)
    ctx_ok = mx.arange(T)[None, None, None] < a[..., None, None]  # [B, A, 1, T]
    ctx_ok = mx.broadcast_to(ctx_ok, (B, anchors, Lmax, T))
    same = mx.arange(anchors)[:, None, None, None] == mx.arange(anchors)[None, None, :, None]  # [A,1,A,1]
    blk_ok = same[None] & inside[:, None, None, :, :]  # [B, A, 1, A, Lmax]
    blk_ok = mx.broadcast_to(blk_ok, (B, anchors, Lmax, anchors, Lmax)).reshape(B, anchors * Lmax, anchors * Lmax)
    mask = mx.concatenate([ctx_ok.reshape(B, anchors * Lmax, T), blk_ok], axis=-1)[:, None]
    soft = None
    if log_probs is not None:  # slot j's token x_{a+j} is what the target predicted at a+j-1
        at = mx.maximum(pos.reshape(B, -1) - 1, 0)
        soft = mx.take_along_axis(log_probs[rows], at[..., None], axis=1).astype(mx.float32)
    return (hidden[rows], tokens.reshape(B, -1), pos.reshape(B, -1), labels.reshape(B, -1),
            weight.reshape(B, -1), mask, soft)


def _loss(module, drafter: Drafter, kl: float, h, tokens, pos, labels, weight, mask, soft):
    """The position-decayed cross-entropy (plus `kl` x KL to the target) of every block of the
    batch (one drafter forward)."""
    ctx = module.hidden_norm(module.fc(h))  # [B, T, H]
    x = drafter.embed(tokens)
    if drafter.embed_scale != 1.0:
        x = x * drafter.embed_scale
    B, T = ctx.shape[:2]
    for layer in module.layers:
        att = layer.self_attn
        ck, cv = att.keys_values(ctx, drafter.rope, 0)
        xn = layer.input_layernorm(x)
        q = att.q_norm(att.q_proj(xn).reshape(B, -1, att.heads, drafter.cfg.head_dim)).transpose(0, 2, 1, 3)
        bk = att.k_norm(att.k_proj(xn).reshape(B, -1, att.kv_heads, drafter.cfg.head_dim)).transpose(0, 2, 1, 3)
        bv = att.v_proj(xn).reshape(B, -1, att.kv_heads, drafter.cfg.head_dim).transpose(0, 2, 1, 3)
        q, bk = _rope_at(drafter, q, pos), _rope_at(drafter, bk, pos)
        k, v = mx.concatenate([ck, bk], axis=2), mx.concatenate([cv, bv], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=att.scale, mask=mask)
        x = x + att.o_proj(out.transpose(0, 2, 1, 3).reshape(B, x.shape[1], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = drafter.logits(module.norm(x))
    ce = nn.losses.cross_entropy(logits, labels.astype(mx.int32), reduction="none")
    if soft is not None and kl > 0:
        lq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ce = ce + kl * (mx.exp(soft) * (soft - lq)).sum(-1)
    return (ce * weight).sum() / weight.sum()


def _rope_at(drafter: Drafter, x, pos):
    """Rotary embedding at arbitrary positions [B, L] (the blocks of a batch sit anywhere)."""
    d = drafter.cfg.head_dim
    inv = 1.0 / (drafter.cfg.rope_theta ** (mx.arange(0, d, 2, dtype=mx.float32) / d))
    ang = pos[:, None, :, None].astype(mx.float32) * inv  # [B, 1, L, d/2]
    cos, sin = mx.cos(ang), mx.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def train(model, cfg: DFlashConfig, data: mx.array, hidden: mx.array, *, prompt: int, minutes: float,
          steps: int, batch: int, anchors: int, lr: float, gamma: float, out: Path, seed: int,
          log_probs: mx.array | None = None, kl: float = 0.0, warm: bool = False, warmup: int = 0,
          log=print) -> tuple[DFlashModule, dict]:
    """Trains a drafter (fresh, or `warm` from the target's layers) for `minutes` (or `steps`);
    learning rate warmed up over `warmup` steps, then cosine to 10%; checkpoints to `out` every
    50 steps."""
    mx.random.seed(seed)
    module = DFlashModule(cfg)
    if warm:
        warm_start(module, model, cfg.target_layer_ids)
    drafter = Drafter(module, cfg, model)
    opt = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95], weight_decay=0.01)
    loss_and_grad = nn.value_and_grad(module, lambda m, *a: _loss(m, drafter, kl, *a))
    t0, values, step = time.time(), [], 0
    budget = minutes * 60
    while step < steps:
        frac = max((time.time() - t0) / budget, step / steps)
        if frac >= 1:
            break
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        opt.learning_rate = ramp * lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))  # cosine to 10%
        rows = mx.random.randint(0, data.shape[0], (batch,))
        arrays = _blocks(data, hidden, log_probs, rows, prompt=prompt, anchors=anchors, gamma=gamma, mask_id=cfg.mask_token_id)
        value, grads = loss_and_grad(module, *arrays)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(module, grads)
        mx.eval(module.parameters(), opt.state, value)
        values.append(value.item())
        step += 1
        if step % 25 == 0:
            log(f"step {step}  loss {sum(values[-25:]) / 25:.3f}  lr {float(opt.learning_rate):.2e}  "
                f"{time.time() - t0:.0f}s", flush=True)
        if step % 50 == 0:
            save_dflash(module, cfg, out)
    module.eval()
    save_dflash(module, cfg, out)
    recent = values[-25:]
    return module, {"steps": step, "seconds": round(time.time() - t0),
                    "final_loss": round(sum(recent) / max(1, len(recent)), 3)}


def acceptance(model, tok, drafter: Drafter, *, prompts: int = 8, tokens: int = 48, blocks=SIZES) -> dict:
    """Tokens per round and acceptance per position on held-out code, per block size (ungated)."""
    text = (PACKAGE_MODELS / "heldout_stdlib.txt").read_text(encoding="utf-8")
    out = {}
    for b in blocks:
        dec = make_decoder(model, dflash=drafter, num_draft_tokens=b - 1, gate=False, adaptive=False, one_row=True)
        rounds = []
        for i in range(prompts):
            ids = tok.encode(text[i * 1500 : i * 1500 + 400])
            rt = Runtime(model)
            rt.forward(ids[:-1])
            dec.add(i, rt, ids[-1], max_tokens=tokens)
            while not dec.rows[i].finished:
                dec.step()
            s = dec.rows[i].stats
            rounds += list(zip(s.drafted_per_round, s.accepted_per_round))
            dec.remove(i)
        per = []
        for j in range(1, b):
            reached = [a for d, a in rounds if d >= j and a >= j - 1]
            per.append(round(sum(a >= j for a in reached) / len(reached), 3) if reached else None)
        out[f"B={b}"] = {"tokens_per_round": round(sum(a + 1 for _, a in rounds) / len(rounds), 3),
                         "acceptance_at": per, "rounds": len(rounds)}
    return out
