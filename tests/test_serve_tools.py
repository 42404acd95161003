"""Tool calls and reasoning on the chat completions surface, through the `openai` client,
on scripted models (segcache.testing.chat): one per mlx-lm tool-parser family, prompts
against mlx-lm's own rendering, and the same request against mlx_lm.server."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import copy
import json

import httpx
import mlx_lm
import pytest
from mlx_lm.server import process_message_content

from chat_util import LocalServer, MlxLmServer, warnings_logged
from segcache.serve.chat import Prompter, template_messages
from segcache.serve.errors import APIError
from segcache.testing.chat import FAMILIES, READ_FILE, SEARCH, build, call_text
from serve_util import TARGET

TOOLS = [READ_FILE, SEARCH]
ASK = [{"role": "system", "content": "You help with a Python repository."},
       {"role": "user", "content": "What does src/app.py do?"}]
CALL = call_text("json_tools")
SEARCH_CALL = call_text("json_tools", '\n{"name": "search", "arguments": {"pattern": "def main"}}\n')
BROKEN = call_text("json_tools", '\n{"name": "read_file", "arguments": {"path": \n')


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-models")
    return {
        "tools": build(root / "tools", scripts={
            "default": "Let me look. " + CALL, "two": CALL + "\n" + SEARCH_CALL, "broken": "Hm. " + BROKEN,
            "answer": "It serves the API."}, forced='\n{"name": "search", "arguments": {"pattern": "app"}}\n</tool_call>'),
        "think": build(root / "think", thinking=True, scripts={
            "default": "The user wants the file.</think>\n\nReading it. " + CALL,
            "answer": "Short.</think>\n\nIt serves the API.", "two": "Both.</think>\n\n" + CALL + SEARCH_CALL}),
        "plain": build(root / "plain", family=None, scripts={"default": "No tools here."}),
    }


def _history_turn(tool_call_id="call_1"):
    """ASK, the assistant's call, the tool's answer: one agent step."""
    return ASK + [
        {"role": "assistant", "content": "Let me look. ", "tool_calls": [
            {"id": tool_call_id, "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'}}]},
        {"role": "tool", "tool_call_id": tool_call_id, "content": "def main():\n    serve()\n"},
    ]


def test_prompt_with_tools_is_mlx_lms_rendering(models):
    _, tok = mlx_lm.load(str(models["tools"]))
    p = Prompter(tok)
    msgs = _history_turn()
    want_msgs = copy.deepcopy(msgs)
    process_message_content(want_msgs)  # what mlx_lm.server hands the template
    want = tok.apply_chat_template(want_msgs, tools=TOOLS, add_generation_prompt=True)
    prompt = p.chat(template_messages(msgs), TOOLS)
    assert prompt.ids == list(want)
    text = tok.decode(prompt.ids)
    assert '{"name": "read_file", "arguments": {"path": "src/app.py"}}' in text  # the call, re-rendered
    assert "def main():\n    serve()" in text and '"name": "search"' in text
    without = p.chat(template_messages(msgs))
    assert len(without.ids) < len(prompt.ids)
    # the boundaries: the system prompt and the tools, the conversation before the generation prompt
    sys_block = tok.apply_chat_template(ASK[:1] + [{"role": "user", "content": ""}], tools=TOOLS)
    convo = tok.apply_chat_template(want_msgs, tools=TOOLS)
    assert prompt.checkpoints[0] >= len(sys_block) - 8 and prompt.ids[: prompt.checkpoints[0]] == sys_block[
        : prompt.checkpoints[0]]
    assert prompt.checkpoints[-1] == len(convo) and prompt.ids[: len(convo)] == convo


def test_a_chat_is_encoded_once_and_its_boundaries_are_those_of_encoding_each_rendering(models, monkeypatch):
    """One encode per chat (a fast tokenizer's offsets place the boundaries), with the boundaries
    of encoding each partial rendering on its own (the way without offsets)."""
    _, tok = mlx_lm.load(str(models["tools"]))
    msgs = template_messages(_history_turn() + [{"role": "user", "content": "And the tests?"}])
    apart = Prompter(tok)
    monkeypatch.setattr(apart, "_ids_and_ends", lambda text: (apart._ids(text), None))
    want = apart.chat(msgs, TOOLS)
    hf, encoded = type(tok._tokenizer), []
    call, encode = hf.__call__, hf.encode
    monkeypatch.setattr(hf, "__call__", lambda self, text, **kw: encoded.append(text) or call(self, text, **kw))
    monkeypatch.setattr(hf, "encode", lambda self, text, **kw: encoded.append(text) or encode(self, text, **kw))
    got = Prompter(tok).chat(msgs, TOOLS)
    assert len(encoded) == 1 and got.ids == want.ids
    assert got.checkpoints == want.checkpoints and len(want.checkpoints) >= 3


def test_tools_are_refused_by_a_model_that_cannot_take_them(models):
    plain = Prompter(mlx_lm.load(str(models["plain"]))[1])  # a template, but no tool parser
    target = Prompter(mlx_lm.load(str(TARGET))[1])  # no template at all
    for p in (plain, target):
        with pytest.raises(APIError) as e:
            p.chat(ASK, TOOLS)
        assert (e.value.status, e.value.param) == (400, "tools")
    with pytest.raises(APIError) as e:  # earlier calls cannot be shown to a model without a template
        target.chat(template_messages(_history_turn()))
    assert e.value.param == "messages.2.tool_calls"
    with LocalServer(models["plain"]) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        ok = srv.openai().chat.completions.create(model="plain", messages=ASK)
        assert ok.choices[0].message.content == "No tools here." and not ok.choices[0].message.tool_calls


def _stream(client, **kw):
    """A streamed chat answer, accumulated: (content, reasoning, calls, finish_reason, chunks)."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, 0
    for ev in client.chat.completions.create(stream=True, **kw):
        if not ev.choices:
            continue
        chunks += 1
        d = ev.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            assert tc.index not in calls  # each call comes whole, once
            calls[tc.index] = (tc.id, tc.function.name, tc.function.arguments)
        finish = ev.choices[0].finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, chunks


@pytest.mark.parametrize("family", FAMILIES)
def test_each_parser_family_end_to_end(tmp_path, family):
    path = build(tmp_path / family, family=family, scripts={"default": "Sure. " + call_text(family)})
    with LocalServer(path) as srv:
        c = srv.openai()
        r = c.chat.completions.create(model=family, messages=ASK, tools=TOOLS)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.content == "Sure. "
        got = [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]
        assert got == [("read_file", {"path": "src/app.py"})]
        content, _, calls, finish, chunks = _stream(c, model=family, messages=ASK, tools=TOOLS)
        assert (content, finish) == ("Sure. ", "tool_calls") and chunks > 2
        assert [(n, json.loads(a)) for _, n, a in calls] == got
        # without tools in the request, the markup is the answer's text
        r = c.chat.completions.create(model=family, messages=ASK)
        assert r.choices[0].message.content == "Sure. " + call_text(family) and r.choices[0].finish_reason == "stop"


def test_tool_choice_parallel_calls_and_markup_that_does_not_parse(models):
    with LocalServer(models["tools"]) as srv:
        c = srv.openai()

        def ask(**kw):
            return c.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, **kw)

        auto = ask()
        assert [t.function.name for t in auto.choices[0].message.tool_calls] == ["read_file"]
        none = ask(tool_choice="none")  # rendered, not parsed
        assert none.choices[0].message.content == "Let me look. " + CALL and none.choices[0].finish_reason == "stop"
        assert none.usage.prompt_tokens == auto.usage.prompt_tokens
        for choice in ("required", {"type": "function", "function": {"name": "search"}}):
            forced = ask(tool_choice=choice)  # the answer starts inside a call
            calls = forced.choices[0].message.tool_calls
            assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
                ("search", {"pattern": "app"})]
            assert forced.choices[0].finish_reason == "tool_calls"
        named = ask(tool_choice={"type": "function", "function": {"name": "search"}})
        assert named.usage.prompt_tokens < auto.usage.prompt_tokens  # only the named tool is rendered
        two = ask(extra_body={"chat_template_kwargs": {"script": "two"}})
        assert [t.function.name for t in two.choices[0].message.tool_calls] == ["read_file", "search"]
        streamed = _stream(c, model="tools", messages=ASK, tools=TOOLS, extra_body={
            "chat_template_kwargs": {"script": "two"}})
        assert [n for _, n, _ in streamed[2]] == ["read_file", "search"] and streamed[3] == "tool_calls"
        one = ask(parallel_tool_calls=False, extra_body={"chat_template_kwargs": {"script": "two"}})
        assert [t.function.name for t in one.choices[0].message.tool_calls] == ["read_file"]
        assert one.choices[0].finish_reason == "tool_calls"
        assert one.usage.completion_tokens < two.usage.completion_tokens  # it stopped there
        with warnings_logged() as logged:
            bad = ask(extra_body={"chat_template_kwargs": {"script": "broken"}})
            streamed = _stream(c, model="tools", messages=ASK, tools=TOOLS,
                               extra_body={"chat_template_kwargs": {"script": "broken"}})
        assert bad.choices[0].message.content == "Hm. " + BROKEN and not bad.choices[0].message.tool_calls
        assert bad.choices[0].finish_reason == "stop" and streamed[0] == "Hm. " + BROKEN and not streamed[2]
        assert any("did not parse" in m for m in logged)


def test_reasoning_and_template_arguments(models, tmp_path):
    with LocalServer(models["think"]) as srv:
        c = srv.openai()
        r = c.chat.completions.create(model="think", messages=ASK, tools=TOOLS)
        msg = r.choices[0].message
        assert msg.reasoning_content == "The user wants the file." and msg.content == "\n\nReading it. "
        assert [t.function.name for t in msg.tool_calls] == ["read_file"]
        content, reasoning, calls, finish, _ = _stream(c, model="think", messages=ASK, tools=TOOLS)
        assert (content, reasoning, finish) == ("\n\nReading it. ", "The user wants the file.", "tool_calls")
        off = c.chat.completions.create(model="think", messages=ASK, extra_body={
            "chat_template_kwargs": {"enable_thinking": False, "script": "answer"}})
        on = c.chat.completions.create(model="think", messages=ASK, extra_body={"chat_template_kwargs": {
            "script": "answer"}})
        # no reasoning block opened: the model's "</think>" is text, and the prompt is "<think>\n" shorter
        assert off.choices[0].message.content == "Short.</think>\n\nIt serves the API."
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
        assert on.choices[0].message.reasoning_content == "Short."
        assert on.usage.prompt_tokens - off.usage.prompt_tokens == 2
        # reasoning sent back is rendered for the template
        back = ASK + [{"role": "assistant", "content": "It serves the API.", "reasoning_content": "Short."},
                      {"role": "user", "content": "And tests?"}]
        plain = [m for m in back if m["role"] != "assistant"] + [{"role": "assistant", "content": "It serves the API."}]
        assert c.chat.completions.create(model="think", messages=back).usage.prompt_tokens > \
            c.chat.completions.create(model="think", messages=plain).usage.prompt_tokens
    with LocalServer(models["think"], template_args={"enable_thinking": False}) as srv:
        c = srv.openai()
        flag = c.chat.completions.create(model="think", messages=ASK, extra_body={"chat_template_kwargs": {
            "script": "answer"}})
        assert flag.usage.prompt_tokens == off.usage.prompt_tokens and flag.choices[0].message.content == \
            off.choices[0].message.content
        over = c.chat.completions.create(model="think", messages=ASK, extra_body={"chat_template_kwargs": {
            "script": "answer", "enable_thinking": True}})
        assert over.usage.prompt_tokens == on.usage.prompt_tokens


def test_agent_turns_resume_all_but_the_new_messages(models, tmp_path):
    """An agent loop on the model's own answers (calls parsed, results sent back), on the
    scripted KV model and on a scripted hybrid: each turn resumes at least the previous
    request's conversation (its prompt but the generation prompt)."""
    hybrid = build(tmp_path / "hybrid", arch="qwen3_next", thinking=True,
                   scripts={"default": "Read it.</think>\n\n" + CALL})
    for path in (models["tools"], hybrid):
        p = Prompter(mlx_lm.load(str(path))[1])
        with LocalServer(path, store_dir=tmp_path / f"store-{path.name}") as srv:
            c = srv.openai()
            msgs, prev = list(ASK), None
            for turn in range(4):
                r = c.chat.completions.create(model=path.name, messages=msgs, tools=TOOLS)
                if prev is not None:
                    floor = p.chat(template_messages(prev), TOOLS).checkpoints[-1]
                    assert r.usage.prompt_tokens_details.cached_tokens >= floor, (path.name, turn, floor)
                msg = r.choices[0].message
                assert r.choices[0].finish_reason == "tool_calls"
                prev = msgs
                msgs = msgs + [msg.model_dump(exclude_none=True)] + [
                    {"role": "tool", "tool_call_id": t.id, "content": f"x = {turn}\n" * 20} for t in msg.tool_calls]


def test_same_tool_calls_and_prompt_tokens_as_mlx_lm_server(models, tmp_path):
    reqs = [dict(messages=ASK, tools=TOOLS), dict(messages=_history_turn(), tools=TOOLS),
            dict(messages=ASK, tools=TOOLS, extra_body={"chat_template_kwargs": {"script": "two"}})]
    mine, refs = {}, {}
    for name in ("tools", "think"):
        with LocalServer(models[name]) as ours:
            mine[name] = [ours.openai().chat.completions.create(model="default_model", **kw) for kw in reqs]
    # one mlx_lm.server for both models: a request naming a model directory has it load that one
    with MlxLmServer(models["tools"], tmp_path / "mlx.log") as theirs:
        for name in ("tools", "think"):
            refs[name] = [theirs.openai().chat.completions.create(model=str(models[name]), **kw) for kw in reqs]
    for name in ("tools", "think"):
        for a, b in zip(mine[name], refs[name]):
            assert a.usage.prompt_tokens == b.usage.prompt_tokens
            ca, cb = a.choices[0].message.tool_calls or [], b.choices[0].message.tool_calls or []
            assert [(t.function.name, json.loads(t.function.arguments)) for t in ca] == \
                [(t.function.name, json.loads(t.function.arguments)) for t in cb] != []
            assert a.choices[0].finish_reason == b.choices[0].finish_reason == "tool_calls"
            assert (getattr(a.choices[0].message, "reasoning", None) or "") == \
                (getattr(b.choices[0].message, "reasoning", None) or "")


def test_chat_template_args_flag_takes_a_json_object(capsys):
    from segcache.cli import main

    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit):
            main(["serve", "--model", str(TARGET), "--chat-template-args", bad])
        assert "--chat-template-args" in capsys.readouterr().err
