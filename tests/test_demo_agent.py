"""The demo target's tools (segcache.models.agent) and its tool-calling loop, on a scripted
Qwen3.5-style model (the shipped target has no chat format yet)."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import textwrap

import mlx_lm
import pytest

from segcache.demo import MODELS_DIR
from segcache.models.agent import READ_LIMIT, TOOLS, Workspace, agent_loop, parse_calls
from segcache.testing.chat import build, call_text

FILES = {
    "shapes/area.py": '''\
        """Areas of shapes."""


        def circle_area(radius):
            """Return the area of a circle."""
            return 3.14159 * radius * radius


        class Square:
            def __init__(self, side):
                self.side = side

            def area(self):
                return self.side * self.side
        ''',
    "tests/test_area.py": '''\
        from shapes.area import circle_area, Square


        def test_square():
            assert Square(3).area() == 9


        def test_circle():
            assert circle_area(1) == 3
        ''',
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    for path, text in FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    (root / "shapes" / "__init__.py").write_text("")
    return Workspace.from_directory(root)


def test_tools_act_on_the_directory(workspace):
    assert workspace.search("def circle_area(") == "shapes/area.py:4: def circle_area(radius):"
    assert workspace.search("area(", "tests").splitlines()[0].startswith("tests/test_area.py:")
    assert workspace.search("nowhere") == "no matches for 'nowhere'"
    assert workspace.read_file("shapes/area.py", 4, 5) == (
        '4: def circle_area(radius):\n5:     """Return the area of a circle."""')
    assert len(workspace.read_file("shapes/area.py").splitlines()) == min(READ_LIMIT, 14)
    assert workspace.read_file("missing.py").startswith("error: no file")
    names = {d.name for d in workspace.definitions}
    assert {"circle_area", "Square", "area"} <= names
    assert {t["function"]["name"] for t in TOOLS} == {"search", "read_file", "run_tests"}


def test_bad_calls_get_error_texts_not_exceptions(workspace):
    assert workspace.call("delete_all", {}).startswith("error: no tool 'delete_all'")
    assert workspace.call("read_file", {"paht": "x.py"}).startswith("error: read_file:")
    assert workspace.call("read_file", {"path": "shapes/area.py", "start_line": "x"}).startswith("error:")


def test_run_tests_runs_pytest(workspace):
    report = workspace.call("run_tests", {"path": "tests/test_area.py"})
    assert "1 failed, 1 passed" in report and "test_circle" in report
    assert workspace.run_tests("tests/none.py").startswith("error: no file")



SEARCH_BODY = ("\n<function=search>\n<parameter=pattern>\ndef circle_area(\n</parameter>\n"
               "</function>\n")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A scripted model with a Qwen3.5-style tokenizer (qwen3_coder calls, reasoning) whose
    every reply reasons, then calls search(pattern="def circle_area(")."""
    path = build(tmp_path_factory.mktemp("scripted") / "m", family="qwen3_coder", thinking=True,
                 scripts={"default": "Find it.</think>\n\n" + call_text("qwen3_coder", SEARCH_BODY)})
    return mlx_lm.load(str(path))


def test_parse_calls_uses_the_tokenizers_parser(scripted):
    _, tokenizer = scripted
    text = ("Let me look.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
            "<parameter=start_line>\n3\n</parameter>\n</function>\n</tool_call>")
    calls, rest = parse_calls(tokenizer, text, TOOLS)
    assert calls == [{"name": "read_file", "arguments": {"path": "a.py", "start_line": 3}}]  # typed
    assert rest == "Let me look."
    broken = "<tool_call>\nnot a call\n</tool_call>"
    assert parse_calls(tokenizer, broken, TOOLS) == ([], broken)  # kept as text, never dropped


def test_parse_calls_on_a_tokenizer_without_tool_calling():
    """The shipped target has no chat template and no tool parser: its text is all content."""
    tokenizer = mlx_lm.load(str(MODELS_DIR / "target"))[1]
    assert not tokenizer.has_tool_calling
    text = "<tool_call>\n<function=search>\n</function>\n</tool_call> and more"
    assert parse_calls(tokenizer, text, TOOLS) == ([], text)


def test_agent_loop_runs_each_call_on_the_workspace(scripted, workspace):
    """The loop parses each reply's call, runs it, sends the result back, and stops after
    max_calls rounds with the model's next reply (its calls not run)."""
    model, tokenizer = scripted
    query = [{"role": "user", "content": "Where is `circle_area` defined?"}]
    messages = agent_loop(model, tokenizer, workspace, query, max_calls=2)
    replies = [m for m in messages if m["role"] == "assistant"]
    results = [m for m in messages if m["role"] == "tool"]
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * 2 + ["assistant"]
    want = {"name": "search", "arguments": {"pattern": "def circle_area("}}
    for reply in replies:
        assert reply["reasoning_content"] == "Find it." and reply["content"] == ""
        assert [c["function"] for c in reply["tool_calls"]] == [want]
    assert [r["tool_call_id"] for r in results] == [replies[i]["tool_calls"][0]["id"] for i in range(2)]
    assert all(r["content"] == workspace.search("def circle_area(") for r in results)
    assert results[0]["content"] == "shapes/area.py:4: def circle_area(radius):"


def test_agent_loop_returns_an_answer_without_calls(tmp_path, workspace):
    path = build(tmp_path / "m", family="qwen3_coder", thinking=True,
                 scripts={"default": "Known.</think>\n\nIn `shapes/area.py`."})
    model, tokenizer = mlx_lm.load(str(path))
    messages = agent_loop(model, tokenizer, workspace, [{"role": "user", "content": "Where?"}])
    assert messages[1:] == [{"role": "assistant", "content": "In `shapes/area.py`.",
                             "reasoning_content": "Known."}]
