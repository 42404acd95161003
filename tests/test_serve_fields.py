"""The field policy: every request field the official clients define is honoured, refused
with a 400 naming it, or accepted and ignored and listed in docs/serve.md; unknown fields
are accepted, ignored and named (`accepted_and_ignored`), and refused with --strict-fields
(`strict=True`). The clients' own parameter types are the list walked."""

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


def _parse(kind, body, strict=False):
    return schemas.parse(json.dumps(body).encode(), kind, strict=strict)


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
    hints = set(kind.hints)
    policies = [honoured, set(kind.ignored), set(kind.refused), hints]
    assert all(not (a & b) for i, a in enumerate(policies) for b in policies[i + 1:])
    undecided = client_fields - honoured - kind.ignored - set(kind.refused) - hints
    assert not undecided, f"{api}: the client sends fields the server has no policy for: {sorted(undecided)}"
    assert _documented_ignored()[api] == set(kind.ignored) | hints
    _parse(kind, minimal)
    for name in sorted(client_fields | hints):
        if name in kind.ignored or name in hints:
            req = _parse(kind, {**minimal, name: {"any": "value"}})  # accepted, whatever it holds
            assert req.accepted_and_ignored == [name]
            _parse(kind, {**minimal, name: None})
        if name in hints:  # --strict-fields refuses a hint as a field it cannot honour
            with pytest.raises(APIError) as e:
                _parse(kind, {**minimal, name: {"any": "value"}}, strict=True)
            assert (e.value.status, e.value.param, e.value.code) == (400, name, "unsupported_field")
        elif name in kind.refused:
            with pytest.raises(APIError) as e:
                _parse(kind, {**minimal, name: {"any": "value"}})
            assert (e.value.status, e.value.param) == (400, name) and f"'{name}'" in e.value.message
            _parse(kind, {**minimal, name: None})  # null is absent


@pytest.mark.parametrize("api", ["completions", "chat", "responses", "messages"])
def test_unknown_fields_are_refused_naming_them_with_strict_fields(api):
    kind, _, minimal = _apis()[api]
    for body, param in [({**minimal, "max_token": 5}, "max_token"), ({**minimal, "typical_p": 0.9},
                                                                     "typical_p")]:
        with pytest.raises(APIError) as e:
            _parse(kind, body, strict=True)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "unknown_field")


@pytest.mark.parametrize("api", ["completions", "chat", "responses", "messages"])
def test_unknown_fields_are_ignored_and_named_by_default(api, caplog):
    kind, _, minimal = _apis()[api]
    with caplog.at_level("DEBUG", logger="segcache.serve"):
        req = _parse(kind, {**minimal, "max_token": 5, "client_extra": {"x": [1]}})
    assert req.accepted_and_ignored == ["max_token", "client_extra"]
    assert req.model_dump() == _parse(kind, minimal).model_dump()  # the same request as without them
    assert any("accepted and ignored max_token, client_extra" in r.message for r in caplog.records)


UNKNOWN_NESTED = [
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": "x", "colour": 1}]}, "messages.0.colour"),
    (schemas.ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "z": 1}]}]},
     "messages.0.content.0.z"),
    (schemas.ResponsesRequest, {"input": "x", "tools": [{"type": "custom", "name": "p", "colour": 1}]},
     "tools.0.colour"),
    (schemas.ResponsesRequest, {"input": [{"role": "user", "content": "x", "phase": "a"}]}, "input.0.phase"),
    (schemas.MessagesRequest, {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                               "tools": [{"name": "f", "input_schema": {}, "defer_loading": True}]},
     "tools.0.defer_loading"),
]


@pytest.mark.parametrize("kind, body, path", UNKNOWN_NESTED, ids=[n[2] for n in UNKNOWN_NESTED])
def test_unknown_nested_fields_are_dropped_at_their_path_by_default(kind, body, path):
    req = _parse(kind, body)
    assert req.accepted_and_ignored == [path]
    with pytest.raises(APIError) as e:
        _parse(kind, body, strict=True)
    assert (e.value.status, e.value.param) == (400, path)


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
        _parse(kind, body, strict=True)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_tools_a_local_model_cannot_run_are_rewritten_or_dropped_by_default():
    """Codex CLI's `namespace` tools become their functions; hosted and server tools are dropped,
    each named; --strict-fields refuses them as before."""
    fn = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {"input": "x", "tools": [{"type": "web_search"}, fn, {"type": "namespace", "name": "mcp__fs",
            "description": "files", "tools": [{"type": "function", "name": "read", "parameters": {}},
                                               {"name": "write", "parameters": {}}]}, {"type": "local_shell"}]}
    req = _parse(schemas.ResponsesRequest, body)
    assert [(t.type, t.name) for t in req.tools] == [("function", "f"), ("function", "read"), ("function", "write")]
    assert req.accepted_and_ignored == ["tools.0", "tools.2", "tools.3"]
    with pytest.raises(APIError) as e:
        _parse(schemas.ResponsesRequest, body, strict=True)
    assert e.value.param == "tools.0.type"
    anthropic_body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"type": "web_search_20250305", "name": "web_search"},
                                {"name": "f", "input_schema": {"type": "object"}}]}
    req = _parse(schemas.MessagesRequest, anthropic_body)
    assert [t.name for t in req.tools] == ["f"] and req.accepted_and_ignored == ["tools.0"]
    with pytest.raises(APIError):
        _parse(schemas.MessagesRequest, anthropic_body, strict=True)
