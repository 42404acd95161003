"""A prompt that extends a recent one is encoded past their shared part only (serve/reencode.py):
its ids and token ends are always those of encoding it whole (the tokenizer itself, and mlx-lm's
own chat rendering), on the shipped target's tokenizer; a tokenizer the argument does not cover
encodes whole, and a splice that differs turns splicing off."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import logging

import mlx_lm
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from segcache.serve.chat import Prompter
from segcache.serve.reencode import Reencoder, _cut, common_chars, splittable
from serve_util import TARGET

TEXT = open(TARGET.parent / "heldout_stdlib.txt").read()
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FRAGMENTS = ["a", "Z", "foo", " bar", "\n", "\n\n", "\r\n", "  ", "\t", "123", ".", "}\n", "'s", " it's",
             "\u00e9", "e\u0301", "\u0301", "\u4e2d\u6587", "\U0001f642", "<|endoftext|>", "\nx", "\n  y", "\n\nDef"]


@pytest.fixture(scope="module")
def tok():
    return mlx_lm.load(str(TARGET))[1]


def whole(hf, text):
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [e for _, e in enc["offset_mapping"]]


def test_an_agent_conversation_is_spliced_turn_after_turn_and_each_prompt_is_mlx_lms_rendering(tok):
    p = Prompter(tok, TEMPLATE)
    assert p._encoder.reason is None  # byte-level BPE with regex splits: spliced
    msgs = [{"role": "system", "content": TEXT[:30000]}, {"role": "user", "content": "What does it do?"}]
    for turn in range(6):
        got = p.chat(msgs)
        want = tok.apply_chat_template(msgs, chat_template=TEMPLATE, add_generation_prompt=True)
        assert got.ids == list(want), turn
        msgs = msgs + [{"role": "assistant", "content": f"Turn {turn}: it parses.\nThen it writes {turn}."},
                       {"role": "user", "content": TEXT[40000 + 900 * turn : 40700 + 900 * turn]}]
    # the checkpoints too: the ends of a spliced prompt are a whole encode's
    assert got.checkpoints == Prompter(tok, TEMPLATE).chat(msgs[:-2]).checkpoints
    assert p._encoder.spliced >= 4 and p._encoder.reason is None
    p._encoder.check()
    # the same prompt again is the kept encoding, not a second entry
    again = p.chat(msgs[:-2])
    assert again.ids == got.ids and again.checkpoints == got.checkpoints
    p._encoder.check()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(head=st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=60),
       tail=st.lists(st.sampled_from(FRAGMENTS), max_size=30), keep=st.integers(0, 400))
def test_a_splice_is_the_whole_encode_of_any_text(tok, head, tail, keep):
    hf = tok._tokenizer
    recent = "".join(head)
    recent = recent + "\nLine" + recent
    new = recent[: min(keep, len(recent))] + "".join(tail)
    enc = Reencoder(hf, check_every=1 << 30, min_shared=1)  # no guard: the splice itself is checked here
    assert enc.encode(recent) == whole(hf, recent)
    got = enc.encode(new)
    assert got == whole(hf, new)
    shared = common_chars(recent, new)
    if new != recent and shared >= 1 and _cut(new, shared) is not None:
        assert enc.spliced == 1  # a cut was there: the recent prompt's tokens were reused
    enc.check()


def _metaspace_tokenizer():
    """A BPE tokenizer (trained here) with a sentencepiece-style pre-tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    # pieces end at each newline, and only the text's first piece gets the "\u2581" prefix: a text's
    # tail encoded alone is not the tail of its whole encode
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                  pre_tokenizers.Metaspace(prepend_scheme="first")])
    core.train_from_iterator([TEXT[:20000]], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_a_tokenizer_outside_the_argument_encodes_whole_and_a_differing_splice_turns_splicing_off(caplog):
    hf = _metaspace_tokenizer()
    assert "Metaspace" in splittable(hf)
    enc = Reencoder(hf, min_shared=1)
    recent = TEXT[:3000]
    new = recent[: recent.rindex("\n", 0, 2500)] + "\nTail text here."
    assert enc.encode(recent) == whole(hf, recent) and enc.encode(new) == whole(hf, new) and enc.spliced == 0
    enc = Reencoder(hf, min_shared=1)
    enc.reason = None  # as if it passed: the first splice is compared with a whole encode
    enc.encode(recent)
    with caplog.at_level(logging.WARNING, logger="segcache.serve"):
        assert enc.encode(new) == whole(hf, new)
    assert enc.spliced == 1 and enc.reason is not None and "encoded whole" in caplog.text
    assert enc.encode(new + " more") == whole(hf, new + " more") and enc.spliced == 1  # whole from now on


def _trained(pre_tokenizer):
    """A byte-level BPE trained here on held-out code, with `pre_tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizer
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([TEXT[:40000]], trainers.BpeTrainer(vocab_size=600, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core)


# Llama 3's split pattern (its tokenizer.json): pieces before the byte-level step
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_gpt2_and_llama3_style_tokenizers_are_spliced_exactly(kind):
    """The other byte-level kinds the module's argument names: GPT-2's (its regex inside the
    byte-level step) and Llama 3's (a split regex, then the byte-level step)."""
    from tokenizers import Regex, pre_tokenizers

    pre = (pre_tokenizers.ByteLevel(add_prefix_space=False) if kind == "gpt2" else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                      use_regex=False)]))
    hf = _trained(pre)
    enc = Reencoder(hf, check_every=1 << 30, min_shared=1)
    assert enc.reason is None
    text = "\n".join(line.lstrip() for line in TEXT[50000:57000].splitlines())  # lines that may start a cut
    for k, cut in enumerate(range(1000, 6000, 700)):
        new = text[:cut] + TEXT[60000 + 300 * k : 60250 + 300 * k]
        assert enc.encode(new) == whole(hf, new), (kind, cut)
    assert enc.spliced >= 5
    enc.check()
