"""OpenAI's Responses API, stateless: POST /v1/responses (whole and streamed).

The whole conversation comes in `input` every time (the prefix cache makes
resending it cheap), so `previous_response_id` and `conversation` are refused
with a 400 and no response is stored. A request becomes the pipeline's
`ChatTurn`:

    instructions                 -> a system message first
    input: a string              -> one user message
    input items: message         -> a message of its role (input_text / output_text parts joined)
                 reasoning       -> reasoning_content of the assistant message that follows
                 function_call   -> a tool call of the assistant message (consecutive calls: one message)
                 function_call_output -> a tool message
                 custom_tool_call(_output) -> as function_call(_output), the input as {"input": ...}
    tools (function; custom: a function of one string argument, `input`), tool_choice,
    parallel_tool_calls, max_output_tokens,
    temperature, top_p, reasoning.effort (the template's reasoning_effort),
    text.format json_object / json_schema (chat's response_format)

and its output pieces become output items in order: reasoning (reasoning_text
content), message (output_text), function_call, custom_tool_call (a custom tool's call; a
grammar custom tool forced by tool_choice is generated under its grammar, and an unforced
call whose input breaks the grammar comes back as text). Streams send
response.created, response.in_progress, then per item output_item.added,
its deltas (response.reasoning_text.delta, response.output_text.delta,
response.function_call_arguments.delta) and .done events, output_item.done,
and response.completed (response.incomplete when max_output_tokens cut it).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Optional

from starlette.responses import JSONResponse, Response

from ..controls import Controls
from ..errors import GrammarError
from . import schemas
from .chat import template_messages
from .engine import Chunk, Failure, Finish
from .errors import APIError
from .output import Call, Text, new_call_id
from .pipeline import ChatTurn, ClientGone, Run, failed, segcache_usage
from .service import ChatService
from .shapes import sse



log = logging.getLogger("segcache.serve")


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


# response_format's parts (as Controls' errors name them) under their names here
FORMAT_PARAMS = {"response_format": "text.format", "response_format.json_schema": "text.format",
                 "response_format.json_schema.schema": "text.format.schema"}


def custom_tools(req: schemas.ResponsesRequest) -> dict:
    """The request's custom tools by name."""
    return {t.name: t for t in req.tools or [] if isinstance(t, schemas.ResponsesCustomTool)}


def forced_grammar(req: schemas.ResponsesRequest) -> Optional[tuple[int, schemas.ResponsesCustomTool]]:
    """(index in tools, tool) when the answer must be a call of a custom tool with a grammar:
    tool_choice names it, or is "required" with it the only tool. Its input is then generated
    under the grammar itself (the output is the input, no call markup around it)."""
    choice = req.tool_choice
    name = choice.name if isinstance(choice, schemas.ResponsesToolChoice) else None
    tools = list(req.tools or [])
    if choice == "required" and len(tools) == 1:
        name = tools[0].name
    for i, t in enumerate(tools):
        if t.name == name and isinstance(t, schemas.ResponsesCustomTool) and t.grammar() is not None:
            return i, t
    return None


def _custom_function(t: schemas.ResponsesCustomTool) -> dict:
    """A custom tool as the template's function tool: one string argument, `input`."""
    about = "the tool's input, free-form text"
    if t.format is not None and t.format.type == "grammar":
        about += f" following this {t.format.syntax} grammar:\n{t.format.definition}"
    fn = {"name": t.name, "parameters": {"type": "object", "properties": {"input": {"type": "string",
                                                                                    "description": about}},
                                         "required": ["input"]}}
    if t.description is not None:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def turn(req: schemas.ResponsesRequest) -> ChatTurn:
    """The pipeline's turn for a Responses request."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [schemas.InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    reasoning: list[str] = []
    open_call = False  # the last message is an assistant message that function_call items join
    for i, item in enumerate(items):
        if isinstance(item, schemas.ReasoningItem):
            reasoning.append(item.text())
            continue
        if isinstance(item, (schemas.FunctionCallItem, schemas.CustomToolCallItem)):
            if isinstance(item, schemas.CustomToolCallItem):
                args = {"input": item.input}
            else:
                try:
                    args = json.loads(item.arguments) if item.arguments else {}
                except json.JSONDecodeError:
                    raise APIError(400, f"'input.{i}.arguments' is not JSON text",
                                   param=f"input.{i}.arguments") from None
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}}
            if not open_call:
                messages.append({"role": "assistant", "content": ""})
                open_call = True
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, (schemas.FunctionCallOutputItem, schemas.CustomToolCallOutputItem)):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            open_call = False
        else:
            messages.append({"role": item.role, "content": item.text()})
            open_call = item.role == "assistant"
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
    tools = None
    if req.tools:
        tools = []
        for t in req.tools:
            if isinstance(t, schemas.ResponsesCustomTool):
                tools.append(_custom_function(t))
                continue
            fn = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            if t.parameters is not None:
                fn["parameters"] = t.parameters
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice.name if isinstance(req.tool_choice, schemas.ResponsesToolChoice) else req.tool_choice
    kwargs = dict(req.chat_template_kwargs or {})
    fmt = req.response_format()
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)
    params = FORMAT_PARAMS
    forced = forced_grammar(req)
    if forced is not None:  # the output is the call's input, under its grammar; no call markup to parse
        i, tool = forced
        if fmt is not None:
            raise APIError(400, f"'text.format' and the grammar of the custom tool '{tool.name}' that tool_choice "
                                "forces cannot both constrain the output; leave one out", param="text.format")
        fmt, choice = tool.grammar(), "none"
        params = {"response_format": f"tools.{i}.format", "response_format.grammar": f"tools.{i}.format.definition"}
    return ChatTurn(messages=template_messages(messages), tools=tools, tool_choice=choice,
                    parallel=req.parallel_tool_calls is not False, template_kwargs=kwargs,
                    max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p, param="input",
                    controls={"response_format": fmt} if fmt is not None else {}, params=params,
                    cache_salt=req.cache_salt)


class _Response:
    """The response object of one request, as it grows."""

    def __init__(self, server: ChatService, req: schemas.ResponsesRequest, rid: str):
        self.id = rid  # the request's id: its access line and request-id header say the same
        self.custom = custom_tools(req)
        self.valid: dict = {}  # custom tool name -> its input's check (a grammar), filled by create()
        self.created = int(time.time())
        self.req = req
        self.model = server.served_name
        self.output: list[dict] = []

    def body(self, status: str, usage=None, incomplete: Optional[str] = None) -> dict:
        r = self.req
        choice = r.tool_choice
        if isinstance(choice, schemas.ResponsesToolChoice):
            choice = {"type": choice.type, "name": choice.name}
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": self.output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "store": False, "temperature": r.temperature, "text": {"format": _format(r)},
            "tool_choice": choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_p": r.top_p, "truncation": "disabled", "usage": None, "metadata": {},
        }
        if usage is not None:
            body["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "segcache": segcache_usage(usage),
            }
        return body


def _format(req: schemas.ResponsesRequest) -> dict:
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


def custom_input(call: Call) -> str:
    """A custom tool call's input: the `input` string of its arguments (else the arguments' text)."""
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments
    if isinstance(args, dict) and isinstance(args.get("input"), str) and len(args) == 1:
        return args["input"]
    return call.arguments


def _item(piece, status: str = "completed", custom=()) -> dict:
    if isinstance(piece, Call) and piece.name in custom:
        return {"type": "custom_tool_call", "id": _id("ctc_"), "call_id": piece.id, "name": piece.name,
                "input": custom_input(piece), "status": status}
    if isinstance(piece, Call):
        return {"type": "function_call", "id": _id("fc_"), "call_id": piece.id, "name": piece.name,
                "arguments": piece.arguments, "status": status}
    if piece.reasoning:
        return {"type": "reasoning", "id": _id("rs_"), "summary": [],
                "content": [{"type": "reasoning_text", "text": piece.text}], "status": status}
    return {"type": "message", "id": _id("msg_"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": piece.text, "annotations": [], "logprobs": []}]}


def output_items(pieces, custom=()) -> list[dict]:
    """Output items of a whole answer (whitespace-only messages between other items dropped;
    `custom`: the names of custom tools, whose calls are custom_tool_call items)."""
    items: list[dict] = []
    for p in pieces:
        last = items[-1] if items else None
        if isinstance(p, Text) and last is not None and last["type"] == ("reasoning" if p.reasoning else "message"):
            last["content"][0]["text"] += p.text
        else:
            items.append(_item(p, custom=custom))
    return [it for it in items if it["type"] != "message" or it["content"][0]["text"].strip()]


class _GrammarCheck:
    """Whether a custom tool's input follows its grammar (llguidance, over the input's tokens)."""

    def __init__(self, grammars, fmt: dict, tokenizer):
        self.grammars, self.fmt, self.tokenizer = grammars, fmt, tokenizer

    def __call__(self, text: str) -> bool:
        g = self.grammars.compile(self.fmt)
        try:
            g.advance(self.tokenizer.encode(text, add_special_tokens=False))
        except GrammarError:
            return False
        return g.accepting


async def _grammar_checks(server: ChatService, req: schemas.ResponsesRequest) -> dict:
    """Each custom tool with a grammar: its grammar compiled now (a 400 naming its definition if it
    cannot be), and the check its calls' inputs pass."""
    checks = {}
    for i, t in enumerate(req.tools or []):
        fmt = t.grammar() if isinstance(t, schemas.ResponsesCustomTool) else None
        if fmt is None:
            continue
        params = {"response_format": f"tools.{i}.format", "response_format.grammar": f"tools.{i}.format.definition"}
        await server.check_format(Controls(response_format=fmt), params)
        checks[t.name] = _GrammarCheck(server.grammars(), fmt, server.tokenizer)
    return checks


def _forced_pieces(pieces, tool: schemas.ResponsesCustomTool) -> list:
    """A forced grammar call's output (all of it the input) as the one Call it is."""
    text = "".join(p.text for p in pieces if isinstance(p, Text))
    return [Call(0, new_call_id(), tool.name, json.dumps({"input": text}))]


def checked(pieces, checks: dict) -> list:
    """Calls of grammar custom tools whose input breaks the grammar come back as text (as markup
    the parser cannot read does), so no call the client gets breaks its tool's grammar."""
    out = []
    for p in pieces:
        if isinstance(p, Call) and p.name in checks and not checks[p.name](custom_input(p)):
            log.warning("a call of the custom tool '%s' does not follow its grammar; returned as text", p.name)
            out.append(Text(custom_input(p)))
        else:
            out.append(p)
    return out


async def create(server: ChatService, request, raw: bytes, key) -> Response:
    req = schemas.parse(raw, schemas.ResponsesRequest, strict=server.strict_fields)
    server.check_model(req.model)
    checks = await _grammar_checks(server, req)
    forced = forced_grammar(req)
    run = await server.start_chat(turn(req), "resp", key)
    resp = _Response(server, req, run.gen.id)
    resp.valid = checks
    if req.stream:
        return server.stream(_stream(run, resp, forced[1] if forced else None), run)
    try:
        pieces, _, finish = await run.collect(request)
    except ClientGone:
        return Response(status_code=499)
    if forced is not None:
        pieces = _forced_pieces(pieces, forced[1])
    resp.output = output_items(checked(pieces, checks), resp.custom)
    cut = finish.reason == "length"
    return JSONResponse(resp.body("incomplete" if cut else "completed", finish.usage,
                                  "max_output_tokens" if cut else None))


class _Events:
    """Numbered events of one streamed response, and the item being streamed."""

    def __init__(self, resp: _Response):
        self.resp = resp
        self.seq = 0
        self.item: Optional[dict] = None  # the open reasoning or message item
        self.pending = ""  # whitespace-only text, sent only if more text follows

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body, kind)

    def feed(self, pieces) -> list[str]:
        out = []
        for p in checked(pieces, self.resp.valid):
            if isinstance(p, Call) and p.name in self.resp.custom:
                self.pending = ""
                out += self._close()
                item = _item(p, "in_progress", self.resp.custom)
                index = len(self.resp.output)
                self.resp.output.append(item)
                out.append(self.event("response.output_item.added", output_index=index, item=dict(item, input="")))
                out.append(self.event("response.custom_tool_call_input.delta", item_id=item["id"],
                                      output_index=index, delta=item["input"]))
                out.append(self.event("response.custom_tool_call_input.done", item_id=item["id"],
                                      output_index=index, input=item["input"]))
                item["status"] = "completed"
                out.append(self.event("response.output_item.done", output_index=index, item=item))
                continue
            if isinstance(p, Call):
                self.pending = ""
                out += self._close()
                item = _item(p, "in_progress")
                index = len(self.resp.output)
                self.resp.output.append(item)
                out.append(self.event("response.output_item.added", output_index=index,
                                      item=dict(item, arguments="")))
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=p.arguments))
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=p.arguments, name=p.name))
                item["status"] = "completed"
                out.append(self.event("response.output_item.done", output_index=index, item=item))
                continue
            kind = "reasoning" if p.reasoning else "message"
            text = p.text
            open_kind = self.item["type"] if self.item else None
            if kind == "message" and open_kind != "message":
                text = self.pending + text
                if not text.strip():
                    self.pending = text
                    continue
                self.pending = ""
            if open_kind != kind:
                out += self._close()
                out += self._open(p)
            index = len(self.resp.output) - 1
            part = self.item["content"][0]
            part["text"] += text
            if p.reasoning:
                out.append(self.event("response.reasoning_text.delta", item_id=self.item["id"], output_index=index,
                                      content_index=0, delta=text))
            else:
                out.append(self.event("response.output_text.delta", item_id=self.item["id"], output_index=index,
                                      content_index=0, delta=text, logprobs=[]))
        return out

    def _open(self, piece: Text) -> list[str]:
        item = _item(Text("", piece.reasoning), "in_progress")
        index = len(self.resp.output)
        self.resp.output.append(item)
        self.item = item
        empty = dict(item, content=[])
        out = [self.event("response.output_item.added", output_index=index, item=empty)]
        if not piece.reasoning:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(item["content"][0])))
        return out

    def _close(self) -> list[str]:
        item, self.item = self.item, None
        if item is None:
            return []
        index = self.resp.output.index(item)
        part = item["content"][0]
        if item["type"] == "reasoning":
            out = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"])]
        else:
            out = [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=part["text"], logprobs=[]),
                   self.event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=part)]
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def close(self) -> list[str]:
        return self._close()


async def _stream(run: "Run", resp: _Response, forced: Optional[schemas.ResponsesCustomTool] = None):
    """The response's events (`forced`: the custom tool whose grammar the whole output follows:
    its one call goes out whole at the end)."""
    split = run.splitter()
    ev = _Events(resp)
    held: list = []  # a forced call's input, until it is whole
    yield ev.event("response.created", response=resp.body("in_progress"))
    yield ev.event("response.in_progress", response=resp.body("in_progress"))
    async for event in run.events_of():
        if isinstance(event, Chunk):
            if forced is not None:
                held += split.feed(event.text)
                continue
            for line in ev.feed(split.feed(event.text)):
                yield line
        elif isinstance(event, Finish):
            rest = split.close()
            if forced is not None:
                rest = _forced_pieces(held + rest, forced)
            for line in ev.feed(rest) + ev.close():
                yield line
            if event.reason == "length":
                yield ev.event("response.incomplete", response=resp.body("incomplete", event.usage,
                                                                         "max_output_tokens"))
            else:
                yield ev.event("response.completed", response=resp.body("completed", event.usage))
        elif isinstance(event, Failure):
            body = resp.body("failed")
            body["error"] = {"code": "server_error", "message": failed(run.gen.id).message}
            yield ev.event("response.failed", response=body)
