"""A character tokenizer for the vocab-64 test models.

One token per character (lower-cased), so any text encodes, decodes back
(up to case and unknown characters) and fits `models.VOCAB`. Wrapped as
mlx-lm wraps a loaded tokenizer, so `mlx_lm.stream_generate` and segcache's
generation run on the very same object.
"""

from __future__ import annotations

import string

from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers import models as token_models
from transformers import PreTrainedTokenizerFast

from .models import VOCAB

EOS = "<eos>"
UNK = "<unk>"
CHARS = string.ascii_lowercase + string.digits + " \n" + ".,:;()[]{}=+-*/_'\"#<>!?@"
TOKENS = [EOS, UNK] + list(CHARS)
EOS_ID = 0

assert len(TOKENS) == VOCAB, f"{len(TOKENS)} tokens for a vocabulary of {VOCAB}"


def hf_tokenizer(eos: bool = True):
    """A transformers `PreTrainedTokenizerFast` over the 64 tokens.

    Args:
        eos: declare "<eos>" (id 0) as the EOS token; False for a tokenizer
            without one, so generation stops only at max_tokens.
    """
    vocab = {tok: i for i, tok in enumerate(TOKENS)}
    core = Tokenizer(token_models.WordLevel(vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS if eos else None, unk_token=UNK, clean_up_tokenization_spaces=False
    )


def tokenizer(eos: bool = True, eos_token_ids=None):
    """The test tokenizer as mlx-lm's `TokenizerWrapper`.

    Args:
        eos: as in `hf_tokenizer`.
        eos_token_ids: more ids that stop generation.
    """
    return TokenizerWrapper(hf_tokenizer(eos), eos_token_ids=eos_token_ids)


def save(directory) -> None:
    """Write the tokenizer files into a model directory, for `mlx_lm.load`."""
    hf_tokenizer().save_pretrained(str(directory))
