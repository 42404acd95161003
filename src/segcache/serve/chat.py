"""Prompts: token ids of a completion or a chat, and the chat's message boundaries.

A chat is rendered with the tokenizer's chat template (or --chat-template),
with the request's tools and template arguments, exactly as mlx_lm.server
renders it (its `process_message_content`, then `apply_chat_template(messages,
tools=..., add_generation_prompt=True, **chat_template_args)`), so both
servers feed a model the same tokens. A model without a template gets the
plain template of mlx_lm.server (its `convert_chat` with the default role
mapping):

    ASSISTANT's RULE: {system}\\n      one line per message, in order
    USER: {user}\\n
    ASSISTANT: {assistant}\\n
    ASSISTANT:                          the generation prompt (trailing space stripped)

Boundaries are positions in the prompt's ids the prefill checkpoints, so a
later prompt that shares the conversation up to one resumes there even on a
hybrid model (which can resume only where a state was kept):

    [tools][system][user ... assistant ... tool ...][last user ... tool][generation prompt]
           ^ 0     ^ 1                              ^ 2                  ^ 3

0. the end of the tool schemas, where a template renders them before the
   system text (the part of the prompt no system message changes): a new
   conversation with the same tools and another system prompt (a subagent,
   a session whose system text holds a date or a nonce) resumes there, from
   the first turn on; a template that renders the system text first has no
   such boundary (nothing but a role header precedes the system text);
1. the end of the leading system messages (and the tool schemas a template
   puts there): a new conversation with the same system prompt and tools;
2. the start of the last user message: an edit of the last question;
3. the end of the conversation, before the generation prompt: the next turn
   of an agent loop whose template re-renders this turn's answer differently
   from how the model wrote it (earlier reasoning dropped, arguments
   re-serialized) resumes here rather than at an earlier checkpoint.

A boundary is where the prompt's tokens leave the conversation rendered up to
it: the tokens of the prompt's one encode that end within the text the two
renderings share (a fast tokenizer's offsets), else the longest common prefix
of the prompt's ids and the rendering's own; a tokenizer that merges across
the boundary only moves it earlier. Either way a checkpoint there holds the
state of the prompt's own tokens, so the choice decides only what a later
prompt can reuse.
"""

from __future__ import annotations

import bisect
import collections
import importlib
import json
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from mlx_lm import tokenizer_utils

from .errors import APIError
from .output import REASONING, TEXT, TOOL, Markup
from .reencode import Reencoder, common_chars

log = logging.getLogger("segcache.serve")

PLAIN_ROLES = {
    "system": "ASSISTANT's RULE: ",
    "developer": "ASSISTANT's RULE: ",
    "user": "USER: ",
    "assistant": "ASSISTANT: ",
    "tool": "",
}
_SYSTEM = ("system", "developer")
# The shortest tools block worth a checkpoint of its own. A template that renders the system text
# first shares only its role header (a few tokens) with a rendering without it; a tools block
# rendered first is the schemas, hundreds of tokens and more.
MIN_TOOLS_CUT = 64
# Boundary texts whose ids are kept (least recently used out), for a tokenizer without offsets (with
# them a chat is encoded once): the system-and-tools text recurs in every turn of a session and in
# each of its subagents' requests, the conversation before the last question in every turn of an
# agent loop; each costs an encode of the whole prefix otherwise.
BOUNDARY_TEXTS = 32

# apply_chat_template's own arguments: a request may not set them as template variables.
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Prompt:
    """A rendered chat.

    Attributes:
        ids: the prompt's token ids.
        checkpoints: boundary positions to checkpoint (0 < c < len(ids)).
        start: the state the output starts in (output.TEXT, REASONING when
            the prompt ends inside a reasoning block, TOOL when it ends with
            the tool-call marker of a forced call).
    """

    ids: list[int]
    checkpoints: list[int] = field(default_factory=list)
    start: str = TEXT


class Prompter:
    """Turns request prompts into token ids.

    Args:
        tokenizer: the model's mlx-lm `TokenizerWrapper`.
        chat_template: a Jinja chat template overriding the tokenizer's (or None).
        template_args: template variables every chat gets (--chat-template-args);
            a request's `chat_template_kwargs` override them.
    """

    def __init__(self, tokenizer, chat_template: Optional[str] = None, template_args: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_args = dict(template_args or {})
        self.templated = chat_template is not None or bool(getattr(tokenizer, "has_chat_template", False))
        self.markup = markup_for(tokenizer, chat_template)
        self._sources: dict = {}
        self._rendered: collections.OrderedDict[str, list[int]] = collections.OrderedDict()  # boundary text -> ids
        hf = getattr(tokenizer, "_tokenizer", None)  # mlx-lm's wrapper holds the transformers tokenizer
        self._encoder = Reencoder(hf) if getattr(hf, "is_fast", False) else None

    # -- what the model can do -----------------------------------------------------------

    def source(self, tools: bool = False) -> Optional[str]:
        """The Jinja text of the template a chat is rendered with (None: no template, or a
        Python renderer that cannot be read)."""
        if tools in self._sources:
            return self._sources[tools]
        src = self.chat_template
        if src is None and self.templated:
            get = getattr(self.tokenizer, "get_chat_template", None)
            try:
                src = get(None, [{}] if tools else None) if get is not None else None
            except Exception:
                src = None
        self._sources[tools] = src if isinstance(src, str) else None
        return self._sources[tools]

    def reads(self, name: str) -> Optional[bool]:
        """Whether the chat template reads the variable `name` (None: cannot tell)."""
        src = self.source()
        if src is None:
            return None
        import jinja2
        from jinja2 import meta

        try:
            return name in meta.find_undeclared_variables(jinja2.Environment().parse(src))
        except jinja2.TemplateError:
            return None

    def check_tools(self, param: str = "tools") -> None:
        """Refuse tools this model cannot be given: no template, no tool parser, or a
        template that never mentions them."""
        if not self.templated:
            raise APIError(400, f"'{param}': this model has no chat template, so it cannot be given tools; "
                                "leave them out (or serve it with a --chat-template that renders tools)",
                           param=param, code="tools_not_supported")
        if self.markup.tool is None:
            raise APIError(400, f"'{param}': this model's tokenizer has no tool calling (mlx-lm finds no tool "
                                "parser for it), so its calls could not be read; leave the tools out",
                           param=param, code="tools_not_supported")
        src = self.source(tools=True)
        if src is not None and "tools" not in src:
            raise APIError(400, f"'{param}': this model's chat template does not render tools; leave them out",
                           param=param, code="tools_not_supported")

    # -- prompts -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text as mlx_lm.generate encodes a prompt: special tokens unless it starts with BOS."""
        bos = self.tokenizer.bos_token
        return list(self.tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))

    def completion(self, prompt) -> list[int]:
        """Ids of a completions prompt: text, [text] or token ids."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if prompt and isinstance(prompt[0], str):
            return self.encode(prompt[0])
        return list(prompt)

    def knows_developer(self) -> bool:
        """Whether the chat template renders the `developer` role itself (the plain template
        does); where it does not, developer messages are rendered as system messages."""
        if not self.templated:
            return True
        src = self.source()
        return src is not None and "developer" in src

    def chat(self, messages: list[dict], tools: Optional[list] = None, kwargs: Optional[dict] = None,
             force_call: bool = False, param: str = "messages") -> Prompt:
        """Render a chat with the generation prompt, and find its boundaries.

        Args:
            messages: template-ready message dicts (see `template_messages`).
            tools: OpenAI function tools for the template, or None.
            kwargs: template variables of this request (over --chat-template-args).
            force_call: end the prompt with the tool-call start marker, so the
                output begins inside a call (tool_choice "required" or a named function).
            param: the request's field holding the messages, named by its 400s
                ("messages"; Responses' "input").

        Raises:
            APIError: 400 when the template refuses the messages or cannot render tools.
        """
        if tools:
            self.check_tools()
        if not self.templated:
            for i, m in enumerate(messages):
                if m.get("tool_calls"):
                    where = f"{param}.{i}.tool_calls" if param == "messages" else param
                    raise APIError(400, f"'{where}': this model has no chat template, so earlier tool calls "
                                        "cannot be shown to it", param=where)
        if not self.knows_developer() and any(m["role"] == "developer" for m in messages):
            messages = [dict(m, role="system") if m["role"] == "developer" else m for m in messages]
        args = {**self.template_args, **(kwargs or {})}

        def render(dicts: list[dict], generation_prompt: bool) -> str:
            if not self.templated:
                return _plain(dicts, generation_prompt)
            return self._template(dicts, generation_prompt, tools or None, args, param)

        try:
            text = render(messages, True)
        except APIError:
            # a template that takes one system message, first (Qwen's), refusing the system and
            # developer messages an agent sends in a row (Codex CLI) or later on (Claude Code):
            # rendered as the template expects (merge_system_messages) instead of a 400
            merged = merge_system_messages(messages)
            if merged == messages:
                raise
            log.debug("the chat template refused the system messages as sent: the leading ones merged, later "
                      "ones rendered as user messages")
            messages = merged
            text = render(messages, True)
        start = TEXT
        think = self.markup.think
        if think is not None and text.rfind(think[0]) > text.rfind(think[1]):
            start = REASONING
        if force_call:
            if self.markup.tool is None:
                raise APIError(400, "'tool_choice': this model has no tool calling", param="tool_choice")
            if start == REASONING:  # a forced call does not wait for the reasoning to end
                text += think[1]
            text += self.markup.tool[0]
            start = TOOL
        ids, ends = self._ids_and_ends(text)
        cuts = []

        def boundary(before: list[dict]) -> int:
            return self._boundary(render, before, ids, text, ends)

        n_sys = next((i for i, m in enumerate(messages) if m["role"] not in _SYSTEM), len(messages))
        if n_sys < len(messages) and (n_sys or tools):
            cuts.append(boundary(messages[:n_sys] + ([{"role": "user", "content": ""}] if self.templated else [])))
        if tools and n_sys and self.templated:  # a template rendering the tools before the system text
            tools_end = boundary([{"role": "user", "content": ""}])
            cuts.append(tools_end if tools_end >= MIN_TOOLS_CUT else 0)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
        if last_user > n_sys:
            cuts.append(boundary(messages[:last_user]))
        if len(messages) > 1:
            cuts.append(boundary(messages))
        return Prompt(ids, sorted({c for c in cuts if 0 < c < len(ids)}), start)

    def _ids(self, text: str) -> list[int]:
        if self.templated:  # a template writes its own special tokens
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self.encode(text)

    def _ids_and_ends(self, text: str) -> tuple[list[int], Optional[list[int]]]:
        """The prompt's ids (`_ids`'s) and where each token ends in `text`, from one encode where the
        tokenizer tells its offsets (a fast tokenizer, a templated chat); else (ids, None)."""
        if not self.templated or self._encoder is None:
            return self._ids(text), None
        # the very call `encode` makes (encode_plus), with the offsets it computes anyway; a prompt
        # extending a recent one encodes only its new part (reencode.py). Ends None: offsets that
        # do not follow the text, boundaries by encoding.
        return self._encoder.encode(text)

    def _boundary(self, render, before: list[dict], ids: list[int], prompt: str, ends: Optional[list[int]]) -> int:
        try:
            text = render(before, False)
        except Exception:  # a template may refuse a partial conversation: no checkpoint then
            return 0
        if ends is not None:  # the prompt's tokens that end within the text the two renderings share
            return bisect.bisect_right(ends, common_chars(text, prompt))
        known = self._rendered.get(text)
        if known is None:
            known = self._rendered[text] = self._ids(text)
            if len(self._rendered) > BOUNDARY_TEXTS:
                self._rendered.popitem(last=False)
        else:
            self._rendered.move_to_end(text)
        return _common(known, ids)

    def _template(self, dicts: list[dict], generation_prompt: bool, tools, args: dict,
                  param: str = "messages") -> str:
        kwargs = dict(args)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        try:
            return self.tokenizer.apply_chat_template(
                dicts, tools=tools, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
            )
        except Exception as exc:  # a template raising on these messages (jinja's raise_exception)
            if not generation_prompt:
                raise
            raise APIError(400, f"'{param}': the chat template refused them: {exc}", param=param) from None


class _TemplateText:
    """What mlx-lm's tool-parser inference reads of a tokenizer, with another template's text."""

    def __init__(self, tokenizer, chat_template: str):
        self.chat_template = chat_template
        self.get_vocab = tokenizer.get_vocab


def markup_for(tokenizer, chat_template: Optional[str] = None) -> Markup:
    """The tokenizer's markup, its tool parser chosen from the template actually used.

    mlx-lm takes a `tool_parser_type` the tokenizer's config declares, else infers one from the
    template's text (`tokenizer_utils._infer_tool_parser`, then the vocabulary). It inferred it
    from the tokenizer's own template; with --chat-template the same inference runs on that
    template's text, so a template works as it would in tokenizer_config.json. A parser the
    config declared (one the own template does not explain) is kept.
    """
    markup = Markup.of(tokenizer)
    if chat_template is None:
        return markup
    declared = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type")
    try:
        own = tokenizer_utils._infer_tool_parser(tokenizer)
        chosen = tokenizer_utils._infer_tool_parser(_TemplateText(tokenizer, chat_template))
    except Exception:  # a tokenizer mlx-lm's inference cannot read: keep what it has
        return markup
    if chosen is None or chosen == declared or (declared is not None and declared != own):
        return markup
    module = importlib.import_module(f"mlx_lm.tool_parsers.{chosen}")
    return Markup(markup.think, (module.tool_call_start, module.tool_call_end or ""), module.parse_tool_call)


def template_messages(messages: list[dict]) -> list[dict]:
    """Message dicts as mlx_lm.server hands them to a template (its `process_message_content`):
    content parts joined into one string, no content as "", and tool-call arguments
    (JSON text in OpenAI's API) as objects; `reasoning` is also given as `reasoning_content`.

    Raises:
        APIError: 400 naming the arguments that are not a JSON object.
    """
    out = []
    for i, m in enumerate(messages):
        d = dict(m)
        content = d.get("content")
        if isinstance(content, list):
            d["content"] = "".join(p["text"] for p in content)
        elif content is None:
            d["content"] = ""
        if d.get("tool_calls"):
            calls = []
            for j, call in enumerate(d["tool_calls"]):
                fn = dict(call["function"])
                if isinstance(fn.get("arguments"), str) and fn["arguments"]:
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        param = f"messages.{i}.tool_calls.{j}.function.arguments"
                        raise APIError(400, f"'{param}' is not JSON text", param=param) from None
                calls.append({**call, "function": fn})
            d["tool_calls"] = calls
        if "reasoning" in d and "reasoning_content" not in d:
            d["reasoning_content"] = d["reasoning"]
        out.append(d)
    return out


def merge_system_messages(messages: list[dict]) -> list[dict]:
    """The messages as a template taking one system message, first, expects: the system messages
    before any other joined into one (blank-line separated, in order), and those after another
    message given as user messages where they are, so a conversation's rendered prefix stays the
    same when an agent adds system text later on (Claude Code's mid-conversation system
    messages). Template-ready dicts only (`template_messages`: content as text)."""
    lead = next((i for i, m in enumerate(messages) if m["role"] not in _SYSTEM), len(messages))
    out = []
    if lead:
        text = "\n\n".join(m["content"] for m in messages[:lead] if m["content"])
        out.append(dict(messages[0], role="system", content=text))
    out += [dict(m, role="user") if m["role"] in _SYSTEM else m for m in messages[lead:]]
    return out


def _plain(dicts: list[dict], generation_prompt: bool) -> str:
    text = "".join(f"{PLAIN_ROLES.get(m['role'], '')}{m['content']}\n" for m in dicts)
    if generation_prompt:
        return (text + PLAIN_ROLES["assistant"]).rstrip()
    return text
