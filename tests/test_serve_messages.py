"""Anthropic's Messages API (official `anthropic` client) and OpenAI's Responses API
(`openai` client's `responses`) on scripted models: tool calls, reasoning, streaming,
and the same prompt as the equivalent chat completion."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json

import anthropic
import httpx
import openai
import pytest

from chat_util import LocalServer
from segcache.testing.chat import READ_FILE, SEARCH, build, call_text

CALL = call_text("json_tools")
TOOLS = [READ_FILE, SEARCH]
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
R_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
            "parameters": t["function"]["parameters"], "strict": None} for t in TOOLS]
SYSTEM = "You help with a Python repository."
QUESTION = "What does src/app.py do?"
RESULT = "def main():\n    serve()\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("messages")
    path = build(root / "think", thinking=True, scripts={
        "default": "The user wants the file.</think>\n\nReading it. " + CALL,
        "answer": "Short.</think>\n\nIt serves the API over HTTP.",
        "broken": "Hm.</think>\n\n" + call_text("json_tools", '{"name": "read_file", "arguments": {'),
    })
    with LocalServer(path, store_dir=root / "store", api_key="sekrit") as srv:
        yield srv


def _chat_tokens(srv, messages, **kw):
    r = srv.openai("sekrit").chat.completions.create(model="think", messages=messages, max_tokens=1, **kw)
    return r.usage.prompt_tokens


def test_messages_with_tools_whole_and_streamed(server):
    a = server.anthropic("sekrit")
    ask = dict(model="think", max_tokens=200, system=SYSTEM, tools=A_TOOLS,
               messages=[{"role": "user", "content": QUESTION}])
    m = a.messages.create(**ask)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "The user wants the file." and m.content[1].text == "\n\nReading it. "
    use = m.content[2]
    assert (use.name, use.input) == ("read_file", {"path": "src/app.py"}) and use.id.startswith("toolu_")
    assert m.stop_reason == "tool_use" and m.stop_sequence is None and m.role == "assistant"
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    # the same prompt as the equivalent chat completion, and as count_tokens
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    assert total == _chat_tokens(server, chat, tools=TOOLS)
    counted = a.messages.count_tokens(**{k: v for k, v in ask.items() if k != "max_tokens"})
    assert counted.input_tokens == total
    # streamed: Anthropic's events, accumulated by the client into the same message
    with a.messages.stream(**ask) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    assert [b.model_dump(exclude={"id", "signature"}) for b in final.content] == \
        [b.model_dump(exclude={"id", "signature"}) for b in m.content]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.cache_read_input_tokens >= total - 1  # the same prompt again: resumed


def test_messages_tool_results_stops_and_thinking_off(server):
    a = server.anthropic("sekrit")
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The user wants the file.", "signature": ""},
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "src/app.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT},
                                     {"type": "text", "text": "Summarize it."}]},
    ]
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "Reading it.", "reasoning_content": "The user wants the file.",
             "tool_calls": [{"id": "toolu_1", "type": "function",
                             "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": RESULT},
            {"role": "user", "content": "Summarize it."}]
    counted = a.messages.count_tokens(model="think", system=SYSTEM, tools=A_TOOLS, messages=history)
    assert counted.input_tokens == _chat_tokens(server, chat, tools=TOOLS)
    answer = dict(model="think", max_tokens=200, system=SYSTEM, messages=history,
                  extra_body={"chat_template_kwargs": {"script": "answer"}})
    m = a.messages.create(**answer)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    assert m.content[1].text == "\n\nIt serves the API over HTTP."
    m = a.messages.create(stop_sequences=["API"], **answer)
    assert (m.stop_reason, m.stop_sequence, m.content[1].text) == ("stop_sequence", "API", "\n\nIt serves the ")
    m = a.messages.create(**dict(answer, max_tokens=2))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    off = a.messages.create(thinking={"type": "disabled"}, **answer)
    assert [b.type for b in off.content] == ["text"] and off.content[0].text.startswith("Short.</think>")
    with a.messages.stream(thinking={"type": "disabled"}, **answer) as s:
        assert s.get_final_message().content[0].text == off.content[0].text


def test_messages_errors_are_anthropics(server):
    a = server.anthropic("wrong")
    with pytest.raises(anthropic.AuthenticationError) as e:
        a.messages.create(model="think", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sekrit"}, timeout=60,
                   json={"model": "think", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "'max_tokens'" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        server.anthropic("sekrit").messages.create(model="claude-nothing", max_tokens=5,
                                                   messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        server.anthropic("sekrit").messages.create(
            model="think", max_tokens=5, messages=[{"role": "user", "content": "x"}], tools=A_TOOLS,
            tool_choice={"type": "tool", "name": "write_file"})
    assert "'tool_choice'" in e.value.body["error"]["message"]


def _item(o):
    if o.type == "function_call":
        return o.type, o.name, o.arguments, o.status
    return o.type, [p.text for p in o.content], o.status


def test_responses_with_tools_whole_streamed_and_stateless(server):
    c = server.openai("sekrit")
    ask = dict(model="think", instructions=SYSTEM, input=QUESTION, tools=R_TOOLS)
    r = c.responses.create(**ask)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"] and r.status == "completed"
    assert r.output[0].content[0].text == "The user wants the file." and r.output_text == "\n\nReading it. "
    fc = r.output[2]
    assert (fc.name, json.loads(fc.arguments)) == ("read_file", {"path": "src/app.py"})
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    assert r.usage.input_tokens == _chat_tokens(server, chat, tools=TOOLS)
    # streamed: the events, and the client's accumulation of them
    kinds = [e.type for e in c.responses.create(stream=True, **ask)]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    with c.responses.stream(**ask) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert [_item(o) for o in final.output] == [_item(o) for o in r.output]
    # the next turn: the call and its output go back in `input`, stateless
    items = [{"role": "user", "content": QUESTION}, {"type": "reasoning", "id": "rs_1", "summary": [],
                                                     "content": [{"type": "reasoning_text", "text": "The user wants the file."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Reading it."}]},
             {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
             {"type": "function_call_output", "call_id": fc.call_id, "output": RESULT}]
    nxt = c.responses.create(model="think", instructions=SYSTEM, input=items, tools=R_TOOLS,
                             extra_body={"chat_template_kwargs": {"script": "answer"}})
    assert nxt.output_text == "\n\nIt serves the API over HTTP." and nxt.status == "completed"
    chat += [{"role": "assistant", "content": "Reading it.", "reasoning_content": "The user wants the file.",
              "tool_calls": [{"id": fc.call_id, "type": "function",
                              "function": {"name": fc.name, "arguments": fc.arguments}}]},
             {"role": "tool", "tool_call_id": fc.call_id, "content": RESULT}]
    assert nxt.usage.input_tokens == _chat_tokens(server, chat, tools=TOOLS, extra_body={
        "chat_template_kwargs": {"script": "answer"}})
    assert nxt.usage.input_tokens_details.cached_tokens > 0
    cut = c.responses.create(model="think", input=QUESTION, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="think", input=QUESTION, previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_unparseable_calls_come_back_as_text_on_every_surface(server):
    broken = call_text("json_tools", '{"name": "read_file", "arguments": {')
    kw = {"chat_template_kwargs": {"script": "broken"}}
    c = server.openai("sekrit")
    chat = c.chat.completions.create(model="think", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                     extra_body=kw)
    assert chat.choices[0].message.content == "\n\n" + broken and chat.choices[0].finish_reason == "stop"
    m = server.anthropic("sekrit").messages.create(model="think", max_tokens=100, tools=A_TOOLS, extra_body=kw,
                                                   messages=[{"role": "user", "content": QUESTION}])
    assert m.content[-1].text == "\n\n" + broken and m.stop_reason == "end_turn"
    r = c.responses.create(model="think", input=QUESTION, tools=R_TOOLS, extra_body=kw)
    assert r.output_text == "\n\n" + broken and [o.type for o in r.output] == ["reasoning", "message"]


def test_isolation_domains_hold_on_the_messages_and_responses_routes(tmp_path):
    """cache_salt, and with per-key isolation the key (x-api-key or Bearer), separate what the
    prefix cache shares on the new routes as on the OpenAI ones."""
    path = build(tmp_path / "m", scripts={"default": "Fine."})
    long = "Tell me about the repository layout and its modules. " * 8
    with LocalServer(path, store_dir=tmp_path / "store", api_keys=("k1", "k2"), isolation="per-key") as srv:
        def read(key, salt=None):
            extra = {"cache_salt": salt} if salt else {}
            m = srv.anthropic(key).messages.create(model="m", max_tokens=4, extra_body=extra,
                                                   messages=[{"role": "user", "content": long}])
            return m.usage.cache_read_input_tokens

        assert read("k1") == 0
        assert read("k1") > 0  # the same key shares its own prefixes
        assert read("k2") == 0  # another key does not see them
        assert read("k1", "a") == 0 and read("k1", "a") > 0 and read("k1", "b") == 0  # salts split a key's domain
        r = srv.openai("k2").responses.create(model="m", input=long, max_output_tokens=4)
        assert r.usage.input_tokens_details.cached_tokens > 0  # k2's own earlier prompt (same rendering)
        r = srv.openai("k2").responses.create(model="m", input=long, max_output_tokens=4,
                                              extra_body={"cache_salt": "c"})
        assert r.usage.input_tokens_details.cached_tokens == 0
