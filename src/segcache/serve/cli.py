"""`segcache serve`: flags, loading, the prefix store, uvicorn and an orderly shutdown.

Every flag of mlx_lm.server is taken with its name and meaning
(--prompt-cache-size is accepted and ignored: the store is bounded by bytes;
with --kv-bits requests decode one at a time, as mlx_lm.server serves them);
a few defaults differ on purpose (CORS off, one request decoded at a time:
tests/test_dropin_help.py lists them).
Its parser is built for every `segcache` command, so mlx, mlx-lm, uvicorn and
the server load inside `run` (after `raise_open_files`: mlx-lm's import would
lower the hard limit of open files).
SIGINT/SIGTERM: uvicorn stops accepting, lets requests in flight end, then the
worker drains and the store is flushed and closed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import warnings
from decimal import Decimal
from pathlib import Path

from .. import dropin
from ..errors import ModelError, SegcacheError, StoreError, UnsupportedModelError
from .isolation import read_keys
from .paths import default_cache_dir, private_dirs, shown

log = logging.getLogger("segcache.serve")

_BACKLOG = 2048  # uvicorn's default listen queue (asyncio also accepts up to this many at once)
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512M', '4G' or '4GiB' (powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512M, 4G)")
    return int(m.group(1)) << (10 * "_kmgt".index((m.group(2) or "_").lower()))


def _template_args(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is needed, e.g. '{\"enable_thinking\": false}'")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on an argparse `subparsers` object."""
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with a persistent prefix cache",
        description="Serve a local mlx-lm model over OpenAI's API (/v1/completions, /v1/chat/completions with "
        "tool calls and reasoning, /v1/responses, /v1/models, /health) and Anthropic's (/v1/messages) on segcache "
        "runtimes: every request resumes the longest prefix cached in RAM "
        "or on disk, and greedy output is token-identical to mlx-lm, speculative or not.",
    )
    p.add_argument("--model", required=True, help="model directory (mlx_lm.load)")
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
    p.add_argument("--num-draft-tokens", type=int, default=4, help="drafts per round, at most (default 4)")
    p.add_argument("--draft-tree", type=int, default=0, metavar="N",
                   help="with --prompt-lookup, --draft-model or --mtp: verify up to N draft nodes per round as a "
                        "tree, one row or batched (batched rows: the gate runs trees only where they pay; docs/tree.md; "
                        "default 0: chains)")
    p.add_argument("--prompt-cache-dir", help="prefix store directory (default: one per model identity under "
                   "the user's cache directory, e.g. ~/.cache/segcache/serve/<identity>)")
    p.add_argument("--prompt-cache-remote", metavar="URL", help="shared prefix-cache tier on Redis/Valkey, redis://[:password@]host:port/db (rediss:// for TLS); local tiers still serve when it is down")
    p.add_argument("--ram-bytes", type=parse_size, default=1 << 30,
                   help="RAM tier budget (default 1G; or --prompt-cache-bytes, in mlx_lm.server's units)")
    p.add_argument("--disk-bytes", type=parse_size, default=16 << 30, help="disk tier budget (default 16G)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--max-tokens", type=int, default=512, help="default tokens per completion (default 512)")
    p.add_argument("--temp", type=float, default=0.0, help="default sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling mass (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="default top-k sampling (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="default min-p sampling (default 0: off)")
    p.add_argument("--chat-template", default=None,
                   help="a chat template (Jinja text, or a file holding it) replacing the tokenizer's")
    p.add_argument("--chat-template-args", type=_template_args, default={}, metavar="JSON",
                   help="template variables for every chat, as a JSON object, e.g. '{\"enable_thinking\": false}' "
                        "(as mlx_lm.server); a request's chat_template_kwargs override them")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health; repeat it for several "
                        "keys, any of which is accepted (default: $SEGCACHE_API_KEY, else no key)")
    p.add_argument("--api-key-file", metavar="PATH",
                   help="more accepted API keys, one per line ('#' starts a comment line)")
    p.add_argument("--prompt-cache-isolation", choices=("none", "per-key"), default="none",
                   help="per-key: requests share cached prefixes only with requests of the same API key (so no "
                        "key can learn whether another's prompt is cached); none (default): all requests share, "
                        "except across different 'cache_salt' request fields")
    p.add_argument("--allowed-origins", type=_names, default=[],
                   help="comma-separated origins browsers may call from (CORS); other origins get 403 "
                        "(default: none but the server's own; '*': any)")
    p.add_argument("--allowed-hosts", type=_names, default=[],
                   help="comma-separated names requests may carry as Host, besides IP addresses, localhost and "
                        "the --host name: 'name', '.suffix' for names under it, '*' for any (default: none)")
    p.add_argument("--request-timeout", type=float, default=10.0,
                   help="seconds a client has to send a whole request, plus 1 s per 16 KiB of body; then 408 "
                        "and the connection is closed (default 10)")
    p.add_argument("--max-connections", type=int, default=0,
                   help="connections open at most; past it the longest idle one is closed, or a 503 when none "
                        "is idle (default 0: from the descriptor limit, raised to the hard limit at start)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; more get 429 (default 64)")
    p.add_argument("--flush-interval", type=float, default=10.0, metavar="SECONDS",
                   help="write the prefix store's new records to disk at least this often, off the model thread "
                        "(a crash loses at most this long of prompts; 0: only when idle and at exit; default 10)")
    p.add_argument("--max-body-bytes", type=parse_size, default=8 << 20, help="largest request body (default 8M)")
    p.add_argument("--decode-concurrency", type=int, default=32,
                   help="requests decoded together in one batched forward (default 32, as mlx_lm.server; 1: one "
                        "at a time), with or without a drafter; a lone request runs as fast as one at a time; "
                        "with --kv-bits requests decode one at a time (batched rows hold unquantized KV), as "
                        "mlx_lm.server serves quantized KV, and so they do on a model whose caches cannot be "
                        "batched")
    p.add_argument("--prompt-concurrency", type=int, default=8,
                   help="prompts being prefilled at once, at most (default 8, as mlx_lm.server): with "
                        "--decode-concurrency above 1 they advance together, one forward per step for all "
                        "(a step feeds at most one chunk while other rows decode)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill forward")
    p.add_argument("--checkpoint-interval", type=int, default=256,
                   help="checkpoint a long prompt every N tokens, so another prompt sharing only its start "
                        "resumes within N tokens of where they part (default 256; 0: only at chat message "
                        "boundaries, prompt ends and branch points)")
    p.add_argument("--hot-conversations", type=int, default=8, metavar="N",
                   help="keep the runtimes of the N most recent conversations live: a turn that extends one "
                        "continues from it copy-on-write instead of resuming its pages from the store, and the "
                        "store's RAM pages share its buffers (default 8; 0: off; off with --mtp, --kv-bits and "
                        "under mlx.launch)")
    p.add_argument("--hot-bytes", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="bytes the hot conversations' runtimes hold at most, beside --ram-bytes (their K/V "
                        "buffers are the store's RAM pages too); least recently used dropped first (default 256M)")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the model's layers over the ranks (pipeline parallel) instead of "
                        "its heads (tensor parallel, the default), as mlx_lm.server; ignored in one process")
    p.add_argument("--rank-timeout", type=float, default=300.0,
                   help="under mlx.launch: seconds a rank waits for the others at a step (the slowest rank's "
                        "longest step, a prefill chunk included) before it stops, saying so (default 300)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    _add_agent_flags(p)
    _add_mlx_lm_flags(p)
    p.set_defaults(handler=run)
    return p


# -- what coding agents' clients need (issue 32; docs/serve.md) ----------------------------------


def _add_agent_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-volatile-system", action="store_true",
                   help="render Claude Code's billing header block (a first system block starting "
                        "'x-anthropic-billing-header:', with a nonce that changes every request). By default it "
                        "is left out of the prompt: it tells a local model nothing and would end every shared "
                        "prefix at the nonce")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="a model name requests may give and /v1/models lists (repeatable: every name is "
                        "served, the first is listed first and is the one responses carry); default: the model "
                        "directory's name")
    p.add_argument("--strict-max-tokens", action="store_true",
                   help="refuse (400) a max_tokens beyond what the context leaves after the prompt, instead of "
                        "capping it (an answer the cap ended has finish_reason 'length', Messages' stop_reason "
                        "'model_context_window_exceeded')")


# -- the rest of mlx_lm.server's flags (issue 25; tests/test_dropin_help.py) -----------------


def _add_mlx_lm_flags(p: argparse.ArgumentParser) -> None:
    dropin.add_load_flags(p)
    dropin.add_default_template_flag(p)
    p.add_argument("--strict-fields", action="store_true",
                   help="refuse (400) request fields the server does not know and a hosted service's hints "
                        "(context_management, client_metadata, ...) instead of accepting and ignoring them")
    p.add_argument("--prompt-cache-bytes", type=parse_decimal_size, default=None,
                   help="the RAM tier's budget (as --ram-bytes) in mlx_lm.server's units: 2G = 2*10^9, "
                        "500MB = 5*10^8 (what leaves RAM goes to the disk tier, --disk-bytes)")
    p.add_argument("--prompt-cache-size", type=int, default=None,
                   help="mlx_lm.server's count of cached prompts. segcache's prefix store shares pages between "
                        "prompts and is bounded by bytes instead (--prompt-cache-bytes in RAM, --disk-bytes on "
                        "disk; what leaves RAM goes to disk), so a count does not apply: accepted and ignored, "
                        "with a note in the log")
    dropin.add_kv_flags(p, server=True)


_DECIMAL = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12}


def parse_decimal_size(text: str) -> int:
    """Bytes from mlx_lm.server's sizes: '1000000', '500M', '1.5GB' (powers of 1000)."""
    m = re.match(r"^\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*$", text)
    if not m or m.group(2).upper() not in _DECIMAL:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1000000, 500M, 2G, 1.5GB)")
    return int(Decimal(m.group(1)) * _DECIMAL[m.group(2).upper()])


def _mlx_lm_flags_check(args):
    """(why the mlx_lm.server flags given cannot be served or None, the KV quantization or None)."""
    try:
        kv = dropin.kv_setting(args)
    except ValueError as exc:
        return str(exc), None
    return _mlx_lm_flags_refusal(args), kv


def _apply_mlx_lm_flags(args, tokenizer, kv) -> None:
    """What the mlx_lm.server flags change once the model is loaded."""
    if args.use_default_chat_template:
        dropin.use_default_chat_template(tokenizer, "segcache serve")
    if args.prompt_cache_bytes is not None:
        args.ram_bytes = args.prompt_cache_bytes
    if args.prompt_cache_size is not None:
        log.info("--prompt-cache-size %d ignored: the prefix store is bounded by bytes (--prompt-cache-bytes, "
                 "--disk-bytes), not by a count of prompts", args.prompt_cache_size)
    if kv is not None and args.decode_concurrency > 1:
        # batched rows hold unquantized K/V only; mlx_lm.server too serves kv_bits one request at a time
        log.warning("--kv-bits: requests are decoded one at a time (--decode-concurrency %d does not apply: "
                    "batched rows hold unquantized KV), as mlx_lm.server does with quantized KV",
                    args.decode_concurrency)
        args.decode_concurrency = 1


def _mlx_lm_flags_refusal(args) -> str | None:
    """Why the mlx_lm.server flags given cannot be served (None: they can)."""
    if args.prompt_cache_size is not None and args.prompt_cache_size < 0:
        return "--prompt-cache-size must be >= 0"
    return None


def _names(text: str) -> list:
    return [o.strip() for o in text.split(",") if o.strip()]


def _config(model_dir: str) -> dict:
    try:
        with open(Path(model_dir) / "config.json") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _model_args(model) -> dict:
    from ..store.identity import model_config

    cfg = model_config(model)
    return cfg if isinstance(cfg, dict) else {}


def _lookup(cfg: dict, *keys):
    for src in (cfg, cfg.get("text_config") or {}):
        for k in keys:
            if isinstance(src.get(k), int):
                return src[k]
    return None


def _open_store(args, model):
    from ..store import model_identity, open_store

    path = Path(args.prompt_cache_dir).expanduser() if args.prompt_cache_dir else default_cache_dir(model_identity(model))
    try:
        private_dirs(path)
        store = open_store(path, ram_bytes=args.ram_bytes, disk_bytes=args.disk_bytes, remote=args.prompt_cache_remote)
    except (StoreError, OSError) as exc:
        warnings.warn(f"segcache serve: cannot open the prefix store at {path} ({exc}); serving without it")
        return None, path
    return store, path


def _group():
    """This rank's `Group` when started by mlx.launch (a group of more than one), else None."""
    import mlx.core as mx

    if mx.distributed.init().size() == 1:
        return None
    from .ranks import Group

    return Group()


def api_keys(args) -> list[str]:
    """The accepted API keys: every --api-key (else $SEGCACHE_API_KEY) and the --api-key-file's.

    Raises:
        ValueError: the keys file cannot be read, or a key is malformed.
    """
    given = args.api_key if args.api_key else [os.environ.get("SEGCACHE_API_KEY") or ""]
    return read_keys(given, args.api_key_file)


def _settings(args, model, tokenizer, keys):
    from .app import DEFAULT_MODEL, Settings

    cfg = _config(args.model) or _model_args(model)  # a hub id has no local config.json
    resolved = str(Path(args.model).resolve())
    served = list(dict.fromkeys(args.served_model_name or [Path(resolved).name]))
    name = served[0]
    return Settings(
        served_name=name, names={*served, Path(resolved).name, args.model, resolved, DEFAULT_MODEL},
        served_names=served, keep_volatile_system=args.keep_volatile_system,
        strict_max_tokens=args.strict_max_tokens,
        strict_fields=args.strict_fields,
        vocab_size=_lookup(cfg, "vocab_size") or len(tokenizer.vocab),
        context_length=_lookup(cfg, "max_position_embeddings", "max_seq_len", "n_positions", "seq_length"),
        max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, api_keys=tuple(keys), isolation=args.prompt_cache_isolation,
        allowed_origins=args.allowed_origins, max_body_bytes=args.max_body_bytes,
        bind_host=args.host, allowed_hosts=args.allowed_hosts,
        ram_bytes=args.ram_bytes, disk_bytes=args.disk_bytes,
        adapters={args.adapter_path, str(Path(args.adapter_path).resolve())} if args.adapter_path else set(),
    )


def run(args: argparse.Namespace) -> int:
    """Run `segcache serve` until SIGINT/SIGTERM; returns the process exit code."""
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(message)s")
    if (args.num_draft_tokens < 1 or args.max_tokens < 1 or args.prefill_step_size < 1 or args.max_queue < 0
            or args.checkpoint_interval < 0 or args.decode_concurrency < 1 or args.prompt_concurrency < 1
            or not args.request_timeout > 0 or args.max_connections < 0 or not args.rank_timeout > 0):
        print("segcache serve: --num-draft-tokens, --max-tokens, --prefill-step-size, --decode-concurrency and "
              "--prompt-concurrency must be >= 1, --request-timeout and --rank-timeout > 0, "
              "--max-queue, --checkpoint-interval and --max-connections >= 0", file=sys.stderr)
        return 2
    if args.draft_tree < 0 or (args.draft_tree and not (args.prompt_lookup or args.draft_model or args.mtp)):
        print("segcache serve: --draft-tree N takes N >= 0, and N > 0 only with --prompt-lookup, --draft-model or --mtp",
              file=sys.stderr)
        return 2
    if args.dflash and (args.draft_model or args.mtp):
        print("segcache serve: --dflash drafts alone or beside --prompt-lookup, not with --draft-model or --mtp",
              file=sys.stderr)
        return 2
    try:
        keys = api_keys(args)
    except ValueError as exc:
        print(f"segcache serve: {exc}", file=sys.stderr)
        return 2
    if args.prompt_cache_isolation == "per-key" and not keys:
        print("segcache serve: --prompt-cache-isolation per-key needs API keys (--api-key, --api-key-file or "
              "$SEGCACHE_API_KEY): without them every request is in one domain", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from .guard import connection_protocol, default_max_connections, install_repeats, raise_open_files

        open_files = raise_open_files()  # before mlx-lm loads: its import would lower the hard limit
        from .app import Server, build_app
    except ImportError as exc:
        print(f"segcache serve: {exc.name or exc} is not installed; reinstall segcache (it depends on it)", file=sys.stderr)
        return 1
    # uvicorn's and asyncio's records reach the root handler too (log_config=None below), so
    # one filter there holds every repeated warning or error to one line per interval
    install_repeats()
    from .chat import Prompter
    from .engine import Engine
    from .hot import HotRuntimes
    from .worker import Scheduler, Worker, release_streams

    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    refusal, kv = _mlx_lm_flags_check(args)
    if refusal:
        print(f"segcache serve: {refusal}", file=sys.stderr)
        return 2
    group = _group()  # under mlx.launch: this rank's (docs/distributed.md); None in one process
    loaded, failure = [], None
    from ..dflash.cli import dflash_of, take_draft_dir

    take_draft_dir(args, "segcache serve")  # a --draft-model that is a DFlash checkpoint becomes --dflash
    if group is not None and (args.adapter_path or args.trust_remote_code):
        failure = ("segcache serve: --adapter-path and --trust-remote-code under mlx.launch are not built yet "
                   "(the sharded load takes neither); serve in one process to use them")
    for path, adapter in ((args.model, args.adapter_path), (args.draft_model, None)):
        if path is None or failure is not None:
            continue
        try:  # the model sharded over the group; a draft model whole on every rank, without the adapter
            if group is not None and not loaded:
                loaded.append(group.load(path, args.pipeline))
            else:
                loaded.append(dropin.load(path, adapter_path=adapter, trust_remote_code=args.trust_remote_code)[:2])
        except ModelError as exc:
            failure = f"segcache serve: {exc}"
        except Exception as exc:  # mlx-lm raises several types for a bad directory
            failure = f"segcache serve: cannot load the model at {path}: {exc}"
    if group is not None:
        failure = group.loaded(failure, args)  # every rank loaded, with the same settings, or every rank stops
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    model, tokenizer = loaded[0]
    draft = loaded[1][0] if args.draft_model else None
    _apply_mlx_lm_flags(args, tokenizer, kv)
    vocab = _lookup(_config(args.model) or _model_args(model), "vocab_size")
    if draft is not None and _lookup(_config(args.draft_model) or _model_args(draft), "vocab_size") != vocab:
        print("segcache serve: the draft model's vocabulary differs from the model's; the draft must share "
              "its tokenizer", file=sys.stderr)
        return 2
    head = None
    if getattr(args, "mtp_weights", None) and not getattr(args, "mtp", False):
        print("segcache serve: --mtp-weights needs --mtp", file=sys.stderr)
        return 2
    if getattr(args, "mtp", False):
        from ..mtp import head_for

        try:
            head = head_for(model, args.model, args.mtp_weights)
        except SegcacheError as exc:
            print(f"segcache serve: --mtp: {exc}", file=sys.stderr)
            return 2
    try:
        dflash = dflash_of(args, model, "segcache serve")
    except (SegcacheError, ValueError) as exc:
        print(f"segcache serve: --dflash: {exc}", file=sys.stderr)
        return 2
    store, path = _open_store(args, model) if group is None else group.open_store(args, model)
    settings = _settings(args, model, tokenizer, keys)
    name = settings.served_name
    options = dict(store=store, draft_model=draft, prompt_lookup=args.prompt_lookup, mtp=head, dflash=dflash,
                   num_draft_tokens=args.num_draft_tokens, prefill_step=args.prefill_step_size,
                   draft_tree=args.draft_tree, checkpoint_interval=args.checkpoint_interval, vocab_size=vocab)
    if kv is not None:
        options["kv"] = kv  # one row at a time: batched rows hold unquantized KV (_apply_mlx_lm_flags)
    if args.hot_conversations < 0:
        print("segcache serve: --hot-conversations must be >= 0", file=sys.stderr)
        return 2
    if group is None and head is None and kv is None:  # each rank, the MTP head's hidden states, quantized KV: not yet
        options["hot"] = HotRuntimes(args.hot_conversations, args.hot_bytes)
    running = args.decode_concurrency
    channel = group.channel if group is not None else None
    try:
        engine = Engine(model, tokenizer, decode_concurrency=running, prompt_concurrency=args.prompt_concurrency,
                        group=channel, **options)
    except UnsupportedModelError as exc:
        if running == 1:
            raise
        # as mlx_lm.server, which batches the requests whose caches are batchable: this model's are not
        log.warning("requests are decoded one at a time (--decode-concurrency %d does not apply: %s)", running, exc)
        running = args.decode_concurrency = 1
        engine = Engine(model, tokenizer, decode_concurrency=1, prompt_concurrency=args.prompt_concurrency,
                        group=channel, **options)
    if group is not None and not group.leader:  # no HTTP here: rank 0's steps, until it stops or is lost
        return group.follow(engine, args, store, path)
    if group is not None:
        scheduler = group.scheduler(engine, args)
    else:
        scheduler = Scheduler(engine, max_queue=args.max_queue, max_running=running, begin_step=engine.begin_step)
    worker = Worker(scheduler, flush_interval=args.flush_interval)
    server = Server(settings, Prompter(tokenizer, template, args.chat_template_args), scheduler, worker, store)

    def close() -> None:
        worker.stop()  # uvicorn let the requests in flight end: the queue is empty
        if store is not None and not store.closed:
            store.close()  # the RAM tier reaches disk
            log.info("prefix store flushed and closed: %s", shown(path))
        release_streams()  # this thread loaded the models (see release_streams)
        if group is not None and group.lost is not None:
            group.exit()  # the group lost a rank: stop here, saying why (the requests in flight failed)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # Here, not after uvicorn.run: uvicorn re-raises SIGTERM/SIGINT once it
        # has shut down, which ends the process before any code after it.
        close()

    mode = ("draft model" if draft is not None else f"DFlash blocks of {dflash.cfg.block_size}"
            + (" beside prompt lookup" if args.prompt_lookup else "") if dflash is not None
            else "prompt lookup" if args.prompt_lookup else f"MTP depth {args.num_draft_tokens}" if head is not None
            else "plain")
    rows = f", up to {args.decode_concurrency} rows batched" if args.decode_concurrency > 1 else ""
    rows += f", KV quantized to {kv.bits} bits from token {kv.start}" if kv is not None else ""
    rows += f", adapter {args.adapter_path}" if args.adapter_path else ""
    ranks = f", rank 0 of {group.size} ({group.parallel} parallel)" if group is not None else ""
    log.info("serving %s (%s decoding%s%s) on http://%s:%d; prefix store: %s", name, mode, rows, ranks, args.host,
             args.port, shown(path) if store is not None else "none")
    if args.keep_volatile_system:
        log.info("system prompts: Claude Code's billing header block is rendered (--keep-volatile-system); its "
                 "nonce ends every shared prefix there")
    else:
        log.info("system prompts: a first system block starting 'x-anthropic-billing-header:' (Claude Code's, a "
                 "nonce per request) is left out of the prompt; --keep-volatile-system keeps it")
    max_connections = args.max_connections or default_max_connections(open_files, _BACKLOG)
    log.info("connections: at most %d open, requests whole within %g s; open files: %s", max_connections,
             args.request_timeout, open_files or "no limit")
    worker.start()
    try:
        uvicorn.run(build_app(server, lifespan), host=args.host, port=args.port,
                    log_level=args.log_level.lower(), access_log=False, log_config=None, backlog=_BACKLOG,
                    http=connection_protocol(args.request_timeout, max_connections))
    finally:
        close()
    return 0
