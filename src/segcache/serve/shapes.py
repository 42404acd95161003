"""OpenAI's completions and chat completions: requests into turns, events into response bodies.

A request of `n` choices gets them all, each with its `index` (streams: each
chunk carries one choice's index, and every choice gets its own chunk with
`finish_reason`), and `usage` counts the prompt once: it was prefilled once.

Chat answers carry the output split by output.py: `content`, `reasoning_content`
(also as `reasoning`, mlx_lm.server's name for it) and `tool_calls`, with
`finish_reason` "tool_calls" when the answer ended (not cut by max_tokens) after
calls. Streams send each piece as it is decided: text and reasoning as deltas,
each tool call whole in one `delta.tool_calls` entry with its index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .chat import template_messages
from .engine import Chunk, Failure, Finish, Progress
from .errors import APIError
from .output import Call, Text
from .pipeline import ChatTurn, failed, segcache_usage, total_usage

if TYPE_CHECKING:
    from .pipeline import Run
    from .schemas import ChatRequest


def sse(obj: dict, event: Optional[str] = None) -> str:
    """One server-sent event carrying `obj` as JSON (named `event` if given)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj)}\n\n"


def keepalive(p: Progress) -> str:
    """An SSE comment while the prompt is prefilled (clients skip comments), as mlx_lm.server's."""
    return f": keepalive {p.processed}/{p.total}\n\n"


def chat_turn(req: "ChatRequest") -> ChatTurn:
    """The pipeline's turn for a chat completions request."""
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.function.name
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)  # gpt-oss templates read it
    return ChatTurn(
        messages=template_messages(req.raw_messages()), tools=req.raw_tools(), tool_choice=choice,
        parallel=req.parallel_tool_calls is not False, template_kwargs=kwargs, max_tokens=req.limit(),
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        stops=req.stops(), top_logprobs=req.top_alternatives(), controls=req.controls(), n=req.n or 1,
        cache_salt=req.cache_salt,
    )


def tool_call(call: Call, streaming: bool) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **out} if streaming else out


@dataclass
class Shape:
    """Response bodies in OpenAI's shapes, for one request."""

    id: str
    model: str
    created: int
    chat: bool

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "segcache"}

    def _logprobs(self, entries, offset: int = 0) -> Optional[dict]:
        if not entries:
            return None
        if self.chat:
            def one(tok, lp):
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
            return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, v) for t, v in e.top])
                                for e in entries]}
        offsets, pos = [], offset
        for e in entries:
            offsets.append(pos)
            pos += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [dict(e.top) for e in entries] if any(e.top for e in entries) else None,
                "text_offset": offsets}

    def chunk(self, text: str, entries, finish: Optional[str], index: int = 0) -> dict:
        """A completions chunk of choice `index`."""
        body = self._head("text_completion")
        body["choices"] = [{"index": index, "finish_reason": finish, "logprobs": self._logprobs(entries), "text": text}]
        return body

    def delta(self, pieces, entries, finish: Optional[str], index: int = 0) -> dict:
        """A chat chunk carrying `pieces` of choice `index`."""
        body = self._head("chat.completion.chunk")
        delta: dict = {}
        if pieces or finish is None:
            delta["role"] = "assistant"
        text = "".join(p.text for p in pieces if isinstance(p, Text) and not p.reasoning)
        reasoning = "".join(p.text for p in pieces if isinstance(p, Text) and p.reasoning)
        calls = [tool_call(p, True) for p in pieces if isinstance(p, Call)]
        if text or (finish is None and not reasoning and not calls):
            delta["content"] = text
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if calls:
            delta["tool_calls"] = calls
        body["choices"] = [{"index": index, "delta": delta, "finish_reason": finish,
                            "logprobs": self._logprobs(entries)}]
        return body

    def usage_chunk(self, usage) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = _usage(usage)
        return body

    def whole(self, choices, usage) -> dict:
        """A completions body: `choices` [(text, logprobs, finish)] by index."""
        body = self._head("text_completion")
        body["choices"] = [{"index": i, "finish_reason": finish.reason, "logprobs": self._logprobs(entries),
                            "text": text} for i, (text, entries, finish) in enumerate(choices)]
        body["usage"] = _usage(usage)
        return body

    def message(self, choices, usage) -> dict:
        """A chat completion body: `choices` [(pieces, logprobs, finish_reason)] by index."""
        body = self._head("chat.completion")
        body["choices"] = []
        for i, (pieces, entries, reason) in enumerate(choices):
            text = "".join(p.text for p in pieces if isinstance(p, Text) and not p.reasoning)
            reasoning = "".join(p.text for p in pieces if isinstance(p, Text) and p.reasoning)
            calls = [tool_call(p, False) for p in pieces if isinstance(p, Call)]
            message: dict = {"role": "assistant", "content": text if text.strip() or not calls else None}
            if reasoning:
                message["reasoning_content"] = message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            body["choices"].append({"index": i, "finish_reason": reason, "logprobs": self._logprobs(entries),
                                    "message": message})
        body["usage"] = _usage(usage)
        return body


def _usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}, "segcache": segcache_usage(u)}


def finish_reason(finish: Finish, calls: int) -> str:
    """OpenAI's finish_reason: "tool_calls" for an answer that ended after calls."""
    return "tool_calls" if calls and finish.reason == "stop" else finish.reason


def error_event(run: "Run") -> str:
    return sse(failed(run.gen.id).body())


class _Space:
    """Holds back an answer's leading whitespace until text follows: a whole answer whose
    text is only whitespace next to tool calls has content null, so a stream must not
    send that whitespace early."""

    def __init__(self):
        self.held = ""
        self.sent = False  # non-whitespace text went out: nothing is held from then on

    def pass_(self, pieces) -> list:
        out = []
        for p in pieces:
            if isinstance(p, Text) and not p.reasoning and not self.sent:
                text = self.held + p.text
                self.sent = bool(text.strip())
                self.held = "" if self.sent else text
                if not self.sent:
                    continue
                p = Text(text)
            out.append(p)
        return out


async def chat_stream(run: "Run", shape: Shape, usage: bool):
    n = run.gen.n
    splits = [run.splitter() for _ in range(n)]
    spaces = [_Space() for _ in range(n)]
    finishes = []
    async for event in run.events_of():
        if isinstance(event, Progress):
            yield keepalive(event)
        elif isinstance(event, Chunk):
            i = event.index
            pieces = spaces[i].pass_(splits[i].feed(event.text))
            if pieces or event.logprobs:
                yield sse(shape.delta(pieces, event.logprobs, None, i))
        elif isinstance(event, Finish):
            i, split, space = event.index, splits[event.index], spaces[event.index]
            pieces = space.pass_(split.close())
            if space.held and not split.calls:
                pieces.append(Text(space.held))
            if pieces:
                yield sse(shape.delta(pieces, [], None, i))
            yield sse(shape.delta([], [], finish_reason(event, split.calls), i))
            finishes.append(event)
            if not event.last:
                continue
            if usage:
                yield sse(shape.usage_chunk(total_usage(finishes)))
            yield "data: [DONE]\n\n"
        elif isinstance(event, Failure):
            yield error_event(run)
            yield "data: [DONE]\n\n"


async def chat_whole(run: "Run", shape: Shape, request) -> dict:
    choices = await run.collect_all(request)
    out = [(pieces, logprobs, finish_reason(finish, sum(isinstance(p, Call) for p in pieces)))
           for pieces, logprobs, finish in choices]
    return shape.message(out, total_usage([c[2] for c in choices]))


async def completion_stream(run: "Run", shape: Shape, usage: bool):
    finishes = []
    async for event in run.events_of():
        if isinstance(event, Progress):
            yield keepalive(event)
        elif isinstance(event, Chunk):
            if event.text or event.logprobs:
                yield sse(shape.chunk(event.text, event.logprobs, None, event.index))
        elif isinstance(event, Finish):
            yield sse(shape.chunk("", [], event.reason, event.index))
            finishes.append(event)
            if not event.last:
                continue
            if usage:
                yield sse(shape.usage_chunk(total_usage(finishes)))
            yield "data: [DONE]\n\n"
        elif isinstance(event, Failure):
            yield error_event(run)
            yield "data: [DONE]\n\n"


async def completion_whole(run: "Run", shape: Shape, request) -> dict:
    n = run.gen.n
    texts: list[list] = [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    finishes: list = [None] * n
    async for event in run.events_of(request):
        if isinstance(event, Chunk):
            texts[event.index].append(event.text)
            logprobs[event.index].extend(event.logprobs)
        elif isinstance(event, Finish):
            finishes[event.index] = event
            if event.last and all(f is not None for f in finishes):
                return shape.whole([("".join(t), lp, f) for t, lp, f in zip(texts, logprobs, finishes)],
                                   total_usage(finishes))
        elif isinstance(event, Failure):
            raise failed(run.gen.id)
    raise failed(run.gen.id)
