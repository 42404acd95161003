"""Request models (pydantic, strict types) and their validation into `APIError`s.

Fields follow OpenAI's API and mlx_lm.server's extensions (top_k, min_p).
Unknown fields are ignored, as OpenAI clients send many optional ones;
fields we cannot honour (n > 1, echo, non-zero penalties, logit_bias, images)
are refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

import json
from typing import List, Literal, Optional, Union

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError

MAX_STOP = 4  # stop strings per request, as OpenAI


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    seed: Optional[int] = Field(default=None, ge=0, lt=1 << 64)  # MLX's generator takes a uint64
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(default=None, ge=1, le=1)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=1024)  # vLLM's: the prefix-cache domain

    def stops(self) -> list[str]:
        """The stop strings, as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def limit(self) -> Optional[int]:
        """max_completion_tokens if given, else max_tokens (as mlx_lm.server)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """POST /v1/completions. `logprobs` is OpenAI's legacy int (top alternatives, 0..5) or a bool."""

    prompt: Union[str, List[int], List[str]]
    logprobs: Union[bool, int, None] = None
    echo: bool = False
    suffix: Optional[str] = None

    def top_logprobs(self) -> int:
        """Alternatives per token, or -1 for no logprobs at all."""
        if self.logprobs is None or self.logprobs is False:
            return -1
        return 0 if self.logprobs is True else self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Request):
    """POST /v1/chat/completions."""

    messages: List[Message] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    def top_alternatives(self) -> int:
        """Alternatives per token, or -1 for no logprobs at all."""
        return (self.top_logprobs or 0) if self.logprobs else -1


def _param(loc: tuple) -> str:
    # pydantic puts union member names into the location ("prompt", "str"); keep the field path
    parts = [str(p) for p in loc if isinstance(p, int) or p not in _TYPE_NAMES]
    return ".".join(parts) if parts else "body"


_TYPE_NAMES = {"str", "int", "bool", "float", "list[int]", "list[str]", "list[TextPart]", "none",
               "dict", "TextPart", "function-after"}


def parse(raw: bytes, kind: type[_Request]) -> _Request:
    """Decode and validate a request body.

    Raises:
        APIError: 400 naming the field: malformed JSON, not an object, a missing
            or mistyped field, a value out of range, or a feature we cannot honour.
    """
    body = _decode(raw)
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", param="body")
    try:
        req = kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"'{param}' is required", param=param, code="missing_field") from None
        got = err.get("input")
        shown = json.dumps(got)[:60] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
        raise APIError(400, f"'{param}': {err['msg']} (got {shown})", param=param, code="invalid_value") from None
    _refuse_unsupported(req)
    return req


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


def _refuse_unsupported(req: _Request) -> None:
    stops = req.stops()
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise APIError(400, f"'stop' takes up to {MAX_STOP} non-empty strings", param="stop")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"'{name}' is not supported by segcache serve; leave it out or 0", param=name)
    if req.logit_bias:
        raise APIError(400, "'logit_bias' is not supported by segcache serve", param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise APIError(400, "'echo' is not supported by segcache serve", param="echo")
        if req.suffix:
            raise APIError(400, "'suffix' is not supported by segcache serve", param="suffix")
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) and len(req.prompt) != 1:
            raise APIError(400, "'prompt': one prompt per request (a list of strings must hold exactly one)",
                           param="prompt")
        if not req.prompt:
            raise APIError(400, "'prompt' is empty: give at least one token of text", param="prompt")
        lp = req.logprobs
        if isinstance(lp, int) and not isinstance(lp, bool) and not 0 <= lp <= 5:
            raise APIError(400, f"'logprobs' takes 0..5 alternatives, got {lp}", param="logprobs")
