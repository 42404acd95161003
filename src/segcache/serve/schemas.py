"""Request models (pydantic, strict types) and their validation into `APIError`s.

Fields follow OpenAI's API and mlx_lm.server's extensions (top_k, min_p).
Unknown fields are ignored, as OpenAI clients send many optional ones;
fields we cannot honour (n > 1, echo, non-zero penalties, logit_bias, images)
are refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

import json
from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError

MAX_STOP = 4  # stop strings per request, as OpenAI


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


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
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(default=None, ge=1, le=1)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    adapters: Optional[str] = None  # mlx_lm.server's adapter path; one adapter per server (Server._check_adapter)

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
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})", param="body", code="invalid_json") from None
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
