"""`segcache demo`: the main job on the shipped demo models (or any local mlx-lm models).

1. load the target (hybrid) and the draft;
2. open a persistent prefix store (the user's cache directory by default);
3. complete a code prompt with plain greedy decoding (mlx-lm), with the draft
   model, with prompt lookup, (when the target has one) with its own MTP head,
   and (when there is a DFlash drafter for it) with DFlash blocks, alone and
   beside prompt lookup, and check that all the texts are identical;
4. run a second request that continues the first one and compare its
   time-to-first-token cold and warm, saying which tier the hit came from;
5. print the store's stats.

`segcache demo --runtime` instead walks through fork / commit / rollback on a
built-in random hybrid model.

Its arguments are registered for every `segcache` command, so mlx, mlx-lm and
the runtime load inside the functions that run the demo.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import BLAS, __version__
from .errors import UnsupportedModelError
from .models import MODELS_DIR
from .serve.paths import shown

PROMPT = """class Settings:

    def get_name(self):
        \"\"\"Return the name.\"\"\"
        return self._name

    def set_name(self, value):
        \"\"\"Set the name.\"\"\"
        self._name = value

    def get_size(self):
        \"\"\"Return the size.\"\"\"
        return self._size

    def set_size(self, value):
        \"\"\"Set the size.\"\"\"
        self._size = value

    def get_mode(self):
"""

FOLLOW_UP = '''


def load_settings(name):
    """Return the settings called name."""
    settings = Settings(name)
'''


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="target model directory (default: the shipped hybrid demo model)")
    parser.add_argument("--draft-model", help="draft model directory (default: the shipped draft)")
    parser.add_argument("--prompt-cache-dir", help="prefix store directory (default: the user's cache directory)")
    parser.add_argument("--prompt-cache-remote", metavar="URL", help="shared prefix-cache tier on Redis/Valkey, redis://[:password@]host:port/db (rediss:// for TLS); local tiers still serve when it is down")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per completion")
    parser.add_argument("--num-draft-tokens", type=int, default=4,
                        help="most drafts per round with the draft model (a round stops at the first unsure draft)")
    parser.add_argument("--draft-min-prob", type=float, default=None,
                        help="the draft probability below which a round drafts no further "
                             "(default: stream_generate's; 0 = always draft --num-draft-tokens)")
    parser.add_argument("--lookup-tokens", type=int, default=4, help="drafts per round with prompt lookup")
    parser.add_argument("--mtp-tokens", type=int, default=2,
                        help="draft depth with the target's MTP head (when its directory has mtp.safetensors)")
    parser.add_argument("--dflash", metavar="PATH",
                        help="DFlash drafter directory (default: the shipped one, with the shipped target)")
    parser.add_argument("--block-size", type=int, default=None, metavar="B",
                        help="DFlash positions per block, the last token included (default: the drafter's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way (the fastest counts)")
    parser.add_argument("--report", help="also write the results as JSON to this file")
    parser.add_argument("--runtime", action="store_true", help="walk through fork / commit / rollback instead")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="with --runtime: prompt length")
    parser.add_argument("--seed", type=int, default=0, help="with --runtime: seed of the random model")


def default_cache_dir() -> Path:
    """Where the demo keeps its prefix store unless told otherwise."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "segcache" / "demo"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "segcache" / "demo"


def _header() -> None:
    import mlx.core as mx

    print(f"segcache {__version__} | mlx {mx.__version__} on {mx.default_device()} | BLAS: {BLAS}")


class _Progress:
    """A one-line progress bar on stderr (silent when stderr is not a terminal)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done = label, total, 0
        self.live = sys.stderr.isatty()
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._draw()

    def _draw(self) -> None:
        if self.live:
            filled = int(30 * self.done / max(self.total, 1))
            sys.stderr.write(f"\r  {self.label:<16} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.live:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


def _collect(responses, label: str, total: int):
    """Drain a stream of generation responses with a progress bar; (tokens, text, last response)."""
    bar = _Progress(label, total)
    tokens, text, last = [], [], None
    try:
        for last in responses:
            tokens.append(last.token)
            text.append(last.text)
            bar.advance()
    finally:
        bar.close()
    return tokens, "".join(text), last


def _prefill(rt, ids):
    """Prefill `ids` through `rt`: (where it resumed from, a `Resume`; the last position's logits)."""
    steps = rt.prefill_steps(ids)
    resume = next(steps)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return resume, done.value


def _timed_first_token(rt, ids):
    """Seconds to prefill `ids` through `rt` and pick the greedy next token; the token; the `Resume`."""
    import mlx.core as mx

    start = time.perf_counter()
    resume, logits = _prefill(rt, ids)
    token = mx.argmax(logits[0]).item()
    return time.perf_counter() - start, token, resume


def _tier(resume) -> str:
    """Where a prefill resumed from, in words."""
    if not resume.restored:
        return "nowhere (a miss: computed)"
    names = {"ram": "RAM", "disk": "disk", "remote": "the remote tier"}
    return " and ".join(names[t] for t in sorted(resume.tier.split("+"), key=["disk", "ram", "remote"].index))


def run(args) -> int:
    """Run the demo; returns an exit code (0: every check held)."""
    if args.runtime:
        return run_runtime_walkthrough(args)
    target_dir = Path(args.model) if args.model else MODELS_DIR / "target"
    draft_dir = Path(args.draft_model) if args.draft_model else MODELS_DIR / "draft"
    if not (target_dir / "config.json").exists() or not (draft_dir / "config.json").exists():
        print(f"segcache demo: no models at {shown(target_dir)} / {shown(draft_dir)}; pass --model and --draft-model",
              file=sys.stderr)
        return 2
    _header()
    import mlx.core as mx
    import mlx_lm

    from .generation import stream_generate
    from .runtime import Runtime
    from .store import open_store

    print("\n[1] models")
    target, tokenizer = mlx_lm.load(str(target_dir))
    draft, _ = mlx_lm.load(str(draft_dir))
    for role, path, model in (("target", target_dir, target), ("draft", draft_dir, draft)):
        params = sum(v.size for _, v in _flat(model.parameters()))
        print(f"    {role:<7}{model.model_type:<11}{params / 1e6:5.2f}M parameters  {shown(path)}")
    head = _mtp_head(target, target_dir)
    if head is not None:
        print(f"    MTP head of the target: {head.num_layers} layer(s)  {shown(target_dir / 'mtp.safetensors')}")
    dflash_dir = Path(args.dflash) if args.dflash else None if args.model else MODELS_DIR / "dflash"
    blocks = _dflash(target, dflash_dir, args.block_size)
    if blocks is not None:
        print(f"    DFlash drafter: {blocks.cfg.num_hidden_layers} layer(s), blocks of {blocks.cfg.block_size}  "
              f"{shown(dflash_dir)}")
    prompt_ids = tokenizer.encode(PROMPT)

    cache_dir = Path(args.prompt_cache_dir) if args.prompt_cache_dir else default_cache_dir()
    print(f"\n[2] prefix store: {shown(cache_dir)}")
    store = open_store(cache_dir, remote=args.prompt_cache_remote)
    report: dict = {"cache_dir": str(cache_dir)}
    try:
        print(f"\n[3] completing a {len(prompt_ids)}-token code prompt, {args.max_tokens} tokens, greedy")
        # Each way runs `--repeats` times, interleaved, after a warm-up (kernels
        # compile on first use); the fastest run counts, since load from other
        # processes only ever adds time. Every run must give the same tokens.
        gate = {} if args.draft_min_prob is None else {"draft_min_prob": args.draft_min_prob}
        ways = {
            "plain greedy (mlx-lm)": lambda n: mlx_lm.stream_generate(target, tokenizer, prompt_ids, max_tokens=n),
            "draft model": lambda n: stream_generate(target, tokenizer, prompt_ids, draft_model=draft,
                                                     num_draft_tokens=args.num_draft_tokens, max_tokens=n,
                                                     **gate),
            "prompt lookup": lambda n: stream_generate(target, tokenizer, prompt_ids, prompt_lookup=True,
                                                       num_draft_tokens=args.lookup_tokens, max_tokens=n),
        }
        if head is not None:
            ways["MTP head"] = lambda n: stream_generate(target, tokenizer, prompt_ids, mtp=head,
                                                         num_draft_tokens=args.mtp_tokens, max_tokens=n)
        if blocks is not None:
            ways["DFlash"] = lambda n: stream_generate(target, tokenizer, prompt_ids, dflash=blocks, max_tokens=n)
            ways["DFlash + lookup"] = lambda n: stream_generate(target, tokenizer, prompt_ids, dflash=blocks,
                                                                prompt_lookup=True, max_tokens=n)
        for way in ways.values():
            for _ in way(8):
                pass
        runs, stable = {}, True
        for _ in range(args.repeats):
            for name, way in ways.items():
                got = _collect(way(args.max_tokens), name, args.max_tokens)
                best = runs.get(name)
                stable &= best is None or best[0] == got[0]
                if best is None or got[2].generation_tps > best[2].generation_tps:
                    runs[name] = got

        # The first request through the prefix store (it publishes prompt + reply): the prompt
        # but its last token is prefilled here, so the Resume says where it came from.
        rt = Runtime(target, store=store, gdn_prefill="auto")
        tic = time.perf_counter()
        resume1, _ = _prefill(rt, prompt_ids[:-1])
        prefill_time = time.perf_counter() - tic
        stored = stream_generate(target, tokenizer, prompt_ids[-1:], prompt_lookup=True, runtime=rt,
                                 num_draft_tokens=args.lookup_tokens, max_tokens=args.max_tokens)
        stored_run = _collect(stored, "through the store", args.max_tokens)
        stable &= stored_run[0] == runs["prompt lookup"][0]

        reference_tokens, reference_text, reference = runs["plain greedy (mlx-lm)"]
        identical = stable and all(tokens == reference_tokens for tokens, _, _ in runs.values())
        print("    " + reference_text.replace("\n", "\n    ").rstrip())
        print()
        print(f"    best of {args.repeats} interleaved runs each:")
        print(f"    {'':<22}{'tokens':>7}{'tok/s':>8}{'accepted':>10}{'per round':>10}{'speedup':>9}  same text")
        base_tps = reference.generation_tps
        report["completions"] = {}
        for name, (tokens, text, last) in runs.items():
            stats = getattr(last, "stats", None)
            accepted = f"{stats.acceptance_rate:.0%}" if stats and stats.drafted else "-"
            per_round = f"{stats.mean_accepted:.2f}" if stats and stats.drafted else "-"
            speedup = last.generation_tps / base_tps if base_tps else 0.0
            same = "reference" if tokens is reference_tokens else ("yes" if tokens == reference_tokens else "NO")
            print(f"    {name:<22}{len(tokens):>7}{last.generation_tps:>8.1f}{accepted:>10}{per_round:>10}"
                  f"{speedup:>8.2f}x  {same}")
            report["completions"][name] = {
                "tokens": tokens, "text": text, "tps": last.generation_tps, "speedup": speedup,
                "acceptance": stats.acceptance_rate if stats and stats.drafted else None,
            }
        count = {3: "three", 4: "four", 5: "five", 6: "six"}.get(len(runs), str(len(runs)))
        print(f"    all {count} outputs identical: {'yes' if identical else 'NO'}")
        report["identical"] = identical
        request1 = {"hit_tokens": resume1.restored, "tier": _tier(resume1),
                    "ttft": prefill_time + stored_run[2].stats.prompt_time}
        report["request1"] = request1
        print(f"    first request through the store: {request1['hit_tokens']} of {len(prompt_ids)} prompt "
              f"tokens resumed, from {request1['tier']}; time to first token {request1['ttft'] * 1e3:.0f} ms")

        print("\n[4] a second request continuing the first (prompt + reply + more code)")
        follow_ids = rt.tokens + tokenizer.encode(FOLLOW_UP)
        cold_time, cold_token, _ = _timed_first_token(Runtime(target, gdn_prefill="auto"), follow_ids)
        warm_time, warm_token, resume2 = _timed_first_token(Runtime(target, store=store, gdn_prefill="auto"), follow_ids)
        request2 = {"tokens": len(follow_ids), "hit_tokens": resume2.restored,
                    "tier": _tier(resume2), "cold_ttft": cold_time, "warm_ttft": warm_time,
                    "same_first_token": cold_token == warm_token}
        report["request2"] = request2
        print(f"    {len(follow_ids)} tokens; {request2['hit_tokens']} resumed from {request2['tier']}")
        print(f"    time to first token: cold {cold_time * 1e3:.0f} ms, warm {warm_time * 1e3:.0f} ms "
              f"({cold_time / max(warm_time, 1e-9):.1f}x faster); same first token: "
              f"{'yes' if request2['same_first_token'] else 'NO'}")

        print("\n[5] store stats")
        stats = store.stats()
        for key in ("hits", "misses", "hit_tokens", "evictions", "corrupt_dropped", "ram_bytes", "disk_bytes",
                    "entries"):
            print(f"    {key:<16}{stats[key]}")
        report["store"] = stats
    finally:
        store.close()
    mx.clear_cache()
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    ok = report["identical"] and report["request2"]["same_first_token"]
    return 0 if ok else 1


def _mtp_head(model, directory: Path):
    """The target's MTP head when its directory has one (and its family has heads), else None."""
    from .mtp import load_head

    try:
        return load_head(model, directory)
    except UnsupportedModelError:
        return None


def _dflash(model, directory: Path | None, block_size: int | None):
    """The DFlash drafter in `directory` bound to `model`, or None (no directory, or not one for it)."""
    from .dflash import load_dflash

    if directory is None or not (directory / "config.json").exists():
        return None
    try:
        return load_dflash(directory, model, block_size=block_size)
    except (UnsupportedModelError, ValueError) as exc:
        print(f"    no DFlash row: {exc}")
        return None


def _flat(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def run_runtime_walkthrough(args) -> int:
    """Prefill, draft in a branch and commit part, roll back another, check against a recompute."""
    import mlx.core as mx

    from .runtime import Runtime
    from .testing import models
    from .testing.statemachine import assert_logits_close

    _header()
    model = models.build(
        "qwen3_5", seed=args.seed, hidden_size=256, num_hidden_layers=6, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=512,
        full_attention_interval=3,
    )
    rt = Runtime(model)
    print(f"model: qwen3_5 hybrid, random weights; {rt}, recurrent strategy {rt.recurrent_strategy!r}")

    prompt = [(7 * i + 3) % 512 for i in range(args.prompt_tokens)]
    start = time.perf_counter()
    logits = rt.forward(prompt)
    mx.eval(logits, [c.state for c in rt.cache])
    took = time.perf_counter() - start
    print(f"prefill   {len(prompt)} tokens in {took * 1e3:.0f} ms ({len(prompt) / took:.0f} tok/s)")

    next_token = mx.argmax(logits[0, -1]).item()
    start = time.perf_counter()
    with rt.fork() as branch:  # draft 6 tokens one by one, keep 4
        draft = []
        for _ in range(6):
            draft.append(next_token)
            next_token = mx.argmax(rt.forward([next_token])[0, -1]).item()
        branch.commit(4)
    mx.eval([c.state for c in rt.cache])
    print(f"branch 1  drafted {draft}, committed the first 4 "
          f"({(time.perf_counter() - start) * 1e3:.0f} ms); offset {rt.offset}")

    with rt.fork() as branch:  # forward 5 tokens, then drop them
        rt.forward([1, 2, 3, 4, 5])
        print(f"branch 2  forwarded 5 tokens (offset {rt.offset}, depth {rt.depth}), rolling back")
        branch.rollback()
    print(f"after     offset {rt.offset}, depth {rt.depth}, tokens = prompt + {rt.tokens[len(prompt):]}")

    rt.check()
    fresh = Runtime(model)
    fresh.forward(prompt + draft[:4])
    ours, theirs = rt.forward([11]), fresh.forward([11])
    diff = mx.abs(ours - theirs).max().item()
    assert_logits_close(ours, theirs, "demo")
    same = mx.argmax(ours[0, -1]).item() == mx.argmax(theirs[0, -1]).item()
    print(f"check     invariants hold; next-token logits vs a runtime that saw only the committed "
          f"tokens: max |diff| {diff:.2e}, same greedy token: {same}")
    return 0 if same else 1
