"""Recompute the demo models' held-out numbers from the shipped package files.

Everything here works from what ``segcache`` ships under ``segcache/models``
(model directories, held-out texts, ``training.json``) so a test on any
machine can reproduce the figures recorded at training time.

Usage::

    python tools/eval_demo.py            # print recomputed vs recorded numbers
    python tools/eval_demo.py --speculative [--compare DIR] [--json FILE]
                                         # speculative decoding end to end (DIR: another
                                         # target/ + draft/ measured in the same run)
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

import segcache  # noqa: F401  (binds the system BLAS before mlx loads)

import mlx.core as mx
import mlx.nn as nn
import numpy as np

MODELS_DIR = Path(
    os.environ.get("SEGCACHE_DEMO_MODELS_DIR", Path(segcache.__file__).resolve().parent / "models")
)
HELDOUT_FILES = {
    "stdlib": "heldout_stdlib.txt",
    "other": "heldout_other.txt",
}
EVAL_MAX_TOKENS = 8192
EVAL_WINDOW = 256
AGREEMENT_PROMPTS = 5
AGREEMENT_PROMPT_TOKENS = 64
AGREEMENT_NEW_TOKENS = 64


def load_demo_model(name: str, models_dir: Path = MODELS_DIR):
    """Loads a shipped demo model with ``mlx_lm.load``.

    Args:
        name: ``"target"`` or ``"draft"``.
        models_dir: Directory holding the model directories.

    Returns:
        ``(model, tokenizer)`` as returned by ``mlx_lm.load``.
    """
    import mlx_lm

    return mlx_lm.load(str(models_dir / name))


def read_heldout_text(which: str, models_dir: Path = MODELS_DIR) -> str:
    """Returns the shipped held-out text ``which`` ("stdlib" or "other")."""
    return (models_dir / HELDOUT_FILES[which]).read_text(encoding="utf-8")


def eval_token_ids(tokenizer, text: str, max_tokens: int = EVAL_MAX_TOKENS) -> list[int]:
    """Tokenizes ``text`` (no special tokens) and keeps the first ``max_tokens``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return list(ids[:max_tokens])


def unigram_entropy(token_ids: list[int]) -> float:
    """Entropy in nats/token of the empirical unigram distribution of ``token_ids``."""
    counts = np.array(list(Counter(token_ids).values()), dtype=np.float64)
    probs = counts / counts.sum()
    return float(-(probs * np.log(probs)).sum())


def heldout_loss(model: nn.Module, token_ids: list[int], window: int = EVAL_WINDOW) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping windows.

    The sequence is cut into consecutive windows of ``window + 1`` tokens that
    share one boundary token; each window is scored from a fresh context.
    Windows are batched; a ragged last window is scored on its own.

    Args:
        model: An mlx-lm model returning logits for ``[B, T]`` token ids.
        token_ids: Tokens to score.
        window: Number of predicted tokens per window.

    Returns:
        Mean cross-entropy in nats per predicted token.
    """
    model.eval()
    ids = np.asarray(token_ids, dtype=np.int32)
    n_full = (len(ids) - 1) // window
    chunks = []
    if n_full:
        starts = np.arange(n_full) * window
        chunks.append(np.stack([ids[s : s + window + 1] for s in starts]))
    tail_start = n_full * window
    tail = ids[tail_start:] if len(ids) - tail_start > 1 else None
    total, count = 0.0, 0
    batches = []
    if chunks:
        full = chunks[0]
        for b in range(0, len(full), 16):
            batches.append(full[b : b + 16])
    if tail is not None:
        batches.append(tail[None])
    for batch in batches:
        x = mx.array(batch[:, :-1])
        y = mx.array(batch[:, 1:])
        logits = model(x).astype(mx.float32)
        losses = nn.losses.cross_entropy(logits, y, reduction="sum")
        total += losses.item()
        count += y.size
    return total / count


def greedy_agreement(
    target: nn.Module,
    draft: nn.Module,
    token_ids: list[int],
    n_prompts: int = AGREEMENT_PROMPTS,
    prompt_tokens: int = AGREEMENT_PROMPT_TOKENS,
    new_tokens: int = AGREEMENT_NEW_TOKENS,
) -> dict:
    """Measures how often the draft's greedy token equals the target's.

    For each prompt (evenly spaced slices of ``token_ids``), the target
    decodes ``new_tokens`` greedily; then both models score prompt plus
    continuation in one forward pass, and at each of the ``new_tokens``
    positions we check whether the draft's argmax equals the target's
    (teacher forcing on the target's own greedy continuation: exactly the
    per-token acceptance test of greedy speculative decoding).

    Returns:
        Dict with ``rate`` (fraction of agreeing positions), ``matches``,
        ``positions`` and ``mean_accepted_run`` (average length of the agreeing
        prefix per drafted block of 4 tokens, a speculative-decoding proxy).
    """
    from mlx_lm.models.cache import make_prompt_cache

    target.eval()
    draft.eval()
    span = len(token_ids) - prompt_tokens
    starts = [int(i * span / n_prompts) for i in range(n_prompts)]
    matches = 0
    positions = 0
    accepted_runs = []
    for start in starts:
        prompt = token_ids[start : start + prompt_tokens]
        seq = list(prompt)
        cache = make_prompt_cache(target)
        logits = target(mx.array(seq)[None], cache=cache)
        for _ in range(new_tokens):
            seq.append(int(mx.argmax(logits[0, -1]).item()))
            logits = target(mx.array(seq[-1:])[None], cache=cache)
        x = mx.array(seq[:-1])[None]
        target_pred = mx.argmax(target(x)[0, prompt_tokens - 1 :], axis=-1)
        draft_pred = mx.argmax(draft(x)[0, prompt_tokens - 1 :], axis=-1)
        agree = np.array((target_pred == draft_pred).tolist(), dtype=bool)
        matches += int(agree.sum())
        positions += len(agree)
        for b in range(0, len(agree) - 3, 4):
            block = agree[b : b + 4]
            run = 4 if block.all() else int(np.argmin(block))
            accepted_runs.append(run)
    return {
        "rate": matches / positions,
        "matches": matches,
        "positions": positions,
        "prompts": n_prompts,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "mean_accepted_run_of_4": float(np.mean(accepted_runs)),
    }


def mtp_acceptance(
    target: nn.Module,
    head,
    token_ids: list[int],
    n_prompts: int = AGREEMENT_PROMPTS,
    prompt_tokens: int = AGREEMENT_PROMPT_TOKENS,
    new_tokens: int = AGREEMENT_NEW_TOKENS,
    depth: int = 3,
) -> dict:
    """How often the MTP head's greedy drafts equal the target's greedy tokens.

    A plain loop, prompt by prompt (evenly spaced slices of ``token_ids``): the
    target decodes ``new_tokens`` greedily; one target forward over prompt +
    continuation gives its hidden states. At every continuation position ``t`` the
    head drafts ``depth`` tokens as a drafter would: from (hidden ``t``, token
    ``t+1``) the token ``t+2``, then from its own hidden state and its draft the
    next, and so on; each draft is compared with the target's own greedy token.
    The head's cache holds, before position ``t``, the pairs of the true hidden
    states only (its deeper entries are trimmed, as a commit would), and it was
    filled over the prompt first.

    Returns:
        ``depth_k``: fraction of positions whose first ``k`` drafts all match (the
        acceptance rate of a depth-``k`` round's ``k``-th draft); ``conditional_k``:
        the ``k``-th draft's match rate given the first ``k - 1`` matched;
        ``mean_accepted``: mean accepted drafts of a depth-``depth`` round; counts.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from segcache.mtp import forward_with_hidden

    target.eval()
    span = len(token_ids) - prompt_tokens
    starts = [int(i * span / n_prompts) for i in range(n_prompts)]
    runs, positions = [], 0
    for start in starts:
        seq = list(token_ids[start:start + prompt_tokens])
        cache = make_prompt_cache(target)
        logits = target(mx.array(seq)[None], cache=cache)
        for _ in range(new_tokens + depth):
            seq.append(int(mx.argmax(logits[0, -1]).item()))
            logits = target(mx.array(seq[-1:])[None], cache=cache)
        ids = mx.array(seq)[None]
        _, hidden = forward_with_hidden(target, ids)
        head_cache = head.make_cache()
        head(hidden[:, :prompt_tokens - 1], ids[:, 1:prompt_tokens], head_cache)
        for t in range(prompt_tokens - 1, prompt_tokens - 1 + new_tokens):
            h, token, accepted = hidden[:, t:t + 1], ids[:, t + 1:t + 2], 0
            for d in range(depth):
                lg, h = head(h, token, head_cache, depth=d)
                token = mx.argmax(lg, axis=-1)
                if accepted == d and token.item() == seq[t + 2 + d]:
                    accepted += 1
            for c in head_cache:
                c.trim(depth - 1)  # keep only the pair of the true hidden state at t
            runs.append(accepted)
            positions += 1
    runs = np.array(runs)
    result = {f"depth_{k}": float((runs >= k).mean()) for k in range(1, depth + 1)}
    result.update({f"conditional_{k}": float((runs >= k).sum() / max((runs >= k - 1).sum(), 1))
                   for k in range(2, depth + 1)})
    result.update(mean_accepted=float(runs.mean()), positions=positions, prompts=n_prompts,
                  prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    return result


def _chat_reply(model, tokenizer, messages, tools, enable_thinking, max_tokens=192):
    """The model's greedy reply to ``messages`` (text up to its end-of-turn token)."""
    from mlx_lm import generate

    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           enable_thinking=enable_thinking)
    return generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens)


def split_reply(tokenizer, text: str, tools=None) -> tuple[str, str, list]:
    """(reasoning, content, tool calls) of a reply that began inside a ``<think>`` block.

    Tool calls are parsed with the tokenizer's own mlx-lm parser (given the tool
    schemas, which type the arguments); an unparsable block is ``{"error": text}``.
    """
    reasoning, _, rest = text.partition(tokenizer.think_end)
    if not _:
        reasoning, rest = "", text
    calls, content = [], rest
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    while start in content:
        before, _, after = content.partition(start)
        body, _, content = after.partition(end)
        try:
            calls.append(tokenizer.tool_parser(body, tools))
        except Exception:  # the parsers raise ValueError, JSON errors, ...
            calls.append({"error": body})
        content = before + content
    return reasoning.strip(), content.strip(), calls


def tool_call_eval(model, tokenizer, dialogs: dict, max_tokens: int = 192,
                   limit: int | None = None) -> dict:
    """Greedy replies to held-out dialogs, turn by turn and as a closed agent loop.

    ``dialogs`` is ``heldout_dialogs.json``: the tool schemas and single-query
    dialogs whose tool results come from the scripted workspace. Per assistant turn,
    from the reference history: a call is right when its function and arguments
    equal the reference's; an answer when its content equals the reference's
    (first line: ``answer_first_line``). The agent loop feeds the model its own
    replies: each call that equals the reference gets the reference result, and the
    dialog succeeds when the model's final answer's first line equals the reference's.
    ``limit`` evaluates only the first dialogs; ``per_dialog`` lists each dialog's
    (right calls, right answer first lines, loop success).
    """
    tools = dialogs["tools"]
    counts = {"calls": 0, "calls_right": 0, "calls_parsed": 0, "answers": 0,
              "answers_exact": 0, "answers_first_line": 0, "dialogs": 0, "loop_success": 0}
    per_dialog = []
    for dialog in dialogs["dialogs"][:limit]:
        before = dict(counts)
        messages = dialog["messages"]
        offered = tools if dialog["tools"] else None
        thinking = dialog["enable_thinking"]
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            _, content, calls = split_reply(tokenizer, _chat_reply(
                model, tokenizer, messages[:i], offered, thinking, max_tokens), tools)
            if message.get("tool_calls"):
                want = message["tool_calls"][0]["function"]
                counts["calls"] += 1
                counts["calls_parsed"] += bool(calls) and "error" not in calls[0]
                counts["calls_right"] += bool(calls) and calls[0] == want
            else:
                counts["answers"] += 1
                counts["answers_exact"] += content == message["content"]
                counts["answers_first_line"] += (content.split("\n")[0]
                                                 == message["content"].split("\n")[0])
        counts["dialogs"] += 1
        history = [m for m in messages[:next(i for i, m in enumerate(messages)
                                             if m["role"] == "assistant")]]
        references = messages[len(history):]
        success = False
        for step in range(0, len(references), 2):
            reply = references[step]
            _, content, calls = split_reply(tokenizer, _chat_reply(
                model, tokenizer, history, offered, thinking, max_tokens), tools)
            if reply.get("tool_calls"):
                want = reply["tool_calls"][0]["function"]
                if not calls or calls[0] != want:
                    break
                history += [reply, references[step + 1]]
            else:
                success = not calls and content.split("\n")[0] == reply["content"].split("\n")[0]
                break
        counts["loop_success"] += success
        per_dialog.append([counts[k] - before[k] for k in ("calls_right", "answers_first_line",
                                                           "loop_success")])
    rates = {
        "call_accuracy": counts["calls_right"] / max(counts["calls"], 1),
        "call_parse_rate": counts["calls_parsed"] / max(counts["calls"], 1),
        "answer_exact": counts["answers_exact"] / max(counts["answers"], 1),
        "answer_first_line": counts["answers_first_line"] / max(counts["answers"], 1),
        "agent_loop_success": counts["loop_success"] / max(counts["dialogs"], 1),
    }
    return {**rates, **counts, "per_dialog": per_dialog,
            "per_dialog_fields": ["calls_right", "answers_first_line", "loop_success"]}


def call_turn_eval(model, tokenizer, dialogs: dict, count: int = 20, max_tokens: int = 96) -> dict:
    """Greedy replies at ``count`` of the held-out dialogs' tool-call turns, from the
    reference history (spread evenly over all dialogs): how many parse with the
    tokenizer's parser, name the reference's function, and equal the reference call.

    A cheaper cut of :func:`tool_call_eval` (no answers, no closed loop) for
    comparing many candidates.
    """
    tools = dialogs["tools"]
    turns = [(d["messages"][:i], tools if d["tools"] else None, d["enable_thinking"],
              m["tool_calls"][0]["function"])
             for d in dialogs["dialogs"] for i, m in enumerate(d["messages"])
             if m["role"] == "assistant" and m.get("tool_calls")]
    turns = turns[::max(1, len(turns) // count)][:count]
    parsed = named = right = 0
    for history, offered, thinking, want in turns:
        _, _, calls = split_reply(tokenizer, _chat_reply(model, tokenizer, history, offered,
                                                         thinking, max_tokens), tools)
        ok = bool(calls) and "error" not in calls[0]
        parsed += ok
        named += ok and calls[0].get("name") == want["name"]
        right += ok and calls[0] == want
    return {"turns": len(turns), "parsed": parsed, "function_right": named, "call_right": right}


def code_prompts(tokenizer, count: int = 3, length: int = 80) -> list[list[int]]:
    """``count`` code prompts of ``length`` tokens from the held-out mlx-lm sources,
    each starting at a ``def``/``class`` line (evenly spaced through the text)."""
    text = read_heldout_text("other")
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
    picks = [starts[int(j * len(starts) / count)] for j in range(count)]
    return [list(tokenizer.encode("\n".join(lines[i:i + 60]), add_special_tokens=False))[:length]
            for i in picks]


def speculative_figures(pairs: dict, prompts: dict, max_tokens: int = 128, repeats: int = 3,
                        ks=(2, 3, 4)) -> dict:
    """End-to-end greedy speculative decoding of (target, draft) pairs, interleaved.

    For every pair (``{label: (target, draft, tokenizer)}``) and prompt
    (``{name: {label: ids}}``): plain greedy (mlx-lm's ``stream_generate``), the
    draft model at each ``K`` (segcache's ``stream_generate``, its default draft
    gate) and prompt lookup (K=4), each run ``repeats`` times interleaved with the
    others after a warm-up; the fastest run counts. Acceptance and tokens are
    deterministic; speeds are relative to plain greedy of the same pair in the same
    run (the machine's load changes absolute speeds).
    """
    import mlx_lm

    from segcache.generation import stream_generate

    def ways(target, draft, tokenizer):
        out = {"plain": lambda ids: mlx_lm.stream_generate(target, tokenizer, ids,
                                                           max_tokens=max_tokens)}
        for k in ks:
            out[f"draft K={k}"] = lambda ids, k=k: stream_generate(
                target, tokenizer, ids, draft_model=draft, num_draft_tokens=k,
                max_tokens=max_tokens)
        out["lookup K=4"] = lambda ids: stream_generate(target, tokenizer, ids,
                                                        prompt_lookup=True, num_draft_tokens=4,
                                                        max_tokens=max_tokens)
        return out

    results = {}
    for name, per_pair in prompts.items():
        runs = {}
        for label, (target, draft, tokenizer) in pairs.items():
            if label not in per_pair:
                continue
            for way, run in ways(target, draft, tokenizer).items():
                for _ in run(per_pair[label][:8]):
                    pass
        for _ in range(repeats):
            for label, (target, draft, tokenizer) in pairs.items():
                if label not in per_pair:
                    continue
                for way, run in ways(target, draft, tokenizer).items():
                    tokens, last = [], None
                    for last in run(per_pair[label]):
                        tokens.append(last.token)
                    best = runs.get((label, way))
                    if best is None or last.generation_tps > best[1].generation_tps:
                        runs[(label, way)] = (tokens, last)
        results[name] = {}
        for (label, way), (tokens, last) in runs.items():
            plain_tokens, plain = runs[(label, "plain")]
            stats = getattr(last, "stats", None)
            results[name].setdefault(label, {})[way] = {
                "tps": round(last.generation_tps, 1),
                "ratio": round(last.generation_tps / plain.generation_tps, 3),
                "acceptance": round(stats.acceptance_rate, 3) if stats and stats.drafted else None,
                "mean_accepted": round(stats.mean_accepted, 3) if stats and stats.drafted else None,
                "same_tokens": tokens == plain_tokens,
            }
    return results


def evaluate_model(model: nn.Module, tokenizer, models_dir: Path = MODELS_DIR,
                   max_tokens: int = EVAL_MAX_TOKENS) -> dict:
    """Held-out loss and unigram entropy on both shipped held-out texts."""
    results = {}
    for which in HELDOUT_FILES:
        ids = eval_token_ids(tokenizer, read_heldout_text(which, models_dir), max_tokens)
        loss = heldout_loss(model, ids)
        entropy = unigram_entropy(ids)
        results[which] = {
            "tokens": len(ids),
            "loss_nats_per_token": loss,
            "unigram_entropy_nats_per_token": entropy,
            "loss_over_unigram": loss / entropy,
        }
    return results


def load_training_record(models_dir: Path = MODELS_DIR) -> dict:
    """Returns the parsed ``training.json``."""
    return json.loads((models_dir / "training.json").read_text())


def run_speculative(args) -> int:
    """Prints (and writes, ``--json``) the speculative figures of the shipped pair and,
    with ``--compare DIR``, of the pair in DIR (``target/``, ``draft/``) in the same run."""
    import mlx_lm

    from segcache.demo import PROMPT

    target, tokenizer = load_demo_model("target")
    pairs = {"shipped": (target, load_demo_model("draft")[0], tokenizer)}
    if args.compare:
        other = Path(args.compare)
        target, tokenizer = mlx_lm.load(str(other / "target"))
        pairs["compared"] = (target, mlx_lm.load(str(other / "draft"))[0], tokenizer)
    prompts = {"demo": {}, **{f"heldout_{i}": {} for i in range(args.heldout_prompts)}}
    for label, (_, _, tokenizer) in pairs.items():
        prompts["demo"][label] = list(tokenizer.encode(PROMPT))
        for i, ids in enumerate(code_prompts(tokenizer, args.heldout_prompts)):
            prompts[f"heldout_{i}"][label] = ids
    if args.chat_prompts:
        dialogs = json.loads((MODELS_DIR / "heldout_dialogs.json").read_text())
        tokenizer = pairs["shipped"][2]
        for i, dialog in enumerate(d for d in dialogs["dialogs"] if d["tools"]):
            if i == args.chat_prompts:
                break
            first = next(j for j, m in enumerate(dialog["messages"]) if m["role"] == "assistant")
            prompts[f"chat_{i}"] = {"shipped": list(tokenizer.apply_chat_template(
                dialog["messages"][:first], tools=dialogs["tools"], add_generation_prompt=True,
                enable_thinking=dialog["enable_thinking"]))}
    results = speculative_figures(pairs, prompts, max_tokens=args.max_tokens,
                                  repeats=args.repeats)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Prints recomputed held-out numbers next to the recorded ones (or speculative figures)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speculative", action="store_true",
                        help="measure speculative decoding end to end instead")
    parser.add_argument("--compare", help="with --speculative: a directory with another "
                                          "target/ and draft/ to measure in the same run")
    parser.add_argument("--heldout-prompts", type=int, default=3)
    parser.add_argument("--chat-prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the speculative figures here")
    args = parser.parse_args(argv)
    if args.speculative:
        return run_speculative(args)
    record = load_training_record()
    ok = True
    for name in ("target", "draft"):
        model, tokenizer = load_demo_model(name)
        recomputed = evaluate_model(model, tokenizer, max_tokens=record["eval"]["max_tokens"])
        for which, numbers in recomputed.items():
            recorded = record["models"][name]["heldout"][which]
            print(
                f"{name:6s} {which:6s} loss {numbers['loss_nats_per_token']:.4f} "
                f"(recorded {recorded['loss_nats_per_token']:.4f}) "
                f"unigram {numbers['unigram_entropy_nats_per_token']:.4f} "
                f"ratio {numbers['loss_over_unigram']:.3f}"
            )
            if not math.isclose(numbers["loss_nats_per_token"],
                                recorded["loss_nats_per_token"], abs_tol=2e-3):
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
