"""The tools the demo target's chat stages teach, and an agent loop that runs them in-process.

The chat stages of tools/train_demo.py (dialogs from tools/demo_dialogs.py) train
a target on dialogs that call these three tools, with these schemas, on Python
code. The shipped target is not one of those yet (their code quality did not
hold: see segcache/models/README.md), so it has no chat template and a server
refuses ``tools`` for it; the loop below works with any tokenizer that has
mlx-lm tool calling.

* ``search(pattern, path=".")``: the lines of ``.py`` files containing
  ``pattern``, as ``path:line: text``, at most ``SEARCH_LIMIT``;
* ``read_file(path, start_line=1, end_line=...)``: numbered lines, at most
  ``READ_LIMIT`` of them;
* ``run_tests(path)``: pytest's summary for a file or directory.

:class:`Workspace` implements them on any directory of Python files, so a demo,
a test or a bench can run a real tool-calling loop, in-process
(:func:`agent_loop`) or through a server (the same ``TOOLS`` to send and
``Workspace.call`` to execute what comes back).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mlx_lm import generate

SYSTEM_PROMPT = "You are a coding assistant working in a Python repository."  # as in training
SEARCH_LIMIT = 5
READ_LIMIT = 20
RUN_TESTS_TIMEOUT = 300  # seconds

TOOLS = [
    {"type": "function", "function": {
        "name": "search",
        "description": "Find the lines of the repository's Python files that contain a text.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"},
            "path": {"type": "string", "description": "file or directory (default: all)"},
        }, "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read numbered lines of a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"},
            "start_line": {"type": "integer"},
            "end_line": {"type": "integer"},
        }, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests",
        "description": "Run the tests in a file or directory with pytest.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"},
        }, "required": ["path"]}}},
]


@dataclass
class Definition:
    """A function or class of the repository."""

    path: str
    name: str
    kind: str  # "def" or "class"
    line: int  # 1-based line of the `def` / `class` keyword
    end: int
    header: str  # the stripped source line at `line`
    doc: str  # first line of the docstring, or ""


@dataclass
class Workspace:
    """The repository the tools act on: files and their definitions."""

    files: dict[str, list[str]]
    definitions: list[Definition] = field(default_factory=list)
    _texts: dict[str, str] = field(default_factory=dict, repr=False)  # search's fast path
    root: Path | None = None  # where run_tests runs (from_directory)

    @classmethod
    def from_sources(cls, sources: list[tuple[str, str]]) -> "Workspace":
        """Indexes ``(path, text)`` sources: their lines and their defs/classes."""
        files, definitions = {}, []
        for path, text in sources:
            lines = text.splitlines()
            files[path] = lines
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                line = next((n for n in range(node.lineno, min(node.lineno + 40, len(lines) + 1))
                             if lines[n - 1].lstrip().startswith(("def ", "async def ", "class "))),
                            None)
                if line is None or node.name.startswith("__"):
                    continue
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
                definitions.append(Definition(
                    path=path, name=node.name,
                    kind="class" if isinstance(node, ast.ClassDef) else "def",
                    line=line, end=node.end_lineno or line, header=lines[line - 1].strip(),
                    doc=doc if len(doc) <= 120 else ""))
        return cls(files, definitions)

    @classmethod
    def from_directory(cls, root) -> "Workspace":
        """The ``.py`` files under ``root`` (paths relative to it); tests run there."""
        root = Path(root)
        sources = []
        for file in sorted(root.rglob("*.py")):
            try:
                sources.append((file.relative_to(root).as_posix(), file.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, OSError):
                continue
        workspace = cls.from_sources(sources)
        workspace.root = root
        return workspace

    def call(self, name: str, arguments: dict) -> str:
        """Runs tool ``name``; a bad call is answered with an error text, as a tool would."""
        tools = {"search": self.search, "read_file": self.read_file, "run_tests": self.run_tests}
        if name not in tools:
            return f"error: no tool {name!r}; the tools are {', '.join(tools)}"
        try:
            return tools[name](**arguments)
        except (TypeError, ValueError) as e:
            return f"error: {name}: {e}"

    def run_tests(self, path: str) -> str:
        """Tool ``run_tests``: ``pytest -q -rf PATH`` in the workspace's directory (tail)."""
        if self.root is None:
            return "error: this workspace has no directory to run tests in"
        if not (self.root / path).exists():
            return f"error: no file or directory {path}"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
                               path], cwd=self.root, capture_output=True, text=True,
                              timeout=RUN_TESTS_TIMEOUT)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        return "\n".join(lines[-12:]) or f"pytest exited with {done.returncode}"

    def search(self, pattern: str, path: str = ".") -> str:
        """Tool ``search``: ``path:line: text`` of matching lines, at most SEARCH_LIMIT."""
        hits = []
        for name in sorted(self.files):
            if path not in (".", "") and not (name == path or name.startswith(path.rstrip("/") + "/")):
                continue
            if pattern not in self._texts.setdefault(name, "\n".join(self.files[name])):
                continue
            for i, line in enumerate(self.files[name], 1):
                if pattern in line:
                    hits.append(f"{name}:{i}: {line.strip()}")
        if not hits:
            return f"no matches for {pattern!r}"
        more = len(hits) - SEARCH_LIMIT
        return "\n".join(hits[:SEARCH_LIMIT] + ([f"({more} more)"] if more > 0 else []))

    def read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> str:
        """Tool ``read_file``: numbered lines ``start_line..end_line``, at most READ_LIMIT."""
        if path not in self.files:
            return f"error: no file {path}"
        lines = self.files[path]
        start = max(1, int(start_line))
        end = min(len(lines), int(end_line) if end_line else start + READ_LIMIT - 1,
                  start + READ_LIMIT - 1)
        if start > len(lines):
            return f"error: {path} has {len(lines)} lines"
        return "\n".join(f"{i}: {lines[i - 1]}" for i in range(start, end + 1))


def agent_loop(model, tokenizer, workspace: Workspace, messages: list[dict], *,
               tools: list[dict] = TOOLS, max_calls: int = 4, max_tokens: int = 256,
               enable_thinking: bool = True) -> list[dict]:
    """Runs the model on ``messages`` until it answers without a tool call.

    Each reply is generated greedily (``mlx_lm.generate``) from the chat template,
    its ``<tool_call>`` blocks parsed with the tokenizer's own mlx-lm parser, each
    call executed by ``workspace`` and its result appended as a ``tool`` message.
    Markup that does not parse stays in the reply's text.

    Returns:
        The messages with the model's turns (``reasoning_content``, ``content``,
        ``tool_calls``) and the tool results appended. The last is the answer, or,
        after ``max_calls`` rounds of calls, the model's next reply with its calls
        not run.
    """
    messages = list(messages)
    for n in range(max_calls + 1):
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                               enable_thinking=enable_thinking)
        text = generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens)
        reasoning, _, rest = text.partition(tokenizer.think_end)
        if not _:
            reasoning, rest = "", text
        calls, content = parse_calls(tokenizer, rest, tools)
        reply = {"role": "assistant", "content": content, "reasoning_content": reasoning.strip()}
        if calls:
            reply["tool_calls"] = [{"id": f"call_{n}_{i}", "type": "function", "function": c}
                                   for i, c in enumerate(calls)]
        messages.append(reply)
        if not calls or n == max_calls:
            return messages
        for call in reply["tool_calls"]:
            function = call["function"]
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": workspace.call(function["name"], function["arguments"])})
    return messages


def parse_calls(tokenizer, text: str, tools=None) -> tuple[list[dict], str]:
    """The ``{"name", "arguments"}`` calls in ``text`` and the text around them."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    if start is None:  # a tokenizer without tool calling: all text
        return [], text.strip()
    calls, kept = [], []
    while start in text:
        before, _, after = text.partition(start)
        body, closed, text = after.partition(end)
        kept.append(before)
        try:
            calls.append(tokenizer.tool_parser(body, tools))
        except Exception:  # mlx-lm's parsers raise ValueError, JSON errors, ...
            kept.append(start + body + closed)
    kept.append(text)
    return calls, "".join(kept).strip()
