"""`segcache generate`: plain or speculative generation from local mlx-lm model directories.

    segcache generate --model PATH --prompt TEXT --max-tokens N
        [--draft-model PATH --num-draft-tokens K [--draft-min-prob P] | --prompt-lookup | --mtp [--mtp-weights PATH]] [--temp T --seed S] [--verbose]
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `generate` subcommand on an argparse `subparsers` object."""
    p = subparsers.add_parser(
        "generate",
        help="generate text (speculatively with a draft model or prompt lookup)",
        description="Generate from a local mlx-lm model directory on a segcache Runtime. Greedy "
        "output is token-identical to mlx_lm.generate; drafts only change the speed.",
    )
    p.add_argument("--model", required=True, help="target model directory (mlx_lm.load)")
    p.add_argument("--prompt", required=True, help="prompt text, or - to read it from stdin")
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="tokens to generate (-1: until EOS)")
    drafter = p.add_mutually_exclusive_group()
    drafter.add_argument("--draft-model", help="draft model directory sharing the target's tokenizer")
    drafter.add_argument("--prompt-lookup", action="store_true", help="draft by n-gram lookup in prompt + output")
    drafter.add_argument("--mtp", action="store_true", help="draft with the model's own multi-token-prediction "
                         "head (Qwen3-Next, Qwen3.5: mtp.safetensors in the model directory, see "
                         "`segcache mtp extract`), --num-draft-tokens deep")
    p.add_argument("--mtp-weights", metavar="PATH", help="with --mtp: the head's file (or the original "
                   "checkpoint holding mtp.* tensors) instead of the model directory's")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="drafts per round, at most (default 4)")
    p.add_argument("--draft-min-prob", type=float, default=None,
                   help="with --draft-model: stop a round's drafting after a draft the draft model gives "
                        "less than this (default: stream_generate's; 0 = always draft --num-draft-tokens)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass (0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--prompt-cache-dir", help="persistent prefix cache directory: a later run of a prompt "
                   "sharing a prefix resumes from it")
    p.add_argument("--prompt-cache-remote", metavar="URL", help="shared prefix-cache tier on Redis/Valkey, redis://[:password@]host:port/db (rediss:// for TLS); local tiers still serve when it is down (with --prompt-cache-dir)")
    p.add_argument("--verbose", action="store_true", help="stream the text and print speculative stats")
    p.set_defaults(handler=run)
    return p


def _load(path: str, what: str):
    from mlx_lm import load

    from .errors import ModelError

    try:
        return load(path)
    except Exception as exc:  # mlx-lm raises several types for a bad directory
        raise ModelError(f"cannot load the {what} from {path!r}: {exc}") from exc


def _prompt(tokenizer, text: str, raw: bool):
    if text == "-":
        text = sys.stdin.read()
    if raw or not getattr(tokenizer, "has_chat_template", False):
        return text
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def run(args: argparse.Namespace) -> int:
    """Run `segcache generate`; returns the process exit code."""
    from .errors import SegcacheError, StoreError

    try:
        import mlx.core as mx

        from .generation import stream_generate
        from .sampling import make_sampler

        if args.max_tokens == 0:
            raise ValueError("--max-tokens must be non-zero (-1: until EOS)")
        if args.num_draft_tokens < 1:
            raise ValueError("--num-draft-tokens must be >= 1")
        if args.seed is not None:
            mx.random.seed(args.seed)
        model, tokenizer = _load(args.model, "model")
        draft_model = None
        if args.draft_model:
            draft_model, _ = _load(args.draft_model, "draft model")
        head = None
        if getattr(args, "mtp_weights", None) and not getattr(args, "mtp", False):
            raise ValueError("--mtp-weights needs --mtp")
        if getattr(args, "mtp", False):
            from .mtp import head_for

            head = head_for(model, args.model, getattr(args, "mtp_weights", None))
        sampler = make_sampler(args.temp, top_p=getattr(args, "top_p", 0.0))
        prompt = _prompt(tokenizer, args.prompt, getattr(args, "ignore_chat_template", False))
        response = None
        text = []
        from .runtime import Runtime

        store = None
        if getattr(args, "prompt_cache_dir", None):
            from .store import open_store

            try:
                store = open_store(args.prompt_cache_dir, remote=getattr(args, "prompt_cache_remote", None))
            except StoreError as exc:  # a damaged or full store is a cache miss, never a failed run
                import warnings

                from .errors import StoreWarning

                warnings.warn(f"{exc}; generating without the prompt cache", StoreWarning, stacklevel=1)
        runtime = Runtime(model, store=store, gdn_prefill="auto")  # chunked GDN prefill off Metal
        try:
            for response in stream_generate(
                model, tokenizer, prompt,
                draft_model=draft_model, prompt_lookup=args.prompt_lookup, mtp=head,
                num_draft_tokens=args.num_draft_tokens, max_tokens=args.max_tokens, sampler=sampler,
                runtime=runtime,
                **({} if args.draft_min_prob is None else {"draft_min_prob": args.draft_min_prob}),
            ):
                if args.verbose:
                    print(response.text, end="", flush=True)
                else:
                    text.append(response.text)
        finally:
            if store is not None:
                if args.verbose:
                    st = store.stats()
                    print(f"\nprompt cache: {st['hit_tokens']} tokens resumed, {st['entries']} entries", file=sys.stderr)
                store.close()
        if args.verbose:
            print()
            print("=" * 10)
            if response is not None:
                print(response.stats.summary())
                print(f"Peak memory: {response.peak_memory:.3f} GB")
        else:
            print("".join(text))
        return 0
    except (SegcacheError, ValueError) as exc:
        print(f"segcache generate: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
