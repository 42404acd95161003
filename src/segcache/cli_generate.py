"""`segcache generate`: `mlx_lm.generate` on segcache runtimes, plain or speculative.

Every flag of `mlx_lm.generate` keeps its name, default and meaning, so a
command moves over by changing its first word; greedy output is
token-identical. segcache adds drafting by prompt lookup (--prompt-lookup,
--draft-min-prob) and the persistent prefix store (--prompt-cache-dir,
--prompt-cache-remote).

    segcache generate --model PATH --prompt TEXT [--max-tokens N] [--verbose False]
        [--draft-model PATH --num-draft-tokens K | --prompt-lookup | --mtp [--mtp-weights PATH]] [--temp T --seed S]
        [--adapter-path DIR] [--kv-bits B] [--prompt-cache-file FILE | --prompt-cache-dir DIR]

Its parser is built for every `segcache` command, so mlx, mlx-lm and the
runtime load inside the functions that run the command.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from . import dropin
from .errors import SegcacheError, StoreError, StoreWarning

# mlx_lm.generate's defaults (mlx_lm/generate.py's DEFAULT_*), written out so that building the
# parser imports no mlx-lm; tests/test_dropin_help.py checks them against mlx-lm's
DEFAULT_MODEL = "mlx-community/Llama-3.2-3B-Instruct-4bit"
DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.0
DEFAULT_TOP_K = 0
DEFAULT_XTC_PROBABILITY = 0.0
DEFAULT_XTC_THRESHOLD = 0.1
DEFAULT_MIN_TOKENS_TO_KEEP = 1
DEFAULT_SEED = None
DEFAULT_PREFILL_STEP_SIZE = 2048
NUM_DRAFT_TOKENS = 4  # mlx-lm's is 3; drafts change the speed only (docs/benchmarks.md)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `generate` subcommand on an argparse `subparsers` object."""
    p = subparsers.add_parser(
        "generate",
        help="generate text as mlx_lm.generate does (same flags), speculatively if asked",
        description="Generate from a local mlx-lm model directory on a segcache Runtime. Takes every flag of "
        "mlx_lm.generate with the same meaning; greedy output is token-identical to it, and drafts (a draft "
        "model or prompt lookup) only change the speed.",
    )
    p.add_argument("--model", default=None,
                   help="model directory or Hugging Face repo (mlx_lm.load); default: the model a "
                        f"--prompt-cache-file was made with, else {DEFAULT_MODEL}")
    dropin.add_load_flags(p)
    p.add_argument("--extra-eos-token", nargs="+", default=(), help="more tokens that stop generation")
    p.add_argument("--system-prompt", default=None, help="system message for the chat template")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                   help="the message to answer ('-' reads it from stdin; a literal \\n or \\t in it is a "
                        f"newline or tab, as in mlx_lm.generate; default {DEFAULT_PROMPT!r})")
    p.add_argument("--image", nargs="+", default=(),
                   help="image files for a vision model's prompt: not fed by segcache yet (it stops and says "
                        "so); use mlx_lm.generate for images")
    p.add_argument("--prefill-response", default=None,
                   help="the start of the answer: the chat template continues this assistant message")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate at most (-1: until EOS; default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temp", type=float, default=DEFAULT_TEMP, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="nucleus sampling mass (1: off)")
    p.add_argument("--min-p", type=float, default=DEFAULT_MIN_P, help="min-p sampling (0: off)")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="top-k sampling (0: off)")
    p.add_argument("--xtc-probability", type=float, default=DEFAULT_XTC_PROBABILITY,
                   help="probability of XTC sampling at each token (0: off; with it, drafts are accepted by "
                        "the match rule)")
    p.add_argument("--xtc-threshold", type=float, default=DEFAULT_XTC_THRESHOLD,
                   help="XTC drops the candidates above this probability")
    p.add_argument("--min-tokens-to-keep", type=int, default=DEFAULT_MIN_TOKENS_TO_KEEP,
                   help="tokens min-p sampling keeps at least")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed for sampling")
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    dropin.add_default_template_flag(p)
    p.add_argument("--chat-template-config", default=None,
                   help="more arguments of apply_chat_template, as a JSON object (e.g. '{\"enable_thinking\": false}')")
    p.add_argument("--verbose", type=dropin.str2bool, nargs="?", const=True, default=True,
                   help="True (the default, as mlx_lm.generate): stream the text, then the stats; "
                        "False: print only the text")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="as mlx-lm: a model without its own cache layout gets sliding windows of this many "
                        "tokens (the first 4 kept)")
    p.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP_SIZE,
                   help=f"prompt tokens per prefill forward (default {DEFAULT_PREFILL_STEP_SIZE})")
    p.add_argument("--prompt-cache-file", default=None,
                   help="a prompt cache file made by mlx_lm.cache_prompt (or save_prompt_cache): generation "
                        "continues from it on a segcache runtime")
    p.add_argument("--quantize-activations", "-qa", action="store_true",
                   help="quantize activations with the quantization config of the layer (as mlx-lm)")
    dropin.add_kv_flags(p, server=False)
    drafter = p.add_mutually_exclusive_group()
    drafter.add_argument("--draft-model", help="draft model directory sharing the model's tokenizer")
    drafter.add_argument("--prompt-lookup", action="store_true", help="draft by n-gram lookup in prompt + output")
    drafter.add_argument("--mtp", action="store_true", help="draft with the model's own multi-token-prediction "
                         "head (Qwen3-Next, Qwen3.5: mtp.safetensors in the model directory, see "
                         "`segcache mtp extract`), --num-draft-tokens deep")
    p.add_argument("--dflash", metavar="PATH", help="draft a block per round with a DFlash drafter "
                   "(a checkpoint directory in the published layout, docs/dflash.md); with --prompt-lookup, "
                   "each row verifies lookup's match or the block, whichever it expects more of")
    p.add_argument("--block-size", type=int, default=None, metavar="B",
                   help="with --dflash: positions per block, the last token included (default: the drafter's)")
    p.add_argument("--mtp-weights", metavar="PATH", help="with --mtp: the head's file (or the original "
                   "checkpoint holding mtp.* tensors) instead of the model directory's")
    p.add_argument("--num-draft-tokens", type=int, default=NUM_DRAFT_TOKENS,
                   help=f"drafts per round, at most (default {NUM_DRAFT_TOKENS}; mlx-lm's is 3)")
    p.add_argument("--draft-tree", type=int, default=0, metavar="N",
                   help="with --prompt-lookup, --draft-model or --mtp: verify up to N draft nodes per round as a tree "
                        "(several matches; the draft's or the head's likeliest alternatives) (docs/tree.md; 0 = chains, "
                        "the default)")
    p.add_argument("--draft-min-prob", type=float, default=None,
                   help="with --draft-model: stop a round's drafting after a draft the draft model gives "
                        "less than this (default: stream_generate's; 0 = always draft --num-draft-tokens)")
    p.add_argument("--prompt-cache-dir", help="persistent prefix cache directory: a later run of a prompt "
                   "sharing a prefix resumes from it")
    p.add_argument("--prompt-cache-remote", metavar="URL", help="shared prefix-cache tier on Redis/Valkey, redis://[:password@]host:port/db (rediss:// for TLS); local tiers still serve when it is down (with --prompt-cache-dir)")
    p.set_defaults(handler=run)
    return p


def _check(args: argparse.Namespace) -> None:
    if args.max_tokens == 0:
        raise ValueError("--max-tokens must be non-zero (-1: until EOS)")
    if args.num_draft_tokens < 1:
        raise ValueError("--num-draft-tokens must be >= 1")
    if args.draft_tree < 0 or (args.draft_tree and not (args.prompt_lookup or args.draft_model or args.mtp)):
        raise ValueError("--draft-tree N takes N >= 0, and N > 0 only with --prompt-lookup, --draft-model or --mtp "
                         "(docs/tree.md)")
    if args.dflash and (args.draft_model or args.mtp):
        raise ValueError("--dflash drafts alone or beside --prompt-lookup, not with --draft-model or --mtp")
    if args.prefill_step_size < 1:
        raise ValueError("--prefill-step-size must be >= 1")
    if args.prompt_cache_file and args.prompt_cache_dir:
        raise ValueError("--prompt-cache-file and --prompt-cache-dir exclude each other: a file's token ids "
                         "are unknown, so it can be neither resumed from nor published to the prefix store")
    if args.chat_template_config is not None:
        try:
            config = json.loads(args.chat_template_config)
        except ValueError as exc:
            raise ValueError(f"--chat-template-config is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError("--chat-template-config must be a JSON object of apply_chat_template arguments")


def _prompt_ids(args, tokenizer, using_cache: bool) -> list[int]:
    """The prompt's token ids, built exactly as mlx_lm.generate builds them."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
        messages.append({"role": "user", "content": prompt})
        has_prefill = args.prefill_response is not None
        if has_prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        kwargs = json.loads(args.chat_template_config) if args.chat_template_config is not None else {}
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=has_prefill,
                                               add_generation_prompt=not has_prefill, **kwargs)
        if using_cache:  # the cached file holds the template's start: keep what follows it
            messages[-1]["content"] = "<query>"
            test = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=has_prefill,
                                                 add_generation_prompt=not has_prefill)
            prompt = prompt[test.index("<query>"):]
    return list(tokenizer.encode(prompt, add_special_tokens=not use_chat_template))


def _sampler(args, tokenizer, speculative: bool):
    """None for greedy; mlx-lm's own sampler for plain decoding (so a seeded run prints what
    mlx_lm.generate prints) and for what segcache's Sampler does not cover (XTC,
    --min-tokens-to-keep: drafts are then accepted by the match rule); else segcache's
    Sampler, whose visible distribution makes speculative sampling exact and more accepting."""
    if args.temp == 0:
        return None  # mlx-lm's sampler is argmax at temp 0, whatever else is set
    covered = args.xtc_probability <= 0 and (args.min_p == 0 or args.min_tokens_to_keep == DEFAULT_MIN_TOKENS_TO_KEEP)
    if speculative and covered:
        from .sampling import make_sampler

        return make_sampler(args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    from mlx_lm.sample_utils import make_sampler as mlx_sampler

    return mlx_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
                       xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                       xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))


def _prompt_cache(args):
    """(target caches, draft caches, metadata) from --prompt-cache-file, checked as mlx_lm.generate checks it."""
    from mlx_lm.models.cache import QuantizedKVCache

    from . import prompt_file

    caches, metadata = prompt_file.load(args.prompt_cache_file)
    for c in caches:
        if isinstance(c, QuantizedKVCache):
            if args.kv_bits is not None and args.kv_bits != c.bits:
                raise ValueError("--kv-bits does not match the kv cache loaded from --prompt-cache-file.")
            if args.kv_group_size != c.group_size:
                raise ValueError("--kv-group-size does not match the kv cache loaded from --prompt-cache-file.")
            break
    made_with = metadata.get("model")
    if args.model is None:
        args.model = made_with
    elif made_with is not None and args.model != made_with:
        raise ValueError(f"Providing a different model ({args.model}) than that used to create the prompt "
                         f"cache ({made_with}) is an error.")
    return caches, metadata


def run(args: argparse.Namespace) -> int:
    """Run `segcache generate`; returns the process exit code."""
    try:
        return _run(args)
    except (SegcacheError, ValueError) as exc:
        print(f"segcache generate: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1


def _run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from .generation import stream_generate
    from .runtime import Runtime

    _check(args)
    kv = dropin.kv_setting(args)
    if args.seed is not None:
        mx.random.seed(args.seed)
    caches = metadata = None
    if args.prompt_cache_file is not None:
        caches, metadata = _prompt_cache(args)
    tokenizer_config = json.loads(metadata["tokenizer_config"]) if metadata and "tokenizer_config" in metadata else {}
    model, tokenizer, config = dropin.load(
        args.model or DEFAULT_MODEL, adapter_path=args.adapter_path, trust_remote_code=args.trust_remote_code,
        tokenizer_config=tokenizer_config, model_config={"quantize_activations": args.quantize_activations},
    )
    for eos in args.extra_eos_token:
        tokenizer.add_eos_token(eos)
    if args.use_default_chat_template:
        dropin.use_default_chat_template(tokenizer, "segcache generate")
    ids = _prompt_ids(args, tokenizer, caches is not None)
    if args.image:
        _refuse_images(model, config, args.model)
    draft_model = None
    from .dflash.cli import dflash_of

    dflash = dflash_of(args, model)  # a DFlash --draft-model becomes --dflash
    if args.draft_model:
        draft_model, draft_tokenizer, _ = dropin.load(args.draft_model, what="draft model")
        dropin.check_draft_vocab(tokenizer, draft_tokenizer)
    head = None
    if args.mtp_weights and not args.mtp:
        raise ValueError("--mtp-weights needs --mtp")
    if args.mtp:
        from .mtp import head_for

        head = head_for(model, args.model or DEFAULT_MODEL, args.mtp_weights)
    sampler = _sampler(args, tokenizer,
                       speculative=bool(draft_model is not None or args.prompt_lookup or head is not None
                                        or dflash is not None))
    options = dict(gdn_prefill="auto", max_kv_size=args.max_kv_size)  # chunked GDN prefill off Metal
    store = _open_store(args) if args.prompt_cache_dir else None
    draft_runtime = None
    if caches is not None:
        from . import prompt_file

        from mlx_lm.models.cache import make_prompt_cache

        n = len(make_prompt_cache(model))
        runtime = prompt_file.runtime_from(model, caches[:n], **options)
        if draft_model is not None:
            if len(caches) == n:
                raise ValueError(
                    "--draft-model with --prompt-cache-file: the file holds no cache of the draft model, whose "
                    "tokens are unknown, so the draft cannot catch up; use --prompt-lookup, or a file saved "
                    "with the draft's caches after the model's"
                )
            draft_runtime = prompt_file.runtime_from(draft_model, caches[n:], **options)
    else:
        runtime = Runtime(model, store=store, **options)
    text, response = [], None
    if args.verbose:
        print("=" * 10)
    try:
        for response in stream_generate(
            model, tokenizer, ids,
            draft_model=draft_model, prompt_lookup=args.prompt_lookup, mtp=head, num_draft_tokens=args.num_draft_tokens,
            dflash=dflash,
            max_tokens=args.max_tokens, sampler=sampler, runtime=runtime, draft_runtime=draft_runtime,
            prefill_step_size=args.prefill_step_size, draft_tree=args.draft_tree,
            kv_bits=None if kv is None else kv.bits, kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
            **({} if args.draft_min_prob is None else {"draft_min_prob": args.draft_min_prob}),
        ):
            if args.verbose:
                print(response.text, end="", flush=True)
            text.append(response.text)
    finally:
        if store is not None:
            if args.verbose:
                st = store.stats()
                print(f"\nprompt cache: {st['hit_tokens']} tokens resumed, {st['entries']} entries", file=sys.stderr)
            store.close()
    if not args.verbose:
        print("".join(text))
        return 0
    print()
    print("=" * 10)
    if not "".join(text):
        print("No text generated for this prompt")
        return 0
    print(response.stats.summary())
    print(f"Peak memory: {response.peak_memory:.3f} GB")
    return 0


def _refuse_images(model, config, name) -> None:
    from mlx_lm.processors import load_processor

    if load_processor(model, config) is None:
        raise ValueError(f"The model {name} does not take images.")
    raise ValueError("--image: segcache generate does not feed images yet (a vision prompt's embeddings bypass "
                     "the token ids its runtime records); use mlx_lm.generate for prompts with images")


def _open_store(args):
    from .store import open_store

    try:
        return open_store(args.prompt_cache_dir, remote=args.prompt_cache_remote)
    except StoreError as exc:  # a damaged or full store is a cache miss, never a failed run
        warnings.warn(f"{exc}; generating without the prompt cache", StoreWarning, stacklevel=1)
        return None
