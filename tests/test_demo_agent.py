"""The demo target's tools (segcache.models.agent) and a tool-calling loop on the shipped target."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import textwrap

import mlx_lm
import pytest

from segcache.demo import MODELS_DIR
from segcache.models.agent import READ_LIMIT, TOOLS, Workspace, agent_loop, parse_calls

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


@pytest.fixture(scope="module")
def target():
    return mlx_lm.load(str(MODELS_DIR / "target"))


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


def test_parse_calls_uses_the_tokenizers_parser(target):
    _, tokenizer = target
    text = ("Let me look.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
            "<parameter=start_line>\n3\n</parameter>\n</function>\n</tool_call>")
    calls, rest = parse_calls(tokenizer, text, TOOLS)
    assert calls == [{"name": "read_file", "arguments": {"path": "a.py", "start_line": 3}}]
    assert rest == "Let me look."
    broken = "<tool_call>\nnot a call\n</tool_call>"
    assert parse_calls(tokenizer, broken, TOOLS) == ([], broken)  # kept as text, never dropped


def test_agent_loop_on_the_shipped_target(target, workspace):
    """A real loop: the model calls a tool, the workspace runs it, the model answers."""
    model, tokenizer = target
    query = [{"role": "user", "content": "Where is `circle_area` defined?"}]
    messages = agent_loop(model, tokenizer, workspace, query, max_calls=3)
    calls = [m for m in messages if m.get("tool_calls")]
    results = [m for m in messages if m["role"] == "tool"]
    assert calls and len(results) == sum(len(m["tool_calls"]) for m in calls)
    first = calls[0]["tool_calls"][0]["function"]
    assert first == {"name": "search", "arguments": {"pattern": "def circle_area("}}
    assert results[0]["content"] == "shapes/area.py:4: def circle_area(radius):"
    answer = messages[-1]
    assert answer["role"] == "assistant" and "tool_calls" not in answer
    assert "`shapes/area.py`" in answer["content"] and "line 4" in answer["content"]
