"""Synthetic tool-calling dialogs over Python code, for the demo target's chat training.

A "repository" is a list of ``(relative path, source)`` Python files (the CPython
standard library's training files for training, its held-out files for
evaluation). Each dialog is an OpenAI-style message list (``system`` / ``user`` /
``assistant`` with ``tool_calls`` / ``tool``) plus the tool schemas, rendered by the
target's own chat template. The tools and their schemas are the package's
(``segcache.models.agent``: ``search``, ``read_file``, ``run_tests``), so a demo runs
the very same tools for real on any directory of Python files; in the corpus
``run_tests`` answers with a synthetic pytest summary (the stdlib ships no tests
to run).

Answers are extractive (they quote names, line numbers, signatures, docstrings
and code from the tool results), which a 3.5M-parameter model can learn to do.
Everything is drawn from a ``random.Random(seed)``: the same seed gives the same
dialogs.
"""

from __future__ import annotations

import random

from segcache.models.agent import (  # noqa: F401  (the tools the dialogs call)
    READ_LIMIT,
    SYSTEM_PROMPT,
    TOOLS,
    Definition,
    Workspace,
)


# ------------------------------------------------------------------- phrasing


def _one(rng: random.Random, options):
    return options[rng.randrange(len(options))]


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(reasoning: str, content: str = "", calls: list | None = None) -> dict:
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        message["tool_calls"] = calls
    return message


def _pattern(d: Definition) -> str:
    """What a search for the definition of ``d`` looks for: ``def name(``, ``class Name:``."""
    at = d.header.index(d.name) + len(d.name)
    return d.header[: at + 1]


def _code_block(lines: list[str]) -> str:
    return "```python\n" + "\n".join(lines) + "\n```"


def _dedent(lines: list[str]) -> list[str]:
    indents = [len(l) - len(l.lstrip()) for l in lines if l.strip()]
    cut = min(indents) if indents else 0
    return [l[cut:] for l in lines]


class DialogMaker:
    """Draws dialogs over one workspace from one seeded generator."""

    def __init__(self, workspace: Workspace, seed: int):
        self.ws = workspace
        self.rng = random.Random(seed)
        self.defs = [d for d in workspace.definitions if d.end - d.line <= 60]
        self.by_name: dict[str, list[Definition]] = {}
        for d in workspace.definitions:
            self.by_name.setdefault(d.name, []).append(d)
        # names defined once: a search for them finds the one definition to read
        self.unique = [d for d in self.defs if len(self.by_name[d.name]) == 1]

    # Each kind returns (messages after the system message, uses tools).

    def where_defined(self):
        """search for the definition, answer with file and line."""
        d = _one(self.rng, self.defs)
        q = _one(self.rng, [
            f"Where is `{d.name}` defined?", f"Where is {d.name} defined?",
            f"Find the definition of `{d.name}`.", f"In which file is `{d.name}` defined?",
            f"Where can I find the {'class' if d.kind == 'class' else 'function'} `{d.name}`?",
        ])
        pattern = _pattern(d)
        think = _one(self.rng, [f"I will search for `{pattern}`.",
                                f"Search the code for the definition of {d.name}.",
                                f"The definition starts with `{pattern}`; search for it."])
        result = self.ws.search(pattern)
        hits = [h for h in result.split("\n") if ":" in h and not h.startswith("(")]
        places = [h.split(": ", 1)[0] for h in hits if h.split(": ", 1)[1].startswith(pattern)]
        if not places:
            return None
        places = [p.rsplit(":", 1) for p in places]
        if len(places) == 1:
            path, line = places[0]
            answer = f"`{d.name}` is defined in `{path}` at line {line}:\n\n" + _code_block(
                [self.ws.files[path][int(line) - 1].strip()])
        else:
            answer = f"`{d.name}` is defined in {len(places)} places:\n" + "\n".join(
                f"- `{p}` line {l}" for p, l in places)
        return [
            {"role": "user", "content": q},
            _assistant(think, calls=[_call("search", pattern=pattern)]),
            {"role": "tool", "content": result},
            _assistant(_one(self.rng, ["The search found it.", "I have the location.", ""]),
                       content=answer),
        ]

    def explain(self):
        """search, read the definition, answer with signature and docstring."""
        d = _one(self.rng, self.unique)
        in_path = self.rng.random() < 0.5
        q = _one(self.rng, [
            f"What does `{d.name}` do?", f"Explain `{d.name}`.", f"What is {d.name} for?",
            f"Show me the code of `{d.name}`.", f"How does `{d.name}` work?",
        ])
        if in_path:
            q = q.rstrip(".?") + f" in `{d.path}`" + q[-1]
        pattern = _pattern(d)
        search = self.ws.search(pattern, d.path if in_path else ".")
        start, end = d.line, min(d.end, d.line + READ_LIMIT - 1)
        lines = self.ws.files[d.path][start - 1:end]
        body = self.ws.read_file(d.path, start, end)
        summary = (f"The docstring says: {d.doc}" if d.doc else
                   "It has no docstring; the code above shows what it does.")
        answer = (f"`{d.name}` is at line {d.line} of `{d.path}`:\n\n" + _code_block(
            _dedent(lines[:min(len(lines), 10)])) + f"\n\n{summary}")
        return [
            {"role": "user", "content": q},
            _assistant(_one(self.rng, [f"First find where `{d.name}` is defined.",
                                       f"I need the source of {d.name}; search for it."]),
                       calls=[_call("search", pattern=pattern,
                                    **({"path": d.path} if in_path else {}))]),
            {"role": "tool", "content": search},
            _assistant(_one(self.rng, [f"It is at line {d.line} of {d.path}; read it.",
                                       f"Read {d.path} from line {d.line}."]),
                       calls=[_call("read_file", path=d.path, start_line=start, end_line=end)]),
            {"role": "tool", "content": body},
            _assistant("", content=answer),
        ]

    def show_lines(self):
        """read the lines asked for, answer with them as code."""
        path = _one(self.rng, [p for p, lines in self.ws.files.items() if len(lines) > 30])
        n = len(self.ws.files[path])
        start = self.rng.randrange(1, n - 10)
        end = min(n, start + self.rng.randrange(4, 16))
        q = _one(self.rng, [f"Show me lines {start}-{end} of {path}.",
                            f"Read `{path}` from line {start} to {end}.",
                            f"What is on lines {start} to {end} of `{path}`?"])
        body = self.ws.read_file(path, start, end)
        answer = f"Lines {start}-{end} of `{path}`:\n\n" + _code_block(
            self.ws.files[path][start - 1:end])
        return [
            {"role": "user", "content": q},
            _assistant(_one(self.rng, ["Read those lines.", f"I will read {path}.", ""]),
                       calls=[_call("read_file", path=path, start_line=start, end_line=end)]),
            {"role": "tool", "content": body},
            _assistant("", content=answer),
        ]

    def _test_report(self, module: str, path: str):
        """A synthetic pytest summary for `path`: (text, failed [(test, error)], total)."""
        names = [d.name for d in self.ws.definitions if d.path == module and d.kind == "def"
                 and not d.name.startswith("_")]
        names = sorted(set(names))[:12] or ["basic"]
        total = len(names) + self.rng.randrange(0, 4)
        tests = [f"test_{n}" for n in names] + [f"test_case_{i}" for i in range(total - len(names))]
        failed = []
        if self.rng.random() < 0.6:
            for t in self.rng.sample(tests, min(len(tests), self.rng.randrange(1, 3))):
                error = _one(self.rng, ["AssertionError: assert 1 == 2",
                                        "TypeError: unsupported operand type(s)",
                                        "ValueError: invalid literal for int()",
                                        "KeyError: 'name'", "AttributeError: 'NoneType' object"])
                failed.append((t, error))
        lines = [f"collected {total} items", ""]
        lines += [f"FAILED {path}::{t} - {e}" for t, e in failed]
        passed = total - len(failed)
        lines.append(f"{len(failed)} failed, {passed} passed" if failed else f"{passed} passed")
        return "\n".join(lines), failed, total

    def run_tests(self):
        """run the tests asked for, answer with the outcome."""
        module = _one(self.rng, sorted({d.path for d in self.defs}))
        stem = module.rsplit("/", 1)[-1][:-3]
        path = f"tests/test_{stem}.py"
        q = _one(self.rng, [f"Run the tests in {path}.", f"Do the tests in `{path}` pass?",
                            f"Run `{path}` and tell me what fails.",
                            f"Please run the {stem} tests ({path})."])
        report, failed, total = self._test_report(module, path)
        if failed:
            answer = f"{len(failed)} of {total} tests failed:\n" + "\n".join(
                f"- `{t}`: {e}" for t, e in failed)
        else:
            answer = f"All {total} tests in `{path}` passed."
        return [
            {"role": "user", "content": q},
            _assistant(_one(self.rng, ["Run them.", f"I will run {path}.", ""]),
                       calls=[_call("run_tests", path=path)]),
            {"role": "tool", "content": report},
            _assistant("", content=answer),
        ]

    def complete(self):
        """no tool: the user pastes the start of a function, the answer completes it."""
        d = _one(self.rng, [d for d in self.defs if 4 <= d.end - d.line <= 25])
        lines = _dedent(self.ws.files[d.path][d.line - 1:d.end])
        cut = self.rng.randrange(1, max(2, len(lines) // 2))
        q = _one(self.rng, ["Complete this code:", "Finish this function:",
                            "How would this continue?"]) + "\n\n" + _code_block(lines[:cut])
        return [
            {"role": "user", "content": q},
            _assistant(_one(self.rng, ["", "No tool is needed for this."]),
                       content=_code_block(lines)),
        ]

    KINDS = {"where_defined": 0.25, "explain": 0.35, "show_lines": 0.1, "run_tests": 0.2,
             "complete": 0.1}

    def exchange(self) -> tuple[str, list[dict]]:
        """One user query and what follows it, of a kind drawn by ``KINDS``."""
        while True:
            kind = self.rng.choices(list(self.KINDS), weights=list(self.KINDS.values()))[0]
            made = getattr(self, kind)()
            if made:
                return kind, made

    def dialog(self, fits=None, max_exchanges: int = 4) -> dict:
        """One dialog: ``{"messages", "tools", "enable_thinking", "kinds"}``.

        Queries are added (up to ``max_exchanges``) while ``fits(dialog)`` holds;
        the first one is always kept. Thinking is on for 70% of dialogs, tools are
        offered unless every query is a plain completion (then in half of them).
        """
        thinking = self.rng.random() < 0.7
        system = [{"role": "system", "content": SYSTEM_PROMPT}] if self.rng.random() < 0.7 else []
        wanted = self.rng.randrange(1, max_exchanges + 1)
        tools_draw = self.rng.random()
        kinds, turns, best = [], [], None
        while len(kinds) < wanted:
            kind, made = self.exchange()
            if not thinking:
                made = [dict(m, reasoning_content="") if m["role"] == "assistant" else m
                        for m in made]
            candidate_kinds = kinds + [kind]
            with_tools = any(k != "complete" for k in candidate_kinds) or tools_draw < 0.5
            candidate = {"messages": system + turns + made, "tools": TOOLS if with_tools else None,
                         "enable_thinking": thinking, "kinds": candidate_kinds}
            if best is not None and fits is not None and not fits(candidate):
                break
            best, kinds, turns = candidate, candidate_kinds, turns + made
        return best


def drill(maker: DialogMaker, exchanges: int = 5) -> dict:
    """A conversation of short exchanges without tool schemas: practice at copying.

    Each exchange is a query and the call it asks for (names, paths and line
    numbers copied from the query), and for some kinds the result and what
    follows it (a path and a line copied from a search result into an answer or
    the next call). Long results are left out, so a 512-token window holds
    several exchanges; the dialogs keep teaching the whole exchange.
    """
    keep = {"where_defined": 4, "run_tests": 4, "show_lines": 2, "explain": 4}
    turns, kinds = [], []
    while len(kinds) < exchanges:
        kind = maker.rng.choice(list(keep))
        made = getattr(maker, kind)()
        if made:
            turns += made[:keep[kind]]
            kinds.append(kind)
    thinking = maker.rng.random() < 0.7
    if not thinking:
        turns = [dict(m, reasoning_content="") if m["role"] == "assistant" else m for m in turns]
    return {"messages": turns, "tools": None, "enable_thinking": thinking, "kinds": kinds}


def render(tokenizer, dialog: dict) -> tuple[list[int], list[int]]:
    """Token ids of a dialog rendered by the chat template, and the loss mask.

    The mask is 1 on the tokens of every assistant turn (what follows
    ``<|im_start|>assistant\n``, through its ``<|im_end|>``) and 0 elsewhere. Turns
    before the last user query are rendered without their ``<think>`` block (as the
    template renders history); they still teach which tool to call with which
    arguments and how to answer from a result, at no extra cost per dialog.
    """
    text = tokenizer.apply_chat_template(dialog["messages"], tools=dialog["tools"],
                                         tokenize=False,
                                         enable_thinking=dialog["enable_thinking"])
    head = "<|im_start|>assistant\n"
    spans, at = [], text.find(head)
    while at >= 0:
        end = text.index("<|im_end|>", at) + len("<|im_end|>")
        spans.append((at + len(head), end))
        at = text.find(head, end)
    encoding = tokenizer._tokenizer.backend_tokenizer.encode(text, add_special_tokens=False) \
        if hasattr(tokenizer, "_tokenizer") else tokenizer.backend_tokenizer.encode(
            text, add_special_tokens=False)
    mask = [int(any(a <= s and e <= b for a, b in spans)) for s, e in encoding.offsets]
    return encoding.ids, mask
