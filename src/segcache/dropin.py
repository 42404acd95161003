"""What `segcache generate` and `segcache serve` share with mlx-lm's commands.

The flags both commands take from `mlx_lm.generate` / `mlx_lm.server` with the
same names and meanings (loading: --adapter-path, --trust-remote-code; KV
quantization: --kv-bits, --kv-group-size, --quantized-kv-start;
--use-default-chat-template), and loading a model the way mlx-lm's commands do.
`tests/test_dropin_help.py` compares both commands' flags with mlx-lm's own parsers.
"""

from __future__ import annotations

import argparse
import sys

from .errors import ModelError
from .kvquant import DEFAULT_GROUP_SIZE, DEFAULT_START, KVQuantization


def str2bool(text: str) -> bool:
    """mlx_lm.generate's `--verbose` values: anything but 'false' / 'f' (any case) is True."""
    return text.lower() not in ("false", "f")


def add_load_flags(p: argparse.ArgumentParser) -> None:
    """--trust-remote-code and --adapter-path (both commands)."""
    p.add_argument("--trust-remote-code", action="store_true",
                   help="trust remote code in the tokenizer (as mlx-lm: passed to the tokenizer's loader)")
    p.add_argument("--adapter-path",
                   help="a LoRA / DoRA adapter directory (adapter_config.json, adapters.safetensors) made by "
                        "mlx_lm.lora, applied to the model as mlx-lm applies it; the prefix store keys its "
                        "records with the adapter's weights, so prefixes never cross adapters")


def add_kv_flags(p: argparse.ArgumentParser, *, server: bool) -> None:
    """--kv-bits, --kv-group-size, --quantized-kv-start (both commands)."""
    extra = (" Requests are then decoded one at a time (--decode-concurrency 1), as mlx_lm.server does."
             if server else "")
    p.add_argument("--kv-bits", type=int, default=None,
                   help="quantize the full-attention KV cache to this many bits (e.g. 4 or 8) once a sequence "
                        "holds --quantized-kv-start tokens, as mlx-lm does; the prefix store keeps quantized "
                        "pages as their own records (smaller, faster to resume)." + extra +
                        " Default: no quantization")
    p.add_argument("--kv-group-size", type=int, default=DEFAULT_GROUP_SIZE,
                   help=f"elements per quantization group of the KV cache (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--quantized-kv-start", type=int, default=DEFAULT_START,
                   help="with --kv-bits: quantize the KV cache once it holds this many tokens, after the "
                        f"forward that reaches them (default {DEFAULT_START})")


def add_default_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="if the tokenizer has no chat template, use its default one (when it has one)")


def kv_setting(args: argparse.Namespace) -> KVQuantization | None:
    """The KV quantization the flags ask for, or None.

    Raises:
        ValueError: naming the flags, when MLX cannot quantize with them.
    """
    try:
        return KVQuantization.of(args.kv_bits, args.kv_group_size, args.quantized_kv_start)
    except ValueError as exc:
        raise ValueError(f"--kv-bits / --kv-group-size / --quantized-kv-start: {exc}") from None


def load(path: str, *, what: str = "model", adapter_path: str | None = None, trust_remote_code: bool = False,
         tokenizer_config: dict | None = None, model_config: dict | None = None):
    """`mlx_lm.load` as mlx-lm's commands call it; returns (model, tokenizer, config).

    Raises:
        ModelError: the directory (or the adapter) cannot be loaded.
    """
    import mlx.core as mx  # the flags above are registered without loading mlx
    from mlx_lm import load as mlx_load

    tokenizer_config = dict(tokenizer_config or {})
    tokenizer_config["trust_remote_code"] = trust_remote_code
    try:
        model, tokenizer, config = mlx_load(
            path, adapter_path=adapter_path, tokenizer_config=tokenizer_config, model_config=model_config or {},
            return_config=True, trust_remote_code=trust_remote_code,
        )
        # mlx-lm evaluates the base weights but leaves an adapter's lazy: evaluate them here, on the loading
        # thread (serve's model thread has streams of its own and cannot evaluate arrays of this one)
        mx.eval(model.parameters())
    except Exception as exc:  # mlx-lm raises several types for a bad directory or adapter
        where = f"{path!r} with the adapter {adapter_path!r}" if adapter_path else repr(path)
        raise ModelError(f"cannot load the {what} from {where}: {exc}") from exc
    return model, tokenizer, config


def use_default_chat_template(tokenizer, command: str) -> None:
    """mlx_lm.server's --use-default-chat-template: the default template when there is none.

    Tokenizers of transformers 5 carry no default template; then the prompt is
    used without one (what mlx_lm.generate, which accepts the flag and ignores
    it, does) and a note says so.
    """
    if getattr(tokenizer, "chat_template", None) is not None:
        return
    default = getattr(tokenizer, "default_chat_template", None)
    if default:
        tokenizer.chat_template = default
    else:
        print(f"{command}: --use-default-chat-template: the tokenizer has no default chat template; "
              "prompts are used without a template", file=sys.stderr)


def check_draft_vocab(tokenizer, draft_tokenizer) -> None:
    """mlx-lm's check that a draft model shares the model's tokenizer.

    Raises:
        ValueError: the vocabulary sizes differ.
    """
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"the draft model's tokenizer ({draft_tokenizer.vocab_size} tokens) does not match the model's "
            f"({tokenizer.vocab_size}); a draft model must share the model's tokenizer"
        )
