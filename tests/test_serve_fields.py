"""The field policy: every request field the official clients define is honoured, refused
with a 400 naming it, or accepted and ignored and listed in docs/serve.md; unknown fields
are refused. The clients' own parameter types are the list walked."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json
import re
import typing
from pathlib import Path

import pytest

from segcache.serve import schemas
from segcache.serve.errors import APIError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serve.md"


def _fields(*classes) -> set:
    return set().union(*(typing.get_type_hints(c).keys() for c in classes))


def _apis():
    from anthropic.types import message_count_tokens_params as act
    from anthropic.types import message_create_params as am
    from openai.types import completion_create_params as oc
    from openai.types.chat import completion_create_params as occ
    from openai.types.responses import response_create_params as orr

    minimal = {"prompt": "x"}
    chat = {"messages": [{"role": "user", "content": "x"}]}
    return {
        "completions": (schemas.CompletionRequest, _fields(oc.CompletionCreateParamsStreaming), minimal),
        "chat": (schemas.ChatRequest, _fields(occ.CompletionCreateParamsStreaming), chat),
        "responses": (schemas.ResponsesRequest, _fields(orr.ResponseCreateParamsStreaming), {"input": "x"}),
        "messages": (schemas.MessagesRequest, _fields(am.MessageCreateParamsStreaming), dict(chat, max_tokens=4)),
        "count_tokens": (schemas.CountTokensRequest, _fields(act.MessageCountTokensParams), chat),
    }


def _parse(kind, body):
    return schemas.parse(json.dumps(body).encode(), kind)


def _documented_ignored() -> dict:
    """docs/serve.md's table: route name -> the fields it lists as accepted and ignored."""
    text = DOCS.read_text()
    section = text[text.index("### Accepted and ignored"):]
    section = section[: section.index("\n#", 1)]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`?(\w+)`?\s*\|(.*)\|\s*$", line)
        if m and m.group(1) in _apis():
            rows[m.group(1)] = set(re.findall(r"`([a-z_]+)`", m.group(2)))
    return rows


@pytest.mark.parametrize("api", ["completions", "chat", "responses", "messages", "count_tokens"])
def test_every_client_field_is_honoured_refused_or_documented_as_ignored(api):
    kind, client_fields, minimal = _apis()[api]
    honoured = set(kind.model_fields)
    assert not (honoured & kind.ignored) and not (honoured & set(kind.refused)) \
        and not (kind.ignored & set(kind.refused))
    undecided = client_fields - honoured - kind.ignored - set(kind.refused)
    assert not undecided, f"{api}: the client sends fields the server has no policy for: {sorted(undecided)}"
    assert _documented_ignored()[api] == set(kind.ignored)
    _parse(kind, minimal)
    for name in sorted(client_fields):
        if name in kind.ignored:
            _parse(kind, {**minimal, name: {"any": "value"}})  # accepted, whatever it holds
            _parse(kind, {**minimal, name: None})
        elif name in kind.refused:
            with pytest.raises(APIError) as e:
                _parse(kind, {**minimal, name: {"any": "value"}})
            assert (e.value.status, e.value.param) == (400, name) and f"'{name}'" in e.value.message
            _parse(kind, {**minimal, name: None})  # null is absent


@pytest.mark.parametrize("api", ["completions", "chat", "responses", "messages"])
def test_unknown_fields_are_refused_naming_them(api):
    kind, _, minimal = _apis()[api]
    for body, param in [({**minimal, "max_token": 5}, "max_token"), ({**minimal, "typical_p": 0.9},
                                                                     "typical_p")]:
        with pytest.raises(APIError) as e:
            _parse(kind, body)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "unknown_field")


NESTED = [
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": "x", "colour": 1}]}, "messages.0.colour"),
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type"),
    (schemas.ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                                             "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    (schemas.ChatRequest, {"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom"}]},
     "tools.0.type"),
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs.tools"),
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}, "modalities.0"),
    (schemas.MessagesRequest, {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": 1, "name": "f", "input": {}}]}]}, "messages.0.content.0.id"),
    (schemas.MessagesRequest, {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0"),
    (schemas.MessagesRequest, {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                               "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    (schemas.MessagesRequest, {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    (schemas.MessagesRequest, {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                               "output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    (schemas.ResponsesRequest, {"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    (schemas.ResponsesRequest, {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name"),
    (schemas.ResponsesRequest, {"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    (schemas.ResponsesRequest, {"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    (schemas.ResponsesRequest, {"input": "x", "truncation": "auto"}, "truncation"),
    (schemas.ResponsesRequest, {"input": "x", "background": True}, "background"),
    (schemas.ResponsesRequest, {"input": []}, "input"),
    (schemas.ResponsesRequest, {"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
    (schemas.ResponsesRequest, {"input": "x", "tools": [{"type": "custom", "name": "p", "format": {
        "type": "grammar", "syntax": "ebnf", "definition": "x"}}]}, "tools.0.format.syntax"),
    (schemas.ResponsesRequest, {"input": "x", "tools": [{"type": "custom", "name": "p", "format": {
        "type": "grammar", "syntax": "lark"}}]}, "tools.0.format.definition"),
    (schemas.ResponsesRequest, {"input": "x", "tools": [{"type": "custom", "name": "p", "colour": 1}]},
     "tools.0.colour"),
    (schemas.ResponsesRequest, {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p"}]},
     "input.0.input"),
    (schemas.ResponsesRequest, {"input": [{"type": "custom_tool_call_output", "call_id": "c", "output": 5}]},
     "input.0.output"),
]


@pytest.mark.parametrize("kind, body, param", NESTED, ids=[n[2] for n in NESTED])
def test_bad_nested_fields_are_refused_naming_their_path(kind, body, param):
    with pytest.raises(APIError) as e:
        _parse(kind, body)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
