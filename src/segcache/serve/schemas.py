"""Request models (pydantic, strict types) and their validation into `APIError`s.

One model per route: OpenAI's completions, chat completions and Responses,
Anthropic's Messages (and its count_tokens). Fields follow those APIs, plus
mlx_lm.server's extensions (top_k, min_p, chat_template_kwargs).

The field policy: every field a request sends is honoured, refused with a 400
naming it, or accepted and ignored, and then listed in docs/serve.md; never
dropped in silence. So a model forbids unknown fields (a typo is a 400 too),
`refused` maps the fields its API defines that the server cannot honour to
why (a 400 when sent with a value other than null), and `ignored` lists
those it takes and ignores (clients send them for OpenAI's or Anthropic's
own services: `user`, `metadata`, `store`, ...).

Coding agents (Claude Code, Codex CLI) also send hints for a hosted service's own
machinery (`context_management`, `client_metadata`) and fields newer than this
server. By default (`parse(..., strict=False)`) a request is served all the same:
`hints` are ignored like `ignored`, fields no model knows are dropped wherever they
are, and each request names what it dropped (`accepted_and_ignored`, logged at debug
level). `--strict-fields` (`strict=True`) refuses both with a 400 naming the field.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Optional, Union

import pydantic_core
from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError, model_validator

from .errors import APIError

log = logging.getLogger("segcache.serve")

MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_N = 16  # choices per request: each is a row (a copy-on-write clone of the prompt) while it decodes

# What a client of OpenAI's or Anthropic's service sends for the service itself:
# identity, billing, retention, routing. Nothing of it changes what a local model
# generates, so it is accepted and ignored (docs/serve.md lists it).
_SERVICE = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                      "prompt_cache_retention", "prompt_cache_options"})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Common(_Strict):
    """Fields every generating route shares."""

    ignored: ClassVar[frozenset] = frozenset()
    refused: ClassVar[dict] = {}
    # a hosted service's hints that change nothing a local model can honour: ignored unless strict,
    # then refused with the reason given
    hints: ClassVar[dict] = {}

    model: Optional[str] = None
    stream: bool = False
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=1024)  # vLLM's: the prefix-cache domain
    # the fields `parse` accepted and ignored, as paths ("metadata", "tools.3.defer_loading")
    _ignored_paths: list = PrivateAttr(default_factory=list)

    def check(self) -> None:
        """Refusals that need more than a field's type (400 naming the field)."""

    @property
    def accepted_and_ignored(self) -> list[str]:
        """The fields of the request that were accepted and ignored, as paths."""
        return list(self._ignored_paths)

    @classmethod
    def lenient(cls, body: dict, note) -> dict:
        """Rewrite a body's parts a local model cannot run into ones it can (not in strict mode).

        Args:
            body: the request body (a dict, not validated yet); not mutated.
            note: called with (path, why) for each part dropped or rewritten.
        """
        return body


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None  # ignored: no obfuscation padding is sent


class _Request(_Common):
    """Fields OpenAI's completions and chat completions share."""

    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    seed: Optional[int] = Field(default=None, ge=0, lt=1 << 64)  # MLX's generator takes a uint64
    stop: Union[str, List[str], None] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(default=None, ge=1, le=MAX_N)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    # mlx_lm.server's extensions
    repetition_penalty: Optional[float] = None
    repetition_context_size: Optional[int] = None
    presence_context_size: Optional[int] = None
    frequency_context_size: Optional[int] = None
    xtc_probability: Optional[float] = None
    xtc_threshold: Optional[float] = None
    response_format: Optional[dict] = None

    # The fields that become `Controls` (their checks and defaults are Controls')
    CONTROLS: ClassVar[tuple] = ("presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty",
                                 "repetition_context_size", "presence_context_size", "frequency_context_size",
                                 "xtc_probability", "xtc_threshold", "response_format")

    def controls(self) -> dict:
        """The sampling controls the request sets beyond temperature/top_p/top_k/min_p/seed."""
        return {k: getattr(self, k) for k in self.CONTROLS if getattr(self, k) is not None}
    adapters: Optional[str] = None  # mlx_lm.server's adapter path; one adapter per server (Server._check_adapter)

    def stops(self) -> list[str]:
        """The stop strings, as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def limit(self) -> Optional[int]:
        """The tokens to generate at most, if the request says."""
        return self.max_tokens

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check(self) -> None:
        stops = self.stops()
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise APIError(400, f"'stop' takes up to {MAX_STOP} non-empty strings", param="stop")


# -- POST /v1/completions --------------------------------------------------------------------


class CompletionRequest(_Request):
    """POST /v1/completions. `logprobs` is OpenAI's legacy int (top alternatives, 0..5) or a bool."""

    ignored: ClassVar[frozenset] = frozenset({"user"})
    refused: ClassVar[dict] = {}

    prompt: Union[str, List[int], List[str]]
    logprobs: Union[bool, int, None] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(default=None, ge=1, le=1)

    def top_logprobs(self) -> int:
        """Alternatives per token, or -1 for no logprobs at all."""
        if self.logprobs is None or self.logprobs is False:
            return -1
        return 0 if self.logprobs is True else self.logprobs

    def check(self) -> None:
        super().check()
        if self.echo:
            raise APIError(400, "'echo' is not supported by segcache serve", param="echo")
        if self.suffix:
            raise APIError(400, "'suffix' is not supported by segcache serve", param="suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise APIError(400, "'prompt': one prompt per request (a list of strings must hold exactly one)",
                           param="prompt")
        if not self.prompt:
            raise APIError(400, "'prompt' is empty: give at least one token of text", param="prompt")
        lp = self.logprobs
        if isinstance(lp, int) and not isinstance(lp, bool) and not 0 <= lp <= 5:
            raise APIError(400, f"'logprobs' takes 0..5 alternatives, got {lp}", param="logprobs")


# -- POST /v1/chat/completions ---------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None  # ignored: arguments are not schema-constrained (docs/serve.md)


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class CallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None  # mlx_lm.server's name for it: rendered as reasoning_content
    refusal: Optional[str] = None  # ignored: echoed back by clients as they got it
    annotations: Optional[list] = None  # ignored: as refusal
    audio: None = None
    function_call: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Request):
    """POST /v1/chat/completions."""

    ignored: ClassVar[frozenset] = _SERVICE | {"verbosity"}
    refused: ClassVar[dict] = {
        "functions": "the legacy functions API is not supported; send 'tools'",
        "function_call": "the legacy functions API is not supported; send 'tool_choice'",
        "audio": "audio output is not supported",
        "prediction": "predicted outputs are not supported",
        "web_search_options": "web search is not available",
        "moderation": "segcache serve runs no moderation",
    }

    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[List[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    modalities: Optional[List[Literal["text"]]] = None
    _raw: dict = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw(cls, data, handler):
        # Templates render tools (and messages) with tojson, whose text follows the
        # keys' order: the client's dicts go to the template, as mlx_lm.server hands them.
        req = handler(data)
        if isinstance(data, dict):
            req._raw = data
        return req

    def limit(self) -> Optional[int]:
        """max_completion_tokens if given, else max_tokens (as mlx_lm.server)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_alternatives(self) -> int:
        """Alternatives per token, or -1 for no logprobs at all."""
        return (self.top_logprobs or 0) if self.logprobs else -1

    def raw_messages(self) -> list[dict]:
        """The messages as the client sent them (validated), without the ignored fields."""
        drop = ("refusal", "annotations", "audio", "function_call")
        return [{k: v for k, v in m.items() if k not in drop} for m in self._raw.get("messages", [])]

    def raw_tools(self) -> Optional[list[dict]]:
        return self._raw.get("tools") or None

    def check(self) -> None:
        super().check()
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise APIError(400, f"'messages.{i}.tool_calls': only assistant messages carry tool calls",
                               param=f"messages.{i}.tool_calls")
            if m.role == "tool" and m.tool_call_id is None:
                raise APIError(400, f"'messages.{i}.tool_call_id' is required in a tool message",
                               param=f"messages.{i}.tool_call_id", code="missing_field")
        check_tool_choice(self.tool_choice if isinstance(self.tool_choice, str) or self.tool_choice is None
                          else self.tool_choice.function.name,
                          [t.function.name for t in self.tools or []], "tool_choice")
        check_template_kwargs(self.chat_template_kwargs)


# -- POST /v1/responses ------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: Optional[list] = None  # ignored
    logprobs: Optional[list] = None  # ignored


class InputMessage(_Strict):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, List[Annotated[Union[InputText, OutputText], Field(discriminator="type")]]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class _ToolOutput(_Strict):
    """What a client's tool returned, for a call of either kind (function or custom)."""

    call_id: str
    output: Union[str, List[InputText]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class FunctionCallOutputItem(_ToolOutput):
    type: Literal["function_call_output"]


class CustomToolCallItem(_Strict):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: Optional[str] = None
    status: Optional[str] = None


class CustomToolCallOutputItem(_ToolOutput):
    type: Literal["custom_tool_call_output"]


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: List[ReasoningText] = []
    content: Optional[List[ReasoningText]] = None
    encrypted_content: Optional[str] = None  # ignored: never produced here
    status: Optional[str] = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


def _item_kind(v) -> Optional[str]:
    return (v.get("type") or "message") if isinstance(v, dict) else None


InputItem = Annotated[
    Union[Annotated[InputMessage, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")],
          Annotated[CustomToolCallItem, Tag("custom_tool_call")],
          Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]],
    Discriminator(_item_kind),
]


class ResponsesTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None  # ignored, as in chat


class CustomTextFormat(_Strict):
    type: Literal["text"]


class CustomGrammarFormat(_Strict):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)


class ResponsesCustomTool(_Strict):
    """A free-form tool (Codex's apply_patch): its call's input is text, following `format`'s
    grammar when it has one (responses.py)."""

    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    format: Optional[Annotated[Union[CustomTextFormat, CustomGrammarFormat], Field(discriminator="type")]] = None

    def grammar(self) -> Optional[dict]:
        """The format as a response_format for the grammar engine (None: plain text)."""
        f = self.format
        if f is None or f.type == "text":
            return None
        return {"type": "grammar", "grammar": {"syntax": f.syntax, "definition": f.definition}}


def _tool_kind(v) -> Optional[str]:
    # the tags are not field names, so the 400's path drops them (_TYPE_NAMES)
    return "custom-tool" if isinstance(v, dict) and v.get("type") == "custom" else "function-tool"


AnyResponsesTool = Annotated[
    Union[Annotated[ResponsesTool, Tag("function-tool")], Annotated[ResponsesCustomTool, Tag("custom-tool")]],
    Discriminator(_tool_kind),
]


class ResponsesToolChoice(_Strict):
    type: Literal["function", "custom"]
    name: str


class ReasoningConfig(_Strict):
    effort: Optional[str] = None
    summary: Optional[str] = None  # ignored: the reasoning is returned whole, not summarized
    generate_summary: Optional[str] = None  # ignored, as summary


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict = Field(alias="schema")
    description: Optional[str] = None  # ignored: the schema constrains the output, the model does not read it
    strict: Optional[bool] = None  # the output always follows the schema (as strict: true)


ResponseTextFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaFormat], Field(discriminator="type")]


class TextConfig(_Strict):
    format: Optional[ResponseTextFormat] = None
    verbosity: Optional[str] = None  # ignored, as chat's


class ResponsesRequest(_Common):
    """POST /v1/responses (stateless: the whole conversation comes in `input`)."""

    ignored: ClassVar[frozenset] = _SERVICE | {"include", "max_tool_calls", "stream_options"}
    refused: ClassVar[dict] = {
        "previous_response_id": "this server keeps no responses (store it client-side): send the whole "
                                "conversation in 'input'; its prefix cache makes resending it cheap",
        "conversation": "this server keeps no conversations: send the whole conversation in 'input'",
        "prompt": "stored prompt templates are not available",
        "top_logprobs": "logprobs are not returned by /v1/responses here; use /v1/chat/completions",
        "image": "image generation is not available",
        "background_options": "responses run in the foreground here",
        "access_programs": "not available",
        "moderation": "segcache serve runs no moderation",
    }
    hints: ClassVar[dict] = {
        "context_management": "the server does not compact conversations (send what the model should read)",
        "client_metadata": "not available",
    }

    input: Union[str, List[InputItem]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    tools: Optional[List[AnyResponsesTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponsesToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning: Optional[ReasoningConfig] = None
    text: Optional[TextConfig] = None
    truncation: Optional[Literal["disabled"]] = None
    background: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    @classmethod
    def lenient(cls, body: dict, note) -> dict:
        """Tools a local model can be given: a `namespace`'s functions (Codex CLI groups its MCP
        servers' tools so) as functions of their own; the hosted tools the server cannot run
        (`local_shell`, `web_search`, `file_search`, `computer_use_preview`, `image_generation`,
        `code_interpreter`, `mcp`, ...) dropped, each with a logged note."""
        def given(i: int, tool: dict, kind) -> list:
            if kind in ("function", "custom"):
                return [tool]
            if kind == "namespace" and isinstance(tool.get("tools"), list):
                inner = [t for t in tool["tools"] if isinstance(t, dict) and t.get("type", "function") == "function"]
                note(f"tools.{i}", f"(namespace '{tool.get('name')}'): its {len(inner)} functions given as tools "
                                   "of their own")
                return [{"type": "function", **{k: v for k, v in t.items() if k != "type"}} for t in inner]
            note(f"tools.{i}", f"(a '{kind}' tool) dropped: the server cannot run it and the model is not told of it")
            return []

        return _tools_given(body, given)

    def response_format(self) -> Optional[dict]:
        """`text.format` as chat's response_format (None: plain text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}

    def check(self) -> None:
        if self.background:
            raise APIError(400, "'background': responses run in the foreground here; leave it out",
                           param="background")
        if isinstance(self.input, list) and not self.input:
            raise APIError(400, "'input' is empty: give at least one item", param="input")
        name = self.tool_choice.name if isinstance(self.tool_choice, ResponsesToolChoice) else self.tool_choice
        check_tool_choice(name, [t.name for t in self.tools or []], "tool_choice")
        check_template_kwargs(self.chat_template_kwargs)


# -- POST /v1/messages (Anthropic) -----------------------------------------------------------


class AText(_Strict):
    type: Literal["text"]
    text: str
    cache_control: Optional[dict] = None  # ignored: every prefix is cached
    citations: Optional[list] = None  # ignored


class AToolUse(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: Optional[dict] = None


class AToolResult(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, List[AText], None] = None
    is_error: Optional[bool] = None
    cache_control: Optional[dict] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class AThinking(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


ABlock = Annotated[Union[AText, AToolUse, AToolResult, AThinking], Field(discriminator="type")]


class AMessage(_Strict):
    # "system": Claude Code's mid-conversation system messages (its beta
    # mid-conversation-system-2026-04-07), text only
    role: Literal["user", "assistant", "system"]
    content: Union[str, List[ABlock]]


class ATool(_Strict):
    name: str = Field(min_length=1)
    input_schema: dict
    description: Optional[str] = None
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[dict] = None  # ignored
    strict: Optional[bool] = None  # ignored


class AToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class AThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None  # ignored: the reasoning is bounded by max_tokens only
    display: Optional[str] = None  # ignored: the reasoning is returned whole


class AJSONFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class AOutputConfig(_Strict):
    effort: Optional[str] = None
    format: Optional[AJSONFormat] = None  # structured output

    def response_format(self) -> Optional[dict]:
        """`format` as chat's response_format (None: plain text)."""
        if self.format is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.format.schema_}}


class _AnthropicBase(_Common):
    ignored: ClassVar[frozenset] = frozenset({"metadata", "service_tier", "cache_control", "inference_geo",
                                              "speed", "user_profile_id", "workspace_id"})
    refused: ClassVar[dict] = {
        "container": "code-execution containers are not available",
        "mcp_servers": "MCP servers are not available; give the tools in 'tools'",
    }
    hints: ClassVar[dict] = {
        "context_management": "the server clears no tool results or thinking (send what the model should read)",
        "diagnostics": "not available",
    }

    messages: List[AMessage] = Field(min_length=1)
    system: Union[str, List[AText], None] = None
    tools: Optional[List[ATool]] = None
    tool_choice: Optional[AToolChoice] = None
    thinking: Optional[AThinkingConfig] = None
    output_config: Optional[AOutputConfig] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    @classmethod
    def lenient(cls, body: dict, note) -> dict:
        """Server tools (`web_search_20250305`, `code_execution_...`, `web_fetch_...`: a `type` other
        than "custom") dropped with a logged note: the server cannot run them."""
        def given(i: int, tool: dict, kind) -> list:
            if kind in (None, "custom"):
                return [tool]
            note(f"tools.{i}", f"(the server tool '{kind}') dropped: the server cannot run it")
            return []

        return _tools_given(body, given)

    def check(self) -> None:
        choice = self.tool_choice
        name = None
        if choice is not None:
            name = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, choice.name)
            if choice.type == "tool" and not choice.name:
                raise APIError(400, "'tool_choice.name' is required with type 'tool'", param="tool_choice.name")
        check_tool_choice(name, [t.name for t in self.tools or []], "tool_choice")
        check_template_kwargs(self.chat_template_kwargs)


class MessagesRequest(_AnthropicBase):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)

    def check(self) -> None:
        super().check()
        stops = self.stop_sequences or []
        if any(not s for s in stops):
            raise APIError(400, "'stop_sequences' holds an empty string", param="stop_sequences")


class CountTokensRequest(_AnthropicBase):
    """POST /v1/messages/count_tokens."""


# -- shared checks -------------------------------------------------------------------------------


def _tools_given(body: dict, given) -> dict:
    """`body` with each of its tools (a dict) replaced by `given(index, tool, its type)`'s list;
    anything else in `tools` is left for validation to refuse."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return body
    out = []
    for i, tool in enumerate(tools):
        out += given(i, tool, tool.get("type")) if isinstance(tool, dict) else [tool]
    return {**body, "tools": out}


def check_tool_choice(choice: Optional[str], names: list[str], param: str) -> None:
    """A named choice must name a given tool; "required" needs tools."""
    if choice in (None, "auto", "none"):
        return
    if not names:
        raise APIError(400, f"'{param}' asks for a tool call, but the request gives no tools", param=param)
    if choice != "required" and choice not in names:
        raise APIError(400, f"'{param}' names '{choice}', which is not among the tools given", param=param)


def check_template_kwargs(kwargs: Optional[dict]) -> None:
    from .chat import RESERVED_KWARGS

    for key in kwargs or {}:
        if key in RESERVED_KWARGS:
            raise APIError(400, f"'chat_template_kwargs.{key}' is an argument of the template call itself, "
                                "not a template variable", param=f"chat_template_kwargs.{key}")


# -- parsing ---------------------------------------------------------------------------------------


def _param(loc: tuple) -> str:
    # pydantic puts union member names ("str", "list[TextPart]") and tagged-union tags
    # ("tool_use") into the location; keep the field path only
    parts, tag_next = [], False
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
            continue
        if "[" in p or p in _TYPE_NAMES or p in _FORMAT_TAGS:
            tag_next = tag_next or "tagged-union" in p
            continue
        if tag_next:
            tag_next = False
            continue
        parts.append(p)
    return ".".join(parts) if parts else "body"


# the tags of text.format's and a custom tool's format unions (an Optional union's location has
# no type name to mark them)
_FORMAT_TAGS = {"json_schema", "json_object", "grammar"}
_TYPE_NAMES = {"str", "int", "bool", "float", "none", "dict", "TextPart", "NamedToolChoice", "ResponsesToolChoice",
               "InputText", "OutputText", "function-tool", "custom-tool"}


def _check_fields(body: dict, kind: type[_Common], strict: bool, dropped: list) -> dict:
    """Refuse the fields `kind` refuses (and in strict mode its hints); drop the ones it ignores."""
    refused = {**kind.refused, **kind.hints} if strict else kind.refused
    for name, why in refused.items():
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is not supported by segcache serve: {why}", param=name,
                           code="unsupported_field")
    drop = kind.ignored | kind.hints.keys()
    dropped.extend(k for k in body if k in drop and body[k] is not None)
    return {k: v for k, v in body.items() if k not in drop and k not in kind.refused}


_MAX_DROPS = 8  # validation passes that drop unknown fields; a body past that is refused as it stands


def parse(raw: bytes, kind: type[_Common], *, strict: bool = False) -> _Common:
    """Decode and validate a request body.

    Args:
        raw: the body's bytes.
        kind: the route's request model.
        strict: refuse unknown fields and `kind.hints` (--strict-fields) instead of
            ignoring them.

    Raises:
        APIError: 400 naming the field: malformed JSON, not an object, a missing,
            mistyped (or in strict mode unknown) field, a value out of range, or a
            feature we cannot honour.
    """
    body = _decode(raw)
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", param="body")
    dropped: list[str] = []
    body = _check_fields(body, kind, strict, dropped)
    if not strict:
        def note(path: str, why: str) -> None:
            dropped.append(path)
            log.info("%s: '%s' %s", kind.__name__, path, why)

        body = kind.lenient(body, note)
    for attempt in range(_MAX_DROPS + 1):
        try:
            req = kind.model_validate(body)
            break
        except ValidationError as exc:
            errors = exc.errors()
            unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
            body = None if strict or attempt == _MAX_DROPS else _without(body, unknown, dropped)
            if body is None:
                _refuse(errors)
    req._ignored_paths = dropped
    if dropped:
        log.debug("%s: accepted and ignored %s", kind.__name__, ", ".join(dropped))
        _warn_unknown(kind, dropped)
    req.check()
    return req


_warned: set = set()  # (route, field) pairs already named at warning level by this process


def _warn_unknown(kind: type[_Common], dropped: list[str]) -> None:
    """Name at warning level, once per process, a top-level field the docs do not list (a typo, or
    a client's newer field): the operator sees what the server ignores without --strict-fields."""
    known = kind.ignored | kind.hints.keys()
    for path in dropped:
        name = path.split(".")[0]
        if name not in known and "." not in path and (kind.__name__, name) not in _warned:
            _warned.add((kind.__name__, name))
            log.warning("%s: '%s' is not a field segcache serve knows: ignored (--strict-fields refuses it)",
                        kind.__name__, name)


def _without(body, locations: list[tuple], dropped: list) -> Optional[dict]:
    """`body` less the unknown fields at `locations` (pydantic's error locations, which also hold
    union members' names and tags: steps that are no key or index of the value are passed over);
    None when there is none to drop (validating again would fail the same way)."""
    body = json.loads(json.dumps(body))  # a copy to change; the caller's body stays as sent
    removed = False
    for loc in locations:
        value, path = body, []
        for step in loc[:-1]:
            if isinstance(value, dict) and isinstance(step, str) and step in value:
                value = value[step]
            elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
                value = value[step]
            else:
                continue
            path.append(str(step))
        key = loc[-1]
        if isinstance(value, dict) and key in value:
            del value[key]
            dropped.append(".".join(path + [str(key)]))
            removed = True
    return body if removed else None


def _refuse(errors: list[dict]) -> None:
    """Raise the 400 for a body that failed validation: its deepest error."""
    # the deepest error: a union reports a mismatch for each of its members first
    err = max(errors, key=lambda e: (len(_param(e["loc"]).split(".")), e["type"] != "missing"))
    param = _param(err["loc"])
    if err["type"] == "missing":
        raise APIError(400, f"'{param}' is required", param=param, code="missing_field") from None
    if err["type"] == "extra_forbidden":
        raise APIError(400, f"'{param}' is not a field segcache serve knows (--strict-fields refuses what it "
                            "would otherwise ignore; docs/serve.md lists the fields)", param=param,
                       code="unknown_field") from None
    got = err.get("input")
    shown = json.dumps(got)[:60] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
    raise APIError(400, f"'{param}': {err['msg']} (got {shown})", param=param, code="invalid_value") from None


def _decode(raw: bytes):
    # pydantic-core's parser, not json.loads: it refuses what no field can hold (lone
    # surrogates, which no tokenizer encodes; NaN and Infinity; invalid UTF-8) and bounds
    # the nesting, where json.loads recurses until Python's stack limit.
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        reason = str(exc)
    if any(w in reason for w in ("surrogate", "escape", "unicode")):
        param = _lone_surrogate(raw)
        if param is not None:
            raise APIError(400, f"'{param}' holds a lone UTF-16 surrogate (such as \\ud800), which is not a "
                                "character: send valid Unicode text", param=param, code="invalid_value")
    if "recursion limit" in reason:
        raise APIError(400, f"the request body nests arrays or objects too deeply ({reason})", param="body",
                       code="invalid_json")
    raise APIError(400, f"the request body is not valid JSON ({reason})", param="body", code="invalid_json")


def _lone_surrogate(raw: bytes) -> Optional[str]:
    """The path of the value holding a lone surrogate (up to 6 levels down), or None if there is none."""
    try:
        value = json.loads(raw.decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError):
        return None

    def bad(v) -> bool:
        try:
            json.dumps(v, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return True
        except (ValueError, RecursionError):
            return False
        return False

    if not bad(value):
        return None
    path: list = []
    for _ in range(6):
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        inner = next(((k, v) for k, v in items if bad(v)), None)
        if inner is None:  # a key, or a string at this level
            break
        path.append(inner[0])
        value = inner[1]
    return ".".join(str(p) for p in path) or "body"

