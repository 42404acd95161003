"""A scripted coding-agent session against `segcache serve` and `mlx_lm.server`; TTFT and cached tokens per turn.

    python bench/agent.py [--model DIR] [--tokens 32] [--sessions 3] [--turns 4] [--mlx-blas same|wheel]
                          [--template model|qwen3] [--no-mlx-lm] [--no-anthropic]
    python bench/agent.py --claude-code [--turns 6] [--repeats 3] ...   (bench/claude_code.py)

The trace, through the official `openai` client (streamed, greedy), on both
servers started on the same model (the shipped hybrid target by default):

  cold          session 1, turn 1: system prompt + a shared repository overview + tool
                schemas of about 2,000 tokens, and a task
  2nd session   sessions 2 and 3, turn 1: the same context, other tasks
  turns         turns 2..N of each session: the history grows by the model's answer
                (its tool calls, or a nudge when it made none) and the tools' results
  follow-up     a new user message in session 1 after its agent loop (a template that
                drops earlier reasoning at a new question re-renders the history here)
  regenerate    session 1's last request again
  restart       the server restarts (SIGTERM), then session 2's last request again

then the same trace through the `anthropic` client against segcache alone.
A model without a chat template or a tool parser (the shipped target before
it learned tools) is served from a copy that adds the bench's Qwen3-style
template (`--template qwen3` forces it): tools in the system prompt, calls as
`<tool_call>` JSON, tool results as `<tool_response>` user turns, and the
reasoning of assistant turns before the last question dropped, as Qwen3's
template does.

For each request it prints the prompt tokens, `cached_tokens`, and where the
rest went: the new messages (the prompt past the previous request's
conversation), the template's re-rendering (the previous conversation's
tokens that this prompt renders differently), and the store's own miss (the
part of the shared prefix that was recomputed anyway: a hybrid model resumes
only at a checkpoint). Time to first token is measured at the client:
request sent -> first chunk with text, reasoning or a tool call. It ends
with the summed TTFT of both servers, the restart speed-up, and whether the
two servers parsed the same tool calls at every step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import segcache  # noqa: F401, I001  (binds OpenBLAS before mlx loads)

import claude_code  # bench/claude_code.py
from serve import MODELS, ROOT, Proc, _port  # bench/serve.py

# A Qwen3-style chat template (written for this bench): tools in the system turn,
# calls as <tool_call> JSON, results as <tool_response> user turns, reasoning kept
# only for the assistant turns after the last real question.
QWEN3_STYLE = r"""{%- set nl = '\n' -%}
{%- if tools -%}
<|im_start|>system{{ nl }}{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ nl }}{{ nl }}{% endif -%}
# Tools{{ nl }}{{ nl }}You may call one or more functions. Their signatures, inside <tools></tools>:{{ nl }}<tools>
{%- for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>{{ nl }}{{ nl -}}
Call one as a JSON object inside <tool_call></tool_call> tags:{{ nl }}<tool_call>{{ nl -}}
{"name": <function-name>, "arguments": <args-json-object>}{{ nl }}</tool_call><|im_end|>{{ nl }}
{%- elif messages[0].role == 'system' -%}
<|im_start|>system{{ nl }}{{ messages[0].content }}<|im_end|>{{ nl }}
{%- endif -%}
{%- set ns = namespace(last_query=messages|length - 1, searching=true) -%}
{%- for m in messages[::-1] -%}
{%- if ns.searching and m.role == 'user' -%}{%- set ns.searching = false -%}{%- set ns.last_query = messages|length - 1 - loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'assistant' -%}
<|im_start|>assistant{{ nl }}
{%- if loop.index0 > ns.last_query and m.reasoning_content -%}
<think>{{ nl }}{{ m.reasoning_content.strip(nl) }}{{ nl }}</think>{{ nl }}{{ nl }}{{ m.content.lstrip(nl) }}
{%- else -%}{{ m.content }}{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{%- if not loop.first or m.content %}{{ nl }}{% endif -%}
<tool_call>{{ nl }}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}{{ nl }}</tool_call>
{%- endfor -%}<|im_end|>{{ nl }}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif -%}
{{ nl }}<tool_response>{{ nl }}{{ m.content }}{{ nl }}</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ nl }}{% endif -%}
{%- else -%}
<|im_start|>{{ m.role }}{{ nl }}{{ m.content }}<|im_end|>{{ nl }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% if enable_thinking is defined and enable_thinking is false %}<think>{{ nl }}{{ nl }}</think>{{ nl }}{{ nl }}{% endif %}{% endif -%}
"""


def _tool(name: str, summary: str, params: dict, required: list) -> dict:
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {"type": "function", "function": {"name": name, "description": summary, "parameters": {
        "type": "object", "properties": props, "required": required}}}


PATH = ("string", "Path of the file, relative to the repository root, with forward slashes.")
TOOLS = [
    _tool("read_file", "Read a text file of the repository and return its content with line numbers. Use it "
          "before editing a file, and read only the range you need for large files.",
          {"path": PATH, "start_line": ("integer", "First line to return, 1-based (default 1)."),
           "end_line": ("integer", "Last line to return, inclusive (default: the end of the file).")}, ["path"]),
    _tool("search", "Search the repository for a regular expression (Python syntax) and return the matching "
          "lines with their file and line number, at most 100 matches, sorted by file.",
          {"pattern": ("string", "The regular expression to look for."),
           "glob": ("string", "Only search files whose path matches this glob, e.g. 'src/**/*.py'."),
           "ignore_case": ("boolean", "Match without regard to case (default false).")}, ["pattern"]),
    _tool("list_dir", "List the entries of a directory of the repository: names, kinds and sizes in bytes, "
          "directories first, hidden entries included.",
          {"path": ("string", "Directory path relative to the root; '.' for the root."),
           "depth": ("integer", "How many levels to descend (default 1, at most 4).")}, ["path"]),
    _tool("run_tests", "Run the test suite, or a part of it, with pytest and return the summary and the first "
          "failures with their tracebacks. Tests run in a fresh process with a time limit of five minutes.",
          {"selector": ("string", "A pytest node id or path, e.g. 'tests/test_app.py::test_main'; empty for all."),
           "keyword": ("string", "Only run tests whose names match this -k expression."),
           "last_failed": ("boolean", "Run only the tests that failed last time (default false).")}, []),
    _tool("apply_patch", "Apply a unified diff to the repository. The patch must apply cleanly; nothing is "
          "changed when any hunk fails, and the failing hunks are returned with the reason.",
          {"patch": ("string", "The unified diff, with a/ and b/ prefixes and at least three lines of context.")},
          ["patch"]),
    _tool("write_file", "Create or replace a whole file with the given content; parent directories are created. "
          "Prefer apply_patch for small changes to existing files.",
          {"path": PATH, "content": ("string", "The complete new content of the file.")}, ["path", "content"]),
    _tool("git_diff", "Show the uncommitted changes of the working tree as a unified diff, optionally for "
          "some paths only, with statistics per file.",
          {"paths": ("array", "Restrict the diff to these paths."),
           "staged": ("boolean", "Show the staged changes instead (default false).")}, []),
    _tool("run_command", "Run a shell command in the repository root with a time limit and return its exit "
          "code, standard output and standard error, each cut to 20,000 characters.",
          {"command": ("string", "The command line, run by /bin/sh."),
           "timeout": ("integer", "Seconds before the command is killed (default 120, at most 600).")},
          ["command"]),
    _tool("find_definition", "Find where a Python name (function, class, method or module-level variable) is "
          "defined, using the repository's import graph, and return the file, line and signature.",
          {"name": ("string", "The name, optionally qualified, e.g. 'Server.start' or 'app.main'.")}, ["name"]),
]
# Claude Code's own tools beyond the bench's (--claude-code sends 10+)
CLAUDE_CODE_TOOLS = [
    _tool("todo_write", "Replace the session's task list: each item with its content and status (pending, "
          "in_progress, completed). Keep exactly one item in progress.",
          {"todos": ("array", "The whole list, in order.")}, ["todos"]),
    _tool("glob", "Find files whose path matches a glob pattern, newest first, at most 200 paths.",
          {"pattern": ("string", "The glob, e.g. 'src/**/*.py'."),
           "path": ("string", "The directory to search from (default: the root).")}, ["pattern"]),
    _tool("web_fetch", "Fetch a URL and return its content as Markdown, cut to 50,000 characters.",
          {"url": ("string", "An http(s) URL."), "prompt": ("string", "What to extract from the page.")},
          ["url"]),
]
SYSTEM = ("You are a coding agent working in a Python repository. Read before you change anything, keep "
          "changes small, run the tests after each change, and explain what you did in one paragraph at "
          "the end. Use the tools; do not invent file contents.\n\nRepository overview:\n")
TASKS = [
    "The date parser rejects ISO week dates like 2024-W05-3. Find where dates are parsed and add support.",
    "test_http_reader fails on a chunked body with trailing headers. Find out why and fix it.",
    "Add a --verbose flag to the command line that logs every request, and document it.",
]
FOLLOW_UP = "Good. Now also handle lower-case week designators (2024-w05-3) and add a test for it."
NUDGE = "Use the tools: call read_file on {path} first."
FILES = ["src/dates.py", "src/http/reader.py", "src/cli.py", "tests/test_dates.py", "tests/test_http.py",
         "README.md", "src/config.py", "src/util.py"]


DEMO_TASKS = [
    "Where is the size of a prefix store budget parsed from the command line? Show me the function.",
    "Which function checks that a draft model shares the target's vocabulary? Read it.",
    "Find where a chat template is rendered for a request and read that code.",
]


class Setup:
    """What the agent sends and how its tools answer: tools, system prompt, tasks.

    With the shipped target's own tools (segcache.models.agent) the three it learned
    (search, read_file, run_tests) run on this repository's source, and the bench's
    other tools pad the schemas to about 2,000 tokens; otherwise all tools are the
    bench's, answered with slices of a held-out corpus.
    """

    def __init__(self, corpus: str, overview: str, demo: bool):
        self.corpus = corpus
        self.workspace = None
        self.tools, self.system, self.tasks = TOOLS, SYSTEM + overview, TASKS
        if demo:
            from segcache.models import agent as demo_agent

            self.workspace = demo_agent.Workspace.from_directory(ROOT / "src")
            names = {t["function"]["name"] for t in demo_agent.TOOLS}
            self.tools = demo_agent.TOOLS + [t for t in TOOLS if t["function"]["name"] not in names]
            self.system = demo_agent.SYSTEM_PROMPT
            self.tasks = DEMO_TASKS
        self.names = {t["function"]["name"] for t in self.tools}

    def execute(self, call: dict) -> str:
        """A tool's answer to `call` ({"name", "arguments" as JSON text})."""
        if self.workspace is not None and call["name"] in ("search", "read_file", "run_tests"):
            try:
                args = json.loads(call["arguments"] or "{}")
            except json.JSONDecodeError:
                return "error: the arguments are not JSON"
            if call["name"] == "run_tests":
                return "3 passed in 0.41s"  # not run: the bench times the server, not pytest
            return self.workspace.call(call["name"], args if isinstance(args, dict) else {})
        key = sum(ord(c) for c in json.dumps(call, sort_keys=True)) % max(1, len(self.corpus) - 2000)
        return self.corpus[key: key + 700]


def prepare_model(model: str, work: Path, force: bool) -> tuple[Path, str]:
    """The model directory to serve: `model`, or a copy with the bench's template and the
    json_tools parser when it has no template or no tool parser (or `force`)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(Path(model))
    if tok.has_chat_template and tok.has_tool_calling and not force:
        return Path(model), "its own chat template"
    copy = work / "model"
    copy.mkdir()
    for f in Path(model).iterdir():
        if f.suffix == ".safetensors":
            os.symlink(f.resolve(), copy / f.name)
        elif f.is_file() and f.name != "chat_template.jinja":  # the template goes in tokenizer_config
            shutil.copy(f, copy / f.name)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg.update(chat_template=QWEN3_STYLE, tool_parser_type="json_tools")
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return copy, "the bench's Qwen3-style template (json_tools calls)"


class Trace:
    """One server's pass over the trace; its records and the tool calls it parsed."""

    def __init__(self, name: str, client, prompter, tokens: int, setup: Setup):
        self.name, self.client, self.prompter, self.tokens = name, client, prompter, tokens
        self.setup = setup
        self.records: list[dict] = []
        self.sessions: list[list[dict]] = []
        self.last: dict[int, list[dict]] = {}  # session -> its last request's messages
        self.prev: dict[int, list[dict]] = {}  # session -> the messages of its previous request

    def request(self, phase: str, s: int, messages: list[dict]) -> dict:
        from segcache.serve.chat import template_messages

        tic = time.perf_counter()
        ttft, content, reasoning, calls, usage = None, "", "", {}, None
        stream = self.client.chat.completions.create(
            model="default_model", messages=messages, tools=self.setup.tools, max_tokens=self.tokens,
            temperature=0.0,
            stream=True, stream_options={"include_usage": True})
        for ev in stream:
            if ev.usage is not None:
                usage = ev.usage
            if not ev.choices:
                continue
            d = ev.choices[0].delta
            got = (d.content or "") + (getattr(d, "reasoning_content", None) or getattr(d, "reasoning", None) or "")
            if (got or d.tool_calls) and ttft is None:
                ttft = time.perf_counter() - tic
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or getattr(d, "reasoning", None) or ""
            for tc in d.tool_calls or []:
                calls[len(calls)] = {"name": tc.function.name, "arguments": tc.function.arguments}
        ttft = ttft if ttft is not None else time.perf_counter() - tic
        ids = self.prompter.chat(template_messages(messages), self.setup.tools).ids
        prev = self.prev.get(s)
        conv = lcp = 0
        if prev is not None:
            old = self.prompter.chat(template_messages(prev), self.setup.tools)
            conv = old.checkpoints[-1] if old.checkpoints else 0  # the previous conversation's end
            lcp = next((i for i, (a, b) in enumerate(zip(ids, old.ids)) if a != b), min(len(ids), len(old.ids)))
            lcp = min(lcp, conv)
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        rec = dict(server=self.name, phase=phase, session=s, prompt=len(ids), cached=cached, ttft=ttft,
                   new=len(ids) - conv if prev is not None else None, rerender=conv - lcp,
                   store_miss=max(0, lcp - cached) if prev is not None else None,
                   calls=[calls[i] for i in sorted(calls)], content=content, reasoning=reasoning,
                   usage_prompt=usage.prompt_tokens if usage else None)
        self.records.append(rec)
        self.prev[s] = messages
        self.last[s] = messages
        print(f"  {self.name:<14} {phase:<12} s{s + 1} prompt {rec['prompt']:>5} cached {cached:>5} "
              f"ttft {ttft * 1000:7.0f} ms  calls {[c['name'] for c in rec['calls']]}", flush=True)
        return rec

    def step(self, phase: str, s: int, messages: list[dict], turn: int) -> list[dict]:
        """One request, and the history the agent sends next."""
        rec = self.request(phase, s, messages)
        msg = {"role": "assistant", "content": rec["content"]}
        if rec["reasoning"]:
            msg["reasoning_content"] = rec["reasoning"]
        if rec["calls"]:
            ids = [f"call_{s}_{turn}_{i}" for i in range(len(rec["calls"]))]
            msg["tool_calls"] = [{"id": i, "type": "function", "function": c} for i, c in zip(ids, rec["calls"])]
            results = [{"role": "tool", "tool_call_id": i, "content": self.setup.execute(c)}
                       for i, c in zip(ids, rec["calls"])]
            return messages + [msg] + results
        nudge = NUDGE.format(path=FILES[(s * 3 + turn) % len(FILES)])
        return messages + [msg, {"role": "user", "content": nudge}]


def run_openai(name: str, proc: Proc, prompter, args, setup: Setup) -> Trace:
    proc.start()
    t = Trace(name, proc.client(), prompter, args.tokens, setup)
    try:
        histories = []
        for s in range(args.sessions):
            msgs = [{"role": "system", "content": setup.system},
                    {"role": "user", "content": setup.tasks[s % len(setup.tasks)]}]
            histories.append(t.step("cold" if s == 0 else "2nd session", s, msgs, 0))
        for turn in range(1, args.turns):
            for s in range(args.sessions):
                histories[s] = t.step("turns", s, histories[s], turn)
        t.step("follow-up", 0, histories[0] + [{"role": "user", "content": FOLLOW_UP}], args.turns)
        t.request("regenerate", 0, t.last[0])
        proc.stop()
        proc.start()
        t.client = proc.client()
        t.request("restart", 1 % args.sessions, t.last[1 % args.sessions])
    finally:
        proc.stop()
    return t


def run_anthropic(proc: Proc, args, setup: Setup) -> list[dict]:
    """The sessions through the anthropic client (segcache only): TTFT and cache reads per turn."""
    import anthropic

    proc.start()
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{proc.port}", api_key="none", timeout=600,
                                 max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in setup.tools]
    out = []
    try:
        histories = [[{"role": "user", "content": setup.tasks[s % len(setup.tasks)]}] for s in range(args.sessions)]
        for turn in range(args.turns):
            for s in range(args.sessions):
                tic, ttft = time.perf_counter(), None
                with client.messages.stream(model="default_model", max_tokens=args.tokens, system=setup.system,
                                            tools=tools, messages=histories[s]) as stream:
                    for ev in stream:
                        if ev.type == "content_block_delta" and ttft is None:
                            ttft = time.perf_counter() - tic
                    final = stream.get_final_message()
                ttft = ttft if ttft is not None else time.perf_counter() - tic
                u = final.usage
                out.append(dict(session=s, turn=turn, prompt=u.input_tokens + u.cache_read_input_tokens,
                                cached=u.cache_read_input_tokens, ttft=ttft))
                print(f"  anthropic      s{s + 1} t{turn + 1} prompt {out[-1]['prompt']:>5} cached "
                      f"{u.cache_read_input_tokens:>5} ttft {ttft * 1000:7.0f} ms  stop {final.stop_reason}", flush=True)
                blocks = [b.model_dump(include={"type", "text", "thinking", "signature", "id", "name", "input"})
                          for b in final.content]
                uses = [b for b in final.content if b.type == "tool_use"]
                histories[s] = histories[s] + [{"role": "assistant", "content": blocks or [{"type": "text",
                                                                                            "text": ""}]}]
                if uses:
                    results = [{"type": "tool_result", "tool_use_id": b.id,
                                "content": setup.execute({"name": b.name, "arguments": json.dumps(b.input)})}
                               for b in uses]
                    histories[s].append({"role": "user", "content": results})
                else:
                    nudge = NUDGE.format(path=FILES[(s * 3 + turn + 1) % len(FILES)])
                    histories[s].append({"role": "user", "content": nudge})
    finally:
        proc.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODELS / "target"))
    ap.add_argument("--tokens", type=int, default=32, help="tokens per answer at most (default 32)")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4, help="requests per session in its agent loop (default 4)")
    ap.add_argument("--overview-chars", type=int, default=3000, help="repository overview in the system prompt")
    ap.add_argument("--template", choices=["model", "qwen3"], default="model",
                    help="qwen3: serve with the bench's Qwen3-style template even if the model has one")
    ap.add_argument("--scripted", action="store_true",
                    help="serve a scripted hybrid that reasons and calls a tool every turn (segcache.testing.chat) "
                         "with the Qwen3-style template: cached tokens per turn on a template that drops earlier "
                         "reasoning (its timings mean nothing)")
    ap.add_argument("--mlx-blas", choices=["same", "wheel"], default="same")
    ap.add_argument("--no-mlx-lm", action="store_true", help="segcache only")
    ap.add_argument("--no-anthropic", action="store_true", help="skip the anthropic client's pass")
    ap.add_argument("--claude-code", action="store_true",
                    help="the Claude-Code-shaped trace instead (bench/claude_code.py): billing-header nonce, 10+ "
                         "tools, thinking, tool turns, 4 subagents at once, a restart; anthropic client vs "
                         "mlx_lm.server's chat endpoint")
    ap.add_argument("--repeats", type=int, default=3, help="with --claude-code: runs of the trace (default 3)")
    args = ap.parse_args()

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from segcache.serve.chat import Prompter

    work = Path(tempfile.mkdtemp(prefix="segcache-bench-agent-"))
    if args.scripted:
        from segcache.testing.chat import build

        reply = ("<think>\nThe task needs the file first.\n</think>\n\nReading it.\n<tool_call>\n"
                 '{"name": "read_file", "arguments": {"path": "src/dates.py"}}\n</tool_call>')
        args.model = str(build(work / "scripted", arch="qwen3_next", thinking=True, scripts={"default": reply}))
        args.template = "qwen3"
        args.overview_chars = min(args.overview_chars, 1000)  # a character per token: keep prompts short
    model, how = prepare_model(args.model, work, args.template == "qwen3")
    prompter = Prompter(load_tokenizer(model))
    corpus = (MODELS / "heldout_stdlib.txt").read_text()
    overview = (MODELS / "heldout_other.txt").read_text()[: args.overview_chars]
    try:
        import segcache.models.agent  # noqa: F401  (the shipped target's tools, once it learned them)

        demo = how == "its own chat template" and not args.scripted
    except ImportError:
        demo = False
    setup = Setup(corpus, overview, demo)
    probe = [{"role": "user", "content": "x"}]
    tools_tokens = len(prompter.chat(probe, setup.tools).ids) - len(prompter.chat(probe).ids)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    mlx_env, blas = dict(env), "the mlx[cpu] wheel's BLAS"
    libs = glob.glob("/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0")
    if args.mlx_blas == "same" and libs and sys.platform.startswith("linux"):
        mlx_env.update(LD_PRELOAD=libs[0], OPENBLAS_THREAD_TIMEOUT="4")
        blas = f"OpenBLAS, LD_PRELOAD={libs[0]}"
    print(f"model {args.model} with {how}{' and tools' if demo else ''}; tool schemas {tools_tokens} tokens; "
          f"{args.sessions} sessions x "
          f"{args.turns} turns; {args.tokens} tokens per answer")
    print(f"mlx_lm.server on {blas}; logs in {work}")

    def segcache_proc(store: str) -> Proc:
        port = _port()
        return Proc("segcache serve", [sys.executable, "-m", "segcache.cli", "serve", "--model", str(model),
                                       "--port", str(port), "--prompt-cache-dir", str(work / store),
                                       "--log-level", "WARNING"], env, port, work / f"segcache-{store}.log")

    def mlx_proc() -> Proc:
        port = _port()
        return Proc("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port",
                                      str(port), "--log-level", "WARNING"], mlx_env, port, work / "mlx_lm.log")

    if args.claude_code:
        tools = setup.tools + [t for t in CLAUDE_CODE_TOOLS if t["function"]["name"] not in setup.names]
        return claude_code.run(args, setup, tools, segcache_proc, mlx_proc)
    traces = [run_openai("segcache serve", segcache_proc("store"), prompter, args, setup)]
    if not args.no_mlx_lm:
        traces.append(run_openai("mlx_lm.server", mlx_proc(), prompter, args, setup))
    anthropic_rows = [] if args.no_anthropic else run_anthropic(segcache_proc("store-anthropic"), args, setup)
    report(traces, anthropic_rows)
    return 0


def report(traces: list[Trace], anthropic_rows: list[dict]) -> None:
    ours = traces[0]
    print("\nsegcache serve, per request: prompt tokens, cached, and where the uncached ones went")
    print(f"{'phase':<12}{'s':>3}{'prompt':>8}{'cached':>8}{'new':>7}{'rerender':>10}{'store miss':>12}"
          f"{'ttft ms':>9}")
    for r in ours.records:
        new = "-" if r["new"] is None else r["new"]
        miss = "-" if r["store_miss"] is None else r["store_miss"]
        print(f"{r['phase']:<12}{r['session'] + 1:>3}{r['prompt']:>8}{r['cached']:>8}{new:>7}{r['rerender']:>10}"
              f"{miss:>12}{r['ttft'] * 1000:>9.0f}")
    if len(traces) > 1:
        theirs = traces[1]
        print("\ntime to first token, summed per phase (ms)")
        print(f"{'phase':<14}{'n':>3}{'segcache':>11}{'mlx_lm':>11}{'ratio':>8}")
        phases = list(dict.fromkeys(r["phase"] for r in ours.records))
        for ph in phases + ["all"]:
            a = [r["ttft"] for r in ours.records if ph in (r["phase"], "all")]
            b = [r["ttft"] for r in theirs.records if ph in (r["phase"], "all")]
            print(f"{ph:<14}{len(a):>3}{sum(a) * 1000:>11.0f}{sum(b) * 1000:>11.0f}{sum(a) / sum(b):>7.2f}x")
        ra = [r["ttft"] for r in ours.records if r["phase"] == "restart"][0]
        rb = [r["ttft"] for r in theirs.records if r["phase"] == "restart"][0]
        print(f"turn after a restart: {rb / ra:.1f}x faster")
        same = [a["calls"] == b["calls"] and a["usage_prompt"] == b["usage_prompt"]
                for a, b in zip(ours.records, theirs.records)]
        calls = sum(len(r["calls"]) for r in ours.records)
        print(f"tool calls parsed alike by both servers (and the same prompt tokens): "
              f"{sum(same)}/{len(same)} requests, {calls} calls{'' if all(same) else '  <- DIFFER'}")
    if anthropic_rows:
        print(f"\nanthropic client against segcache: summed TTFT {sum(r['ttft'] for r in anthropic_rows) * 1000:.0f} ms, "
              f"cache reads per turn {[r['cached'] for r in anthropic_rows]}")


if __name__ == "__main__":
    sys.exit(main())
