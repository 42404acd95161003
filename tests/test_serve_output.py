"""The output splitter (serve/output.py): reasoning, text and tool calls out of streamed text,
against mlx-lm's own state machine and parsers."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import importlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import TextStateMachine

from chat_util import warnings_logged
from segcache.serve.output import REASONING, TEXT, TOOL, Call, Markup, Splitter, Text, split_all
from segcache.testing.chat import CALLS, FAMILIES, call_text, markers

THINK = ("<think>", "</think>")
TOOLS = ("<tool_call>", "</tool_call>")


def echo(body, tools):
    """A parser that returns its input, so a test sees exactly the text a parser was given."""
    return {"name": "f", "arguments": {"body": body}}


MARKUP = Markup(THINK, TOOLS, echo)
WORDS = ["a", "b c", "\n", "<", "</", "<th", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_", "k>"]


def _mlx_lm_states(text: str, start: str) -> list[tuple[str, str]]:
    # mlx_lm.server's own machine, with the transitions its make_text_state_machine builds
    sm = TextStateMachine({"normal": [(THINK[0], "reasoning"), (TOOLS[0], "tool")],
                           "reasoning": [(THINK[1], "normal"), (TOOLS[0], "tool")],
                           "tool": [(TOOLS[1], "normal")]})
    state, segments = TextStateMachine.split(sm.make_state(start), text)
    state, rest, name = TextStateMachine.flush(state)
    return segments + [(name, rest)]


@settings(max_examples=300, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), max_size=16), cuts=st.lists(st.integers(0, 80), max_size=8),
       start=st.sampled_from([TEXT, REASONING]))
def test_split_is_mlx_lm_servers_whatever_the_segmentation(words, cuts, start):
    text = "".join(words)
    segs, pos = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        segs.append(text[pos:c])
        pos = max(pos, c)
    got = split_all(MARKUP, segs, start=start)
    # the reference: mlx-lm's machine over the whole text, its states' texts merged in order
    want, calls = [], []
    states = _mlx_lm_states(text, "normal" if start == TEXT else "reasoning")
    body = None
    for name, seg in states:
        if name == "tool":
            body = (body or "") + seg
            continue
        if body is not None and name is not None:
            calls.append(body)
            want.append(("call", body))
            body = None
        if seg:
            kind = "reasoning" if name == "reasoning" else "text"
            if want and want[-1][0] == kind:
                want[-1] = (kind, want[-1][1] + seg)
            else:
                want.append((kind, seg))
    if body is not None:
        want.append(("call", body))
    mine = [("call", json.loads(p.arguments)["body"]) if isinstance(p, Call)
            else ("reasoning" if p.reasoning else "text", p.text) for p in got]
    assert mine == want
    assert [p.index for p in got if isinstance(p, Call)] == list(range(sum(isinstance(p, Call) for p in got)))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_parser_family_gives_its_parsers_call(family):
    mod = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    markup = Markup(None, markers(family), mod.parse_tool_call)
    text = "Let me read it. " + call_text(family)
    for segs in ([text], list(text)):  # whole, and one character at a time
        pieces = split_all(markup, segs)
        calls = [p for p in pieces if isinstance(p, Call)]
        assert [p for p in pieces if isinstance(p, Text)] == [Text("Let me read it. ")]
        want = mod.parse_tool_call(CALLS[family], None)
        want = want if isinstance(want, list) else [want]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(w["name"], w["arguments"]) for w in want]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("read_file", {"path": "src/app.py"})]


def test_markup_that_does_not_parse_is_text_with_a_warning():
    mod = importlib.import_module("mlx_lm.tool_parsers.json_tools")
    markup = Markup(THINK, TOOLS, mod.parse_tool_call)
    bad = '<tool_call>{"name": "read_file", "arguments": {"path": </tool_call>'
    with warnings_logged() as logged:
        pieces = split_all(markup, ["Sure. ", bad[:9], bad[9:], " done"])
    assert pieces == [Text("Sure. " + bad + " done")]
    assert any("did not parse" in m for m in logged)
    # JSON that is not a call ({"name", "parameters"} is another format's shape): text too
    other = '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>'
    assert split_all(markup, [other]) == [Text(other)]
    # cut by max_tokens inside a call: what came is returned as text
    assert split_all(markup, ['<tool_call>{"name": "f", "argu']) == [Text('<tool_call>{"name": "f", "argu')]


def test_calls_off_leaves_markup_and_a_forced_call_starts_inside_one():
    mod = importlib.import_module("mlx_lm.tool_parsers.json_tools")
    markup = Markup(THINK, TOOLS, mod.parse_tool_call)
    text = call_text("json_tools")
    assert split_all(markup, [text], calls=False) == [Text(text)]
    pieces = split_all(markup, [CALLS["json_tools"] + TOOLS[1] + "after"], start=TOOL)
    assert [type(p) for p in pieces] == [Call, Text] and pieces[1] == Text("after")
    with pytest.raises(ValueError):
        Splitter(markup, calls=False, start=TOOL)


def test_parallel_calls_get_indices_and_the_formats_own_ids():
    mod = importlib.import_module("mlx_lm.tool_parsers.kimi_k2")
    markup = Markup(None, markers("kimi_k2"), mod.parse_tool_call)
    two = (markers("kimi_k2")[0] + CALLS["kimi_k2"] + CALLS["kimi_k2"].replace("read_file:0", "read_file:1")
           + markers("kimi_k2")[1])
    calls = [p for p in split_all(markup, [two]) if isinstance(p, Call)]
    assert [(c.index, c.id) for c in calls] == [(0, "functions.read_file:0"), (1, "functions.read_file:1")]
    mod = importlib.import_module("mlx_lm.tool_parsers.json_tools")
    markup = Markup(None, TOOLS, mod.parse_tool_call)
    calls = [p for p in split_all(markup, [call_text("json_tools") * 2]) if isinstance(p, Call)]
    assert [c.index for c in calls] == [0, 1] and calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_a_limit_of_one_call_keeps_the_first():
    mod = importlib.import_module("mlx_lm.tool_parsers.mistral")
    markup = Markup(None, markers("mistral"), mod.parse_tool_call)
    two = markers("mistral")[0] + CALLS["mistral"] + CALLS["mistral"].replace("read_file", "search")
    assert [p.name for p in split_all(markup, [two]) if isinstance(p, Call)] == ["read_file", "search"]
    assert [p.name for p in split_all(markup, [two], limit=1) if isinstance(p, Call)] == ["read_file"]
