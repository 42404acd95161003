"""Anthropic's Messages API: POST /v1/messages (whole and streamed) and /v1/messages/count_tokens.

A request becomes the pipeline's `ChatTurn` (the same rendering as a chat
completion), its output pieces become content blocks:

    system, messages            -> system / user / assistant / tool messages for the template
      (a first system block holding Claude Code's billing header is left out, see system_blocks)
      text                      -> content
      tool_use (assistant)      -> tool_calls (input as the arguments object)
      tool_result (user)        -> a tool message (tool_call_id, is_error kept for the template)
      thinking (assistant)      -> reasoning_content
    tools                       -> OpenAI function tools (input_schema as parameters)
    tool_choice auto/any/tool/none, disable_parallel_tool_use -> auto/required/name/none, one call
    thinking enabled/adaptive/disabled -> the template's enable_thinking true/true/false
    output_config.format (json_schema) -> chat's response_format: the output follows the schema

    reasoning -> a thinking block, text -> a text block, a call -> a tool_use block
    stop_reason: max_tokens (cut), tool_use (calls made), stop_sequence (one of the
    request's), else end_turn; usage: input_tokens are the prompt tokens computed,
    cache_read_input_tokens those the prefix cache resumed.

Errors are Anthropic's body, {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse, Response

from . import access, schemas
from .engine import Chunk, Failure, Finish, Progress
from .errors import APIError
from .output import Call, Text, new_call_id
from .pipeline import ChatTurn, ClientGone, Run, failed, segcache_usage
from .service import ChatService
from .shapes import sse


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: APIError) -> dict:
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> Response:
    """Anthropic's error body, with the request's id as Anthropic's API gives it (`request_id`,
    the `request-id` header's value)."""
    body = error_body(exc)
    acc = access.current()
    if acc is not None:
        body["request_id"] = acc.id or acc.name("req")
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _new_tool_id() -> str:
    return new_call_id("toolu_")


# response_format's parts (as Controls' errors name them) under their names here
FORMAT_PARAMS = {"response_format": "output_config.format", "response_format.json_schema": "output_config.format",
                 "response_format.json_schema.schema": "output_config.format.schema"}


# Claude Code's first system block: its version and a nonce that changes every request
# ("x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=<nonce>;"). It tells a
# local model nothing, and rendered first it would end every prompt's shared prefix there.
VOLATILE_PREFIX = "x-anthropic-billing-header:"


def system_blocks(system, keep_volatile: bool = False) -> list:
    """The system text blocks rendered: all of them, but the first when it is Claude Code's
    billing header (unless `keep_volatile`, --keep-volatile-system)."""
    if system is None or isinstance(system, str):
        return [] if not system else [system]
    texts = [b.text for b in system]
    if texts and not keep_volatile and texts[0].lstrip().startswith(VOLATILE_PREFIX):
        texts = texts[1:]
    return texts


def turn(req, keep_volatile: bool = False) -> ChatTurn:
    """The pipeline's turn for a Messages (or count_tokens) request (`keep_volatile`: render
    Claude Code's billing header block too, see `system_blocks`)."""
    messages = []
    text = "".join(system_blocks(req.system, keep_volatile))
    if text:
        messages.append({"role": "system", "content": text})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages.extend(_user(i, m.content))
        elif m.role == "system":
            messages.append(_system(i, m.content))
        else:
            messages.append(_assistant(i, m.content))
    tools = None
    if req.tools:
        tools = []
        for t in req.tools:
            fn = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            fn["parameters"] = t.input_schema
            tools.append({"type": "function", "function": fn})
    choice, parallel = None, True
    if req.tool_choice is not None:
        c = req.tool_choice
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(c.type, c.name)
        parallel = not c.disable_parallel_tool_use
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        kwargs.setdefault("enable_thinking", req.thinking.type != "disabled")
    if req.output_config is not None and req.output_config.effort is not None:
        kwargs.setdefault("reasoning_effort", req.output_config.effort)
    extra = {}
    fmt = req.output_config.response_format() if req.output_config is not None else None
    if fmt is not None:
        extra.update(controls={"response_format": fmt}, params=FORMAT_PARAMS)
    if isinstance(req, schemas.MessagesRequest):
        extra.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                     stops=list(req.stop_sequences or []))
    return ChatTurn(messages=messages, tools=tools, tool_choice=choice, parallel=parallel, template_kwargs=kwargs,
                    cache_salt=req.cache_salt, **extra)


def _user(i: int, blocks) -> list[dict]:
    out, texts = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, schemas.AText):
            texts.append(b.text)
        elif isinstance(b, schemas.AToolResult):
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            msg = {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            if b.is_error:
                msg["is_error"] = True
            out.append(msg)
        else:
            raise APIError(400, f"'messages.{i}.content.{j}': a user message cannot hold a {b.type} block",
                           param=f"messages.{i}.content.{j}")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _system(i: int, blocks) -> dict:
    for j, b in enumerate(blocks):
        if not isinstance(b, schemas.AText):
            raise APIError(400, f"'messages.{i}.content.{j}': a system message holds text blocks only, not "
                                f"a {b.type} block", param=f"messages.{i}.content.{j}")
    return {"role": "system", "content": "".join(b.text for b in blocks)}


def _assistant(i: int, blocks) -> dict:
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        if isinstance(b, schemas.AText):
            texts.append(b.text)
        elif isinstance(b, schemas.AThinking):
            thoughts.append(b.thinking)
        elif isinstance(b, schemas.AToolUse):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        else:
            raise APIError(400, f"'messages.{i}.content.{j}': an assistant message cannot hold a {b.type} block",
                           param=f"messages.{i}.content.{j}")
    msg = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _usage(u) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0,
            "segcache": segcache_usage(u)}


def _stop(run: "Run", finish: Finish, calls: int) -> tuple[str, object]:
    if finish.reason == "length":  # the cap of a max_tokens beyond the context, or max_tokens itself
        return ("model_context_window_exceeded" if run.capped else "max_tokens"), None
    if calls:
        return "tool_use", None
    stop = run.user_stop(finish)
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def _block(piece) -> dict:
    if isinstance(piece, Call):
        return {"type": "tool_use", "id": piece.id, "name": piece.name, "input": json.loads(piece.arguments)}
    if piece.reasoning:
        return {"type": "thinking", "thinking": piece.text, "signature": ""}
    return {"type": "text", "text": piece.text}


def content_blocks(pieces) -> list[dict]:
    """Content blocks of a whole answer (whitespace-only text between other blocks dropped)."""
    blocks = []
    for p in pieces:
        if isinstance(p, Text) and blocks and blocks[-1]["type"] == ("thinking" if p.reasoning else "text"):
            blocks[-1]["thinking" if p.reasoning else "text"] += p.text
        else:
            blocks.append(_block(p))
    return [b for b in blocks if b["type"] != "text" or b["text"].strip()]


def _message(mid: str, model: str, content: list, stop_reason, stop_sequence, usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


async def messages(server: ChatService, request, raw: bytes, key) -> Response:
    req = schemas.parse(raw, schemas.MessagesRequest, strict=server.strict_fields)
    server.check_model(req.model)
    run = await server.start_chat(turn(req, server.keep_volatile_system), "msg", key)
    mid = run.gen.id  # the request's id: its access line and request-id header say the same
    model = server.served_name
    if req.stream:
        return server.stream(_stream(run, mid, model), run)
    try:
        pieces, _, finish = await run.collect(request, _new_tool_id)
    except ClientGone:
        return Response(status_code=499)
    calls = sum(isinstance(p, Call) for p in pieces)
    reason, seq = _stop(run, finish, calls)
    return JSONResponse(_message(mid, model, content_blocks(pieces), reason, seq, _usage(finish.usage)))


async def count_tokens(server: ChatService, request, raw: bytes) -> Response:
    req = schemas.parse(raw, schemas.CountTokensRequest, strict=server.strict_fields)
    server.check_model(req.model)
    prompt = await server.render(turn(req, server.keep_volatile_system))
    return JSONResponse({"input_tokens": len(prompt.ids)})


class _Blocks:
    """Opens, feeds and closes content blocks of a streamed message, in order."""

    def __init__(self):
        self.index = -1
        self.open = None  # "text" or "thinking" while one is open
        self.pending = ""  # whitespace-only text, sent only if more text follows in its block

    def feed(self, pieces) -> list[str]:
        out = []
        for p in pieces:
            if isinstance(p, Call):
                self.pending = ""
                out += self._close()
                self.index += 1
                start = {"type": "tool_use", "id": p.id, "name": p.name, "input": {}}
                out.append(sse({"type": "content_block_start", "index": self.index, "content_block": start},
                               "content_block_start"))
                delta = {"type": "input_json_delta", "partial_json": p.arguments}
                out.append(sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                               "content_block_delta"))
                out.append(sse({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
                continue
            kind = "thinking" if p.reasoning else "text"
            text = p.text
            if kind == "text" and self.open != "text":
                text = self.pending + text
                if not text.strip():  # whitespace between blocks: wait for more
                    self.pending = text
                    continue
                self.pending = ""
            if self.open != kind:
                out += self._close()
                self.index += 1
                self.open = kind
                start = {"type": "thinking", "thinking": "", "signature": ""} if p.reasoning else \
                    {"type": "text", "text": ""}
                out.append(sse({"type": "content_block_start", "index": self.index, "content_block": start},
                               "content_block_start"))
            delta = {"type": "thinking_delta", "thinking": text} if p.reasoning else {"type": "text_delta", "text": text}
            out.append(sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                           "content_block_delta"))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def close(self) -> list[str]:
        return self._close()


async def _stream(run: "Run", mid: str, model: str):
    """The message's events. message_start waits for the engine's first event: once the prompt
    resumed (its first Progress) the split of input and cache-read tokens is known, and
    message_start carries the split message_delta ends with; each later Progress is a ping."""
    split = run.splitter(_new_tool_id)
    blocks = _Blocks()
    started = False
    async for event in run.events_of():
        if not started:
            started = True
            cached = event.processed if isinstance(event, Progress) else 0
            start = {"input_tokens": len(run.gen.ids) - cached, "output_tokens": 0,
                     "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
            yield sse({"type": "message_start", "message": _message(mid, model, [], None, None, start)},
                      "message_start")
            yield sse({"type": "ping"}, "ping")
            if isinstance(event, Progress):
                continue
        if isinstance(event, Progress):
            yield sse({"type": "ping"}, "ping")
        elif isinstance(event, Chunk):
            for line in blocks.feed(split.feed(event.text)):
                yield line
        elif isinstance(event, Finish):
            for line in blocks.feed(split.close()) + blocks.close():
                yield line
            reason, seq = _stop(run, event, split.calls)
            yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                       "usage": _usage(event.usage)}, "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
        elif isinstance(event, Failure):
            yield sse(error_body(failed(run.gen.id)), "error")
