"""Real coding agents against `segcache serve` (issue 47): Claude Code (`claude -p`), Codex CLI
(`codex exec`), opencode (`opencode run`) and aider (its Python scripting API, the chat kept in
process) each run three
turns non-interactively against a server on a free loopback port. Every request they send gets
a 2xx, the client exits 0, turns 2 and 3 resume at least 95% of their prompt, and the fields a
local model cannot honour that they send (Claude Code's `context_management`, Codex's
`client_metadata` and hosted tools) are named in the server's log as accepted and ignored.

The clients come from `make agents` (tests/.agents: npm's packages, aider in a venv of its own);
a test skips, saying why, where its client is not installed. The model is a scripted one
(segcache.testing.chat) that answers "Done." to any prompt, so a turn costs its prefill only.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json
import os
import re
import subprocess
from pathlib import Path

import mlx_lm
import pytest

from serve_util import Server
from segcache.serve.chat import Prompter
from segcache.testing.chat import build

AGENTS = Path(__file__).resolve().parent / ".agents"
CLAUDE = AGENTS / "npm" / "node_modules" / ".bin" / "claude"
CODEX = AGENTS / "npm" / "node_modules" / ".bin" / "codex"
OPENCODE = AGENTS / "npm" / "node_modules" / ".bin" / "opencode"
AIDER_PYTHON = AGENTS / "aider" / "bin" / "python"
MODEL_NAME = "local-model"
ANSWER = "Done."
TURNS = ["Say hi.", "And now the other way round?", "Thanks, that is all."]
CLIENT_TIMEOUT = 180  # seconds per client call: Codex's first prompt is ~6k tokens of this model's
ACCESS = re.compile(r"INFO (HEAD|GET|POST) (\S+) (\d{3}) \S+ prompt (\S+) cached (\S+) generated")


def _installed(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path.relative_to(AGENTS.parent)} is not installed: run `make agents` (needs npm for "
                    "Claude Code and Codex CLI)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("agents")
    model = build(d / "model", family="json_tools", scripts={"default": ANSWER})
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 1 << 17  # the agents send tens of thousands of characters, one token each
    (model / "config.json").write_text(json.dumps(cfg))
    srv = Server(d / "store", "--served-model-name", MODEL_NAME, "--log-level", "DEBUG", model=model,
                 log_path=d / "serve.log")
    try:
        yield srv.start()
    finally:
        srv.stop()


class _Log:
    """The server's log from a point on: the access lines of one client's run."""

    def __init__(self, server: Server):
        self.server = server
        self.start = len(server.log())

    def text(self) -> str:
        return self.server.log()[self.start:]

    def access(self) -> list[tuple]:
        """(method, path, status, prompt tokens, cached tokens) of each request, in order."""
        return [(m, p, int(s), n, c) for m, p, s, n, c in ACCESS.findall(self.text())]


def _run(cmd: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env={**os.environ, **env}, cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT)


def _assert_served(turns: list[list[tuple]], route: str) -> None:
    """Every request 2xx; each turn generated on `route`; turns 2 and 3 resumed >= 95% of their prompt."""
    for k, lines in enumerate(turns):
        assert lines and all(200 <= status < 300 for _, _, status, _, _ in lines), (k, lines)
        posts = [(int(n), int(c)) for _, path, _, n, c in lines if path.split("?")[0] == route]
        assert posts, (k, lines)
        if k:
            prompt, cached = posts[0]
            assert cached >= 0.95 * prompt, f"turn {k + 1} resumed {cached} of {prompt} tokens"


def _turns(server: Server, run_turn) -> tuple[list[list[tuple]], str]:
    """Run each turn through `run_turn(k, question)`; its requests' access lines, and the log."""
    log, turns = _Log(server), []
    for k, question in enumerate(TURNS):
        before = len(log.access())
        out = run_turn(k, question)
        assert out.returncode == 0, f"turn {k + 1}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        assert ANSWER in out.stdout, out.stdout[-2000:]
        turns.append(log.access()[before:])
    return turns, log.text()


def test_claude_code_runs_three_turns(server, tmp_path):
    _installed(CLAUDE)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "hello.py").write_text("print('hello')\n")
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-local",
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}

    def turn(k, question):
        # a short system prompt and one tool keep the prompt ~1.4k tokens: the requests keep
        # their shape (blocks, cache_control, thinking, context_management, metadata)
        cmd = [CLAUDE, "-p", question, "--model", MODEL_NAME, "--bare", "--system-prompt",
               "You are a coding assistant.", "--tools", "Read"] + (["--continue"] if k else [])
        return _run(cmd, env, work)

    turns, text = _turns(server, turn)
    _assert_served(turns, "/v1/messages")
    assert "MessagesRequest: accepted and ignored" in text and "context_management" in text


CODEX_CONFIG = """\
model = "{model}"
model_provider = "segcache"
model_instructions_file = "{instructions}"
include_permissions_instructions = false
include_environment_context = false

# ~14k tokens of this model's fewer: the multi-agent tools (a `namespace`, whose handling
# tests/test_serve_fields.py checks on its captured shape), goals and skills
[features]
multi_agent = false
goals = false
skills = false

[model_providers.segcache]
name = "segcache"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "SEGCACHE_API_KEY"
"""


def test_codex_cli_runs_three_turns(server, tmp_path):
    _installed(CODEX)
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    instructions = home / "instructions.md"
    instructions.write_text("You are a coding agent. Answer briefly.\n")  # in place of ~17k characters
    (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(model=MODEL_NAME, instructions=instructions,
                                                                     url=server.url))
    env = {"HOME": str(home), "CODEX_HOME": str(home / ".codex"), "SEGCACHE_API_KEY": "sk-local"}

    def turn(k, question):
        resume = ["resume", "--last"] if k else []
        return _run([CODEX, "exec", "--skip-git-repo-check", *resume, question], env, work)

    turns, text = _turns(server, turn)
    _assert_served(turns, "/v1/responses")
    ignored = [line for line in text.splitlines() if "ResponsesRequest: accepted and ignored" in line]
    assert ignored and all("client_metadata" in line for line in ignored)
    # its tools: a hosted one dropped with a note, its functions rendered
    assert "(a 'web_search' tool) dropped" in text


def test_opencode_runs_three_turns(server, tmp_path):
    """opencode with an OpenAI-compatible provider in its project config (`opencode.json`): chat
    completions with tools; its first turn also asks for a session title (a request of its own)."""
    _installed(OPENCODE)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
        "provider": {"segcache": {"npm": "@ai-sdk/openai-compatible", "name": "segcache serve",
                                  "options": {"baseURL": server.url + "/v1", "apiKey": "sk-local"},
                                  "models": {MODEL_NAME: {"name": MODEL_NAME,
                                                          "limit": {"context": 131072, "output": 4096}}}}},
        "model": f"segcache/{MODEL_NAME}"}))
    # PWD too: opencode finds its project (and opencode.json) from the shell's PWD, not the process's cwd
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"), "PWD": str(work)}

    def turn(k, question):
        return _run([OPENCODE, "run", "-m", f"segcache/{MODEL_NAME}", *(["-c"] if k else []), question], env, work)

    turns, _ = _turns(server, turn)
    # turn 1: the title request and the turn itself; later turns continue the session
    assert len(turns[0]) >= 2
    _assert_served(turns, "/v1/chat/completions")


AIDER_SCRIPT = """\
import json
import sys
from aider.coders import Coder
from aider.io import InputOutput
from aider.models import Model, register_litellm_models

register_litellm_models([sys.argv[1]])
sent = open(sys.argv[2], "w")
send = Model.send_completion


def recorded(self, messages, *args, **kwargs):  # what each turn sends, for the test to render
    sent.write(json.dumps(messages) + "\\n")
    sent.flush()
    return send(self, messages, *args, **kwargs)


Model.send_completion = recorded
coder = Coder.create(main_model=Model("openai/{model}"), io=InputOutput(yes=True, pretty=False), fnames=[],
                     use_git=False, stream=True)
for question in sys.argv[3:]:
    coder.run(question)
    print("TURN-END", flush=True)
"""


def test_aider_runs_three_turns(server, tmp_path):
    """aider's scripting API keeps the chat in process, as its interactive loop does (`--message`
    runs one turn, and `--restore-chat-history` rebuilds the history from its markdown log, not
    as sent). aider puts the chat's history before its "files" messages, so a turn's prompt shares
    with the last one only the system prompt and examples (~65% here): each turn resumes all the
    tokens it shares with an earlier prompt, which is all any server can reuse."""
    _installed(AIDER_PYTHON)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    meta = home / "model.metadata.json"
    meta.write_text(json.dumps({f"openai/{MODEL_NAME}": {
        "max_input_tokens": 131072, "max_tokens": 131072, "max_output_tokens": 4096, "input_cost_per_token": 0,
        "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}}))
    script = home / "turns.py"
    script.write_text(AIDER_SCRIPT.format(model=MODEL_NAME))
    env = {"HOME": str(home), "OPENAI_API_BASE": server.url + "/v1", "OPENAI_API_KEY": "sk-local",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_ANALYTICS": "false", "AIDER_CHECK_UPDATE": "false"}
    sent = home / "sent.jsonl"
    log = _Log(server)
    out = _run([AIDER_PYTHON, script, meta, sent, *TURNS], env, work)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    assert out.stdout.count("TURN-END") == len(TURNS) and out.stdout.count(ANSWER) >= len(TURNS), out.stdout
    lines = log.access()
    assert len(lines) == len(TURNS) and all(status == 200 for _, _, status, _, _ in lines), lines
    prompter = Prompter(mlx_lm.load(str(server.model))[1])
    prompts = [prompter.chat(json.loads(line)).ids for line in sent.read_text().splitlines()]
    assert [len(ids) for ids in prompts] == [int(n) for _, _, _, n, _ in lines]  # the prompts the server got
    for k in (1, 2):
        shared = max(len(os.path.commonprefix([prompts[k], prompts[j]])) for j in range(k))
        assert int(lines[k][4]) >= shared - 1, f"turn {k + 1} resumed {lines[k][4]} of the {shared} tokens it shares"

