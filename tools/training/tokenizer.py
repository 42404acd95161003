"""The demo tokenizers: a byte-level BPE trained on the corpus, and its chat extension."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers
from transformers import AutoTokenizer

from training.common import EOS_TOKEN

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
# Pre-tokenizer split pattern of transformers' Qwen2/Qwen3.5 tokenizers (see train_tokenizer).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                      "<think>", "</think>")
CHAT_EOS = "<|im_end|>"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE tokenizer with an EOS special token.

    The normalizer and pre-tokenizer are the ones transformers' ``Qwen3_5Tokenizer``
    installs: transformers 5 forces that class (rebuilding the pipeline around our
    vocab and merges) for any ``model_type: qwen3_5`` directory, whatever
    ``tokenizer_config.json`` says. Training with the same pipeline makes the target
    (qwen3_5) and the draft (llama, loaded as a plain fast tokenizer) tokenize alike.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _write_configs(directory: Path, config: dict, special: dict) -> None:
    """Writes ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def save_tokenizer_files(tokenizer: Tokenizer, directory: Path) -> None:
    """Writes ``tokenizer.json`` plus the transformers config files into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    _write_configs(directory, config,
                   {k: EOS_TOKEN for k in ("bos_token", "eos_token", "unk_token", "pad_token")})


def check_round_trip(directory: Path, samples: list[str]) -> None:
    """Asserts the saved tokenizer (via transformers) decodes back to the exact text."""
    hf_tokenizer = AutoTokenizer.from_pretrained(str(directory))
    for text in samples:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        back = hf_tokenizer.decode(ids)
        if back != text:
            raise AssertionError(f"tokenizer round trip failed on {text[:80]!r}")
    assert hf_tokenizer.eos_token == EOS_TOKEN


def chat_tokenizer(base_dir: Path, template: Path, directory: Path) -> Tokenizer:
    """Writes the chat tokenizer: the base BPE plus the chat markup tokens and template.

    The new tokens get the ids after the base vocabulary (every base id keeps its
    meaning); ``<|im_start|>`` / ``<|im_end|>`` are special, the tool and think
    markup are plain added tokens, as in Qwen3.5's tokenizer. EOS becomes
    ``<|im_end|>`` (the models' config lists ``<|endoftext|>`` as a second EOS).
    Idempotent: a base that already has the tokens is left as it is.

    Returns:
        The ``tokenizers.Tokenizer``.
    """
    tokenizer = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    base_vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in CHAT_SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t in CHAT_MARKUP_TOKENS])
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    assert all(vocab[t] == i for t, i in base_vocab.items()), "a base token changed its id"
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": CHAT_EOS,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 1_000_000_000,
    }
    _write_configs(directory, config, {"eos_token": CHAT_EOS, "pad_token": EOS_TOKEN})
    shutil.copy(template, directory / CHAT_TEMPLATE_FILE)
    return tokenizer


def load_chat_tokenizer(directory: Path):
    """The chat tokenizer as mlx-lm loads it (a ``TokenizerWrapper``), checked.

    Asserts what serving relies on: a chat template, thinking markup, and mlx-lm's
    ``qwen3_coder`` tool parser, inferred from the template exactly as for Qwen3.5.
    """
    vocab = json.loads((directory / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    tokenizer = load_tokenizer(directory, eos_token_ids=[ids[CHAT_EOS], ids[EOS_TOKEN]])
    assert tokenizer.has_chat_template and tokenizer.has_thinking
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    assert tokenizer.tool_parser.__module__ == "mlx_lm.tool_parsers.qwen3_coder"
    return tokenizer


def chat_vocab_size(directory: Path) -> int:
    """The vocabulary size of the chat tokenizer in ``directory`` (checked as it loads)."""
    return len(load_chat_tokenizer(directory).get_vocab())
