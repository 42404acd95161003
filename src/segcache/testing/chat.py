"""Scripted chat models for the serving tests: a tokenizer per mlx-lm tool-parser family,
a chat template that renders tools, and a tiny model whose greedy reply is a given text.

The model is mlx-lm's own llama (or qwen3_next, a hybrid) class with hand-set weights: the attention and
MLP outputs are zero, so the residual stream is the current token's one-hot
embedding, and the output head maps each token to the next token of a script
(EOS for every other token). Its greedy continuation depends on the prompt's
last token only:

    "...<|im_start|>assistant\\n"          -> the "default" script
    "...<|im_start|>assistant\\n<|s:NAME|>" -> the script NAME (chat_template_kwargs {"script": NAME})

A script's text is made of added tokens found nowhere else in it, so each
has one successor; the tool-call markers inside it are text, which is how
both mlx_lm.server and segcache serve find them (by text, not by token id).
The tokenizer's `tool_parser_type` names the family, so `mlx_lm.load` gives
it that family's parser and markers; with `thinking`, "<think>" and
"</think>" are tokens and the template opens a reasoning block, so the
tokenizer has mlx-lm's reasoning channel too.

    path = build(tmp / "m", family="json_tools", scripts={"default": call_text("json_tools")})
    model, tokenizer = mlx_lm.load(str(path))
"""

from __future__ import annotations

import importlib
import json
import string
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as token_models
from transformers import PreTrainedTokenizerFast

from .models import build as build_model
from .models import config as model_config

EOS = "<eos>"
UNK = "<unk>"
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]
ROLE_TOKENS = ["<|im_start|>", "<|im_end|>"]
THINK = ("<think>", "</think>")

# One call, read_file(path="src/app.py"), in each family's format: the text between
# its start and end markers (mlx_lm/tool_parsers/*.py).
CALLS = {
    "json_tools": '\n{"name": "read_file", "arguments": {"path": "src/app.py"}}\n',
    "qwen3_coder": "\n<function=read_file>\n<parameter=path>\nsrc/app.py\n</parameter>\n</function>\n",
    "glm47": "read_file<arg_key>path</arg_key><arg_value>src/app.py</arg_value>",
    "laguna": "read_file<arg_key>path</arg_key><arg_value>src/app.py</arg_value>",
    "pythonic": '[read_file(path="src/app.py")]',
    "mistral": 'read_file[ARGS]{"path": "src/app.py"}',
    "function_gemma": "call:read_file{path:<escape>src/app.py<escape>}",
    "gemma4": 'call:read_file{path:<|"|>src/app.py<|"|>}',
    "kimi_k2": '<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{"path": "src/app.py"}'
               "<|tool_call_end|>",
    "kimi_k3": '<|open|>call tool="read_file" index="1"<|sep|><|open|>argument key="path" type="string"<|sep|>'
               "src/app.py<|close|>argument<|sep|><|close|>call<|sep|>",
    "longcat": "read_file<longcat_arg_key>path</longcat_arg_key><longcat_arg_value>src/app.py</longcat_arg_value>",
    "minicpm5": '"read_file"><param name="path">src/app.py</param>',
    "minimax_m2": '<invoke name="read_file"><parameter name="path">src/app.py</parameter></invoke>',
    "muse_spark": '<atem:invoke name="read_file"><atem:parameter name="path">src/app.py</atem:parameter>'
                  "</atem:invoke>",
}
FAMILIES = tuple(CALLS)

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the repository for a regular expression.",
    "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}}}


def markers(family: str) -> tuple[str, str]:
    """(tool_call_start, tool_call_end) of a parser family, from mlx-lm's module."""
    mod = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    return mod.tool_call_start, mod.tool_call_end


def call_text(family: str, body: str | None = None) -> str:
    """A whole call in `family`'s markup (the sample call unless `body` is given)."""
    start, end = markers(family)
    return start + (CALLS[family] if body is None else body) + end


def template(family: str) -> str:
    """A ChatML chat template that renders tools, earlier calls (in `family`'s markers, JSON
    inside), tool results, reasoning, and the script selector."""
    start, end = markers(family)
    nl = "{{- '\\n' }}"
    return "".join([
        "{%- if tools or messages[0].role == 'system' %}<|im_start|>system", nl,
        "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}",
        "{%- if tools %}", nl, "# Tools", nl, "<tools>", nl,
        "{%- for tool in tools %}{{- tool | tojson }}", nl, "{%- endfor %}</tools>{%- endif %}",
        "<|im_end|>", nl, "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message.role == 'system' and loop.first %}",
        "{%- elif message.role == 'assistant' %}<|im_start|>assistant", nl,
        "{%- if message.reasoning_content %}<think>", nl, "{{- message.reasoning_content }}", nl, "</think>",
        nl, nl, "{%- endif %}{{- message.content }}",
        "{%- for tc in message.tool_calls or [] %}", start,
        '{"name": {{ tc.function.name | tojson }}, "arguments": {{ tc.function.arguments | tojson }}}', end,
        "{%- endfor %}<|im_end|>", nl,
        "{%- elif message.role == 'tool' %}<|im_start|>tool", nl, "{{- message.content }}<|im_end|>", nl,
        "{%- else %}<|im_start|>{{ message.role }}", nl, "{{- message.content }}<|im_end|>", nl,
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}<|im_start|>assistant", nl,
        "{%- if enable_thinking is defined and enable_thinking %}<think>", nl, "{%- endif %}",
        "{%- if script is defined %}<|s:{{ script }}|>{%- endif %}{%- endif %}",
    ])


def _pieces(text: str, used: set, size: int = 5) -> list[str]:
    """`text` cut into pieces of about `size` characters, none of them in `used` (added to it)."""
    out, i = [], 0
    while i < len(text):
        n = min(size, len(text) - i)
        while (text[i:i + n] in used or text[i:i + n] in CHARS) and i + n < len(text):
            n += 1
        if text[i:i + n] in used or text[i:i + n] in CHARS:  # a tail taken already: join it to the last piece
            if not out:
                raise ValueError(f"cannot cut {text!r} into tokens of their own")
            used.discard(out[-1])
            i -= len(out.pop())
            n = len(text) - i
        out.append(text[i:i + n])
        used.add(text[i:i + n])
        i += n
    return out


def build(directory, *, family: str | None = "json_tools", scripts: dict | None = None, thinking: bool = False,
          forced: str | None = None, arch: str = "llama") -> Path:
    """Write a scripted model directory for `mlx_lm.load` (and `segcache serve --model`).

    Args:
        directory: where to write it (created).
        family: the mlx-lm tool-parser family of its tokenizer (a key of CALLS), or
            None for a tokenizer without tool calling.
        scripts: script name -> the reply text; "default" is the reply to a prompt
            without the selector.
        thinking: make "<think>"/"</think>" tokens and open a reasoning block in the
            generation prompt (mlx-lm then gives the tokenizer a reasoning channel).
        forced: the reply to a prompt that ends with the tool-call start marker (a
            forced call); the marker is then a token.
        arch: the scripted model's class: "llama", or "qwen3_next" for a hybrid (Gated
            DeltaNet layers whose outputs are zero: the recurrent states are kept,
            checkpointed and restored as on any hybrid, and do not change the reply).
            Not "qwen3_5": transformers gives that model type its own tokenizer class,
            which rebuilds the tokenizer as a BPE.

    Returns:
        The directory's path.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    scripts = dict(scripts or {})
    start = markers(family)[0] if family else None
    heads = {n: "\n" if n == "default" else f"<|s:{n}|>" for n in scripts}
    if forced is not None:
        scripts = {**scripts, "forced": forced}
        heads["forced"] = start
    used: set = set(ROLE_TOKENS) | (set(THINK) if thinking else set()) | set(heads.values())
    chains = {name: _pieces(text, used) for name, text in scripts.items()}
    markers_ = ROLE_TOKENS + (list(THINK) if thinking else []) + [h for h in heads.values() if h != "\n"]
    pieces = [p for chain in chains.values() for p in chain]
    base = [EOS, UNK] + CHARS
    core = Tokenizer(token_models.WordLevel({t: i for i, t in enumerate(base)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Markers are matched in a prompt before pieces (non-normalized added tokens are split
    # out first), so a piece that overlaps one never hides it: "</think>" in a rendered
    # history is one token, as in a real vocabulary.
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers_])
    core.add_tokens([AddedToken(t, special=False, normalized=True) for t in pieces])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, unk_token=UNK,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = template(family or "json_tools")
    tok.save_pretrained(str(directory))
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # not the one transformers keeps for the model type
    if family:
        cfg["tool_parser_type"] = family
    cfg_path.write_text(json.dumps(cfg, indent=2))

    vocab = len(tok)
    nxt = {}
    for name, chain in chains.items():
        ids = [tok.convert_tokens_to_ids(p) for p in chain]
        head = tok.convert_tokens_to_ids(heads[name])
        for a, b in zip([head] + ids, ids + [tok.eos_token_id]):
            nxt[a] = b
    hidden = -(-vocab // 16) * 16
    if arch == "llama":
        config = dict(model_type="llama", hidden_size=hidden, num_hidden_layers=1, intermediate_size=16,
                      num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=vocab,
                      rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=32768)
    else:
        config = model_config(arch, hidden_size=hidden, vocab_size=vocab, intermediate_size=16,
                              max_position_embeddings=32768)
    model = build_model(arch, **{k: v for k, v in config.items() if k != "model_type"})
    eye = np.zeros((vocab, hidden), np.float32)
    eye[np.arange(vocab), np.arange(vocab)] = 1.0
    head_w = np.zeros((vocab, hidden), np.float32)
    for a in range(vocab):
        head_w[nxt.get(a, tok.eos_token_id), a] = 30.0
    weights = []
    for name, w in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            weights.append((name, mx.ones_like(w)))
        elif name.endswith("embed_tokens.weight"):
            weights.append((name, mx.array(eye)))
        elif name.endswith("lm_head.weight"):
            weights.append((name, mx.array(head_w)))
        else:
            weights.append((name, mx.zeros_like(w)))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(weights), metadata={"format": "mlx"})
    config["eos_token_id"] = tok.eos_token_id
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
