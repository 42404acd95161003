"""What coding agents meet first (issue 32), through the official `anthropic` and `openai`
clients against a real server on loopback: Claude Code's billing header, request ids and
the access log, prefill progress, /metrics, and the request surface's last gaps."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import contextlib
import json
import logging
import re
import subprocess
import sys
import uuid

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chat_util import LocalServer
from serve_util import TARGET, Server
from segcache.testing.chat import READ_FILE, SEARCH, build, call_text, template

TOOLS = [READ_FILE, SEARCH]
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
CALL = call_text("json_tools")
SYSTEM = "You are a coding agent in a Python repository. Answer briefly."
QUESTION = "What does src/app.py do? Please look at it carefully."
RESULT = "def main():\n    serve()\n"

# The system-first template renders "system + tools" first; this one renders the tools before the
# system text, and refuses roles it does not know (as many real templates do).
TOOLS_FIRST = "".join([
    "{%- if tools %}<|im_start|>tools{{ '\\n' }}{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}"
    "{%- endfor %}<|im_end|>{{ '\\n' }}{%- endif %}",
    "{%- for message in messages %}",
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message.role) }}{%- endif %}",
    "{%- if loop.last and message.role == 'assistant' %}{{ raise_exception('the last message is the assistant') }}"
    "{%- endif %}",
    "<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}",
    "{%- for tc in message.tool_calls or [] %}<tool_call>"
    '{"name": {{ tc.function.name | tojson }}, "arguments": {{ tc.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>{{ '\\n' }}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}"
    "{%- if script is defined %}<|s:{{ script }}|>{%- endif %}{%- endif %}",
])


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def captured():
    """The segcache.serve log's lines while the block runs."""
    logger, handler = logging.getLogger("segcache.serve"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def access_lines(lines, rid=None):
    """The access lines (method path status id ...), of `rid` only if given."""
    pat = re.compile(r"^(GET|POST|OPTIONS|PUT|DELETE) (\S+) (\d{3}) (\S+) prompt (\S+) cached (\S+) generated (\S+) ")
    out = [m.groups() for m in map(pat.match, lines) if m]
    return [o for o in out if rid is None or o[3] == rid]


def engine_line(lines, rid):
    """(prompt, cached) of the engine's line for request `rid`."""
    pat = re.compile(re.escape(rid) + r": prompt (\d+) tok, cached (\d+) ")
    found = [tuple(map(int, m.groups())) for m in map(pat.match, lines) if m]
    assert len(found) == 1, (rid, lines)
    return found[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    return build(root / "agent", scripts={"default": "Reading it. " + CALL,
                                          "long": "".join(f"word{i} " for i in range(40))})


def _system(nonce: str) -> list[dict]:
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; "
                                     f"cch={nonce};"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]


def _session(srv, nonce: bool, salt: str, turns: int = 4):
    """A Claude-Code-shaped session: the billing header first (a new nonce each turn when
    `nonce`), tools, tool_use / tool_result turns. Returns each turn's message."""
    a = srv.anthropic()
    messages = [{"role": "user", "content": QUESTION}]
    out = []
    for k in range(turns):
        m = a.messages.create(model="agent", max_tokens=100, system=_system(uuid.uuid4().hex[:5] if nonce else "00000"),
                              tools=A_TOOLS, messages=messages, extra_body={"cache_salt": salt})
        out.append(m)
        use = next(b for b in m.content if b.type == "tool_use")
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": RESULT * (k + 1)}]})
    return out


def _prompt(m) -> int:
    return m.usage.input_tokens + m.usage.cache_read_input_tokens


@pytest.mark.parametrize("first", ["system", "tools"])
def test_a_changing_billing_header_resumes_every_turn_as_a_stable_one(model, tmp_path, first):
    chat_template = TOOLS_FIRST if first == "tools" else None
    with captured() as lines, LocalServer(model, store_dir=tmp_path / "store", chat_template=chat_template) as srv:
        stable = _session(srv, nonce=False, salt="stable")
        changing = _session(srv, nonce=True, salt="nonce")
    for s, c in zip(stable, changing):
        assert (_prompt(c), c.usage.cache_read_input_tokens) == (_prompt(s), s.usage.cache_read_input_tokens)
    for before, now in zip(changing, changing[1:]):
        # all but its new messages: the whole previous prompt (its answer re-rendered after it) is resumed
        assert now.usage.cache_read_input_tokens >= _prompt(before)
    for m in changing:  # the usage the client reads is what the log says
        assert engine_line(lines, m.id) == (_prompt(m), m.usage.cache_read_input_tokens)
        [(_, path, status, _, prompt, cached, _)] = access_lines(lines, m.id)
        assert (path, status, int(prompt), int(cached)) == ("/v1/messages", "200", _prompt(m),
                                                             m.usage.cache_read_input_tokens)
        assert m.usage.segcache["cached_tokens_by_tier"] == ({"ram": m.usage.cache_read_input_tokens}
                                                             if m.usage.cache_read_input_tokens else {})
    # count_tokens renders what messages renders: the header is not counted either
    with LocalServer(model, chat_template=chat_template) as srv:
        a = srv.anthropic()
        srv_count = a.messages.count_tokens(model="agent", system=_system("12345"), tools=A_TOOLS,
                                            messages=[{"role": "user", "content": QUESTION}]).input_tokens
        counted = a.messages.count_tokens(model="agent", system=SYSTEM, tools=A_TOOLS,
                                          messages=[{"role": "user", "content": QUESTION}]).input_tokens
    assert srv_count == counted == _prompt(changing[0])


def test_keep_volatile_system_renders_the_header(model, tmp_path):
    with LocalServer(model, store_dir=tmp_path / "store", settings={"keep_volatile_system": True}) as srv:
        kept = _session(srv, nonce=True, salt="kept", turns=3)
    with LocalServer(model, store_dir=tmp_path / "store2") as srv:
        dropped = _session(srv, nonce=True, salt="dropped", turns=3)
    for k in range(1, len(kept)):
        assert _prompt(kept[k]) > _prompt(dropped[k])  # the header is in the prompt
        # its nonce ends the shared prefix: less than the previous prompt is resumed
        assert kept[k].usage.cache_read_input_tokens < _prompt(kept[k - 1])
        assert dropped[k].usage.cache_read_input_tokens >= _prompt(dropped[k - 1])


def test_chat_cached_tokens_agree_with_the_log(model, tmp_path):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    with captured() as lines, LocalServer(model, store_dir=tmp_path / "store") as srv:
        c = srv.openai()
        rs = [c.chat.completions.create(model="agent", messages=messages) for _ in range(2)]
    assert rs[1].usage.prompt_tokens_details.cached_tokens > 0
    for r in rs:
        assert engine_line(lines, r.id) == (r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens)


# -- request ids and the access log -----------------------------------------------------------------


def test_every_request_has_one_access_line_with_the_id_the_client_gets(model, tmp_path):
    ask = dict(model="agent", max_tokens=50, messages=[{"role": "user", "content": QUESTION}])
    with captured() as lines, LocalServer(model, store_dir=tmp_path / "store", api_key="k") as srv:
        a, c = srv.anthropic("k"), srv.openai("k")
        seen = []  # (id in the body, request-id header, path, status)
        r = a.messages.with_raw_response.create(**ask)
        seen.append((r.parse().id, r.headers["request-id"], "/v1/messages", "200"))
        assert r.parse().id.startswith("msg_")
        with a.messages.stream(**ask) as s:
            final = s.get_final_message()
            seen.append((final.id, s.response.headers["request-id"], "/v1/messages", "200"))
        r = c.chat.completions.with_raw_response.create(model="agent", messages=ask["messages"])
        seen.append((r.parse().id, r.headers["request-id"], "/v1/chat/completions", "200"))
        assert r.parse()._request_id == r.parse().id  # the openai client reads x-request-id
        r = c.responses.with_raw_response.create(model="agent", input=QUESTION)
        seen.append((r.parse().id, r.headers["request-id"], "/v1/responses", "200"))
        assert r.parse().id.startswith("resp_")
        r = c.completions.with_raw_response.create(model="agent", prompt=QUESTION, max_tokens=3)
        seen.append((r.parse().id, r.headers["request-id"], "/v1/completions", "200"))
        # a client's own x-request-id names the request
        r = c.chat.completions.with_raw_response.create(model="agent", messages=ask["messages"],
                                                        extra_headers={"x-request-id": "agent-run-7"})
        assert r.parse().id == "chatcmpl-agent-run-7" == r.headers["request-id"]
        seen.append((r.parse().id, r.headers["request-id"], "/v1/chat/completions", "200"))
        # one that could not sit in a log line or a header is not taken: a fresh id instead
        r = c.chat.completions.with_raw_response.create(model="agent", messages=ask["messages"],
                                                        extra_headers={"x-request-id": "two words\tand a tab"})
        assert r.parse().id.startswith("chatcmpl-") and "words" not in r.parse().id
        seen.append((r.parse().id, r.headers["request-id"], "/v1/chat/completions", "200"))
        # 4xx: the id comes in the headers (and the clients' errors carry it)
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(model="agent", max_tokens=5, messages=[])
        assert e.value.body["request_id"] == e.value.request_id  # in the body too, as Anthropic's API
        seen.append((e.value.request_id, e.value.response.headers["request-id"], "/v1/messages", "400"))
        with pytest.raises(anthropic.AuthenticationError) as e:
            srv.anthropic("wrong").messages.create(**ask)
        seen.append((e.value.request_id, e.value.response.headers["request-id"], "/v1/messages", "401"))
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="nope", messages=ask["messages"])
        seen.append((e.value.request_id, e.value.response.headers["request-id"], "/v1/chat/completions", "404"))
        r = httpx.get(srv.url + "/no/such/route")
        seen.append((r.headers["request-id"], r.headers["request-id"], "/no/such/route", "404"))
    for body_id, header_id, path, status in seen:
        assert body_id == header_id
        found = access_lines(lines, body_id)
        assert [(f[1], f[2]) for f in found] == [(path, status)], (body_id, found)
    assert len(access_lines(lines)) == len(seen)  # no request without its line, none with two
    for body_id, _, _, status in seen:
        [(_, _, _, _, prompt, cached, generated)] = access_lines(lines, body_id)
        assert (prompt == "-") == (status != "200") and (generated == "-") == (status != "200")


# -- prefill progress -------------------------------------------------------------------------------


def _long_prompt(srv, tokens: int) -> str:
    text, n = "", 0
    while n < tokens:
        text += f"line {n}: the quick brown fox jumps over the lazy dog. "
        n = len(srv.tokenizer.encode(text))
    return text


def test_a_long_prefill_shows_progress_before_the_first_token(model, tmp_path):
    with captured() as lines, LocalServer(model, store_dir=tmp_path / "store") as srv:
        prompt = _long_prompt(srv, 3000)
        body = {"model": "agent", "messages": [{"role": "user", "content": prompt}], "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
            rid = r.headers["request-id"]
            events = [line for line in r.iter_lines() if line]
        first = next(i for i, e in enumerate(events) if e.startswith("data: "))
        keepalives = [e for e in events[:first] if e.startswith(": keepalive ")]
        assert keepalives
        done = [tuple(map(int, e.split()[-1].split("/"))) for e in keepalives]
        total = done[0][1]
        assert total >= 3000 and all(t == total for _, t in done) and [d for d, _ in done] == sorted(d for d, _ in done)
        assert json.loads(events[first][6:])["id"] == rid
        # completions streams too (a cache domain of their own: the prompt is computed)
        body = {"model": "agent", "prompt": prompt, "max_tokens": 4, "stream": True, "cache_salt": "completions"}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            events = [line for line in r.iter_lines() if line]
        first = next(i for i, e in enumerate(events) if e.startswith("data: "))
        assert any(e.startswith(": keepalive ") for e in events[:first])
        # Messages: ping events while the prompt is prefilled (a cache domain of its own: all computed),
        # and message_start's split of a resumed prompt is the end's
        body = {"model": "agent", "max_tokens": 20, "messages": [{"role": "user", "content": prompt + " again"}],
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/messages", json=dict(body, cache_salt="fresh"), timeout=120) as r:
            mid = r.headers["request-id"]
            kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
        assert kinds[0] == "message_start" and kinds.count("ping") > 1
        assert kinds.index("content_block_start") > max(i for i, k in enumerate(kinds) if k == "ping")
        with srv.anthropic().messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
            start = next(e for e in s if e.type == "message_start").message.usage
            end = s.get_final_message().usage
        assert (start.input_tokens, start.cache_read_input_tokens) == (end.input_tokens, end.cache_read_input_tokens)
        assert end.cache_read_input_tokens > 0
    for request_id in (rid, mid):
        progress = [ln for ln in lines if ln.startswith(f"{request_id}: prompt processing progress: ")]
        assert progress and lines.index(progress[-1]) < lines.index(
            next(ln for ln in lines if ln.startswith(f"{request_id}: prompt ") and " tok, cached " in ln))
    # a bounded rate: one line per second at most after the first (PROGRESS_EVERY), far fewer than the keepalives
    assert len([ln for ln in lines if ln.startswith(f"{rid}: prompt processing")]) <= len(keepalives)


# -- /metrics -----------------------------------------------------------------------------------------


def _scrape(srv, key="k") -> dict:
    r = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _delta(before, after, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)


def test_metrics_move_with_the_requests(tmp_path):
    answer = "".join(f"tok{i} " for i in range(12))
    path = build(tmp_path / "lookup", family=None, scripts={"default": answer})
    with LocalServer(path, store_dir=tmp_path / "store", api_key="k", engine={"prompt_lookup": True}) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401  # behind the API key
        c = srv.openai("k")
        before = _scrape(srv)
        ask = [{"role": "user", "content": QUESTION}]
        miss = c.chat.completions.create(model="lookup", messages=ask)
        hit = c.chat.completions.create(model="lookup", messages=ask)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="lookup", messages=ask, temperature=-1)
        # the answer is in the conversation already: prompt lookup drafts it, and the target accepts
        drafted = c.chat.completions.create(model="lookup", messages=ask + [
            {"role": "assistant", "content": answer}, {"role": "user", "content": QUESTION}])
        after = _scrape(srv)
    ok = [miss, hit, drafted]
    assert _delta(before, after, "segcache_requests_total", route="/v1/chat/completions", status="200") == 3
    assert _delta(before, after, "segcache_requests_total", route="/v1/chat/completions", status="400") == 1
    assert miss.usage.prompt_tokens_details.cached_tokens == 0 and hit.usage.prompt_tokens_details.cached_tokens > 0
    cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in ok)
    assert _delta(before, after, "segcache_cached_tokens_total", tier="ram") == cached
    assert _delta(before, after, "segcache_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in ok)
    assert _delta(before, after, "segcache_generated_tokens_total") == sum(r.usage.completion_tokens for r in ok)
    assert _delta(before, after, "segcache_time_to_first_token_seconds_count") == 3
    assert _delta(before, after, "segcache_time_per_output_token_seconds_count") == 3
    extra = drafted.usage.segcache
    assert extra["drafter"] == "lookup" and extra["draft_tokens"] > 0 and extra["accepted_tokens"] > 0
    assert _delta(before, after, "segcache_draft_tokens_total", drafter="lookup") == \
        sum(r.usage.segcache["draft_tokens"] for r in ok)
    assert _delta(before, after, "segcache_accepted_tokens_total", drafter="lookup") == \
        sum(r.usage.segcache["accepted_tokens"] for r in ok)
    assert after[("segcache_store_entries", (("tier", "ram"),))] > 0
    assert after[("segcache_queue_depth", ())] == 0 and after[("segcache_running_rows", ())] == 0
    assert all(0 < r.usage.segcache["ttft_s"] for r in ok)


# -- the request surface ------------------------------------------------------------------------------


def test_developer_role_is_system_where_the_template_lacks_it(model, tmp_path):
    with LocalServer(model, chat_template=TOOLS_FIRST) as srv:
        c = srv.openai()
        as_system = c.chat.completions.create(model="agent", messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
        as_developer = c.chat.completions.create(model="agent", messages=[
            {"role": "developer", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
        r = c.responses.create(model="agent", input=[{"role": "developer", "content": SYSTEM},
                                                     {"role": "user", "content": QUESTION}])
        # the template's own rendering with the system role: the same tokens
        text = srv.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": QUESTION}], chat_template=TOOLS_FIRST,
                                                 add_generation_prompt=True, tokenize=False)
        expected = len(srv.tokenizer.encode(text, add_special_tokens=False))
        # an error of the template names the field of the API the client used
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="agent", input=[{"role": "user", "content": QUESTION},
                                                     {"role": "assistant", "content": "Fine."}])
        assert e.value.body["param"] == "input" and "'messages'" not in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="agent", messages=[{"role": "user", "content": QUESTION},
                                                               {"role": "assistant", "content": "Fine."}])
        assert e.value.body["param"] == "messages"
    assert as_system.usage.prompt_tokens == as_developer.usage.prompt_tokens == r.usage.input_tokens == expected


def test_models_retrieve_and_unknown_names(model):
    with LocalServer(model) as srv:
        c = srv.openai()
        assert [m.id for m in c.models.list()] == ["agent"]
        assert c.models.retrieve("agent").id == "agent"
        with pytest.raises(openai.NotFoundError) as e:
            c.models.retrieve("claude-sonnet-4-5")
        assert "--served-model-name" in e.value.body["message"]


def test_max_tokens_beyond_the_context_is_capped(tmp_path):
    path = build(tmp_path / "short", scripts={"default": "".join(f"word{i} " for i in range(60))})
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 200
    (path / "config.json").write_text(json.dumps(cfg))
    with LocalServer(path) as srv:
        a, c = srv.anthropic(), srv.openai()
        prompt = _long_prompt(srv, 150)
        m = a.messages.create(model="short", max_tokens=32000, messages=[{"role": "user", "content": prompt}])
        room = 200 - _prompt(m)
        assert m.stop_reason == "model_context_window_exceeded" and m.usage.output_tokens == room > 0
        m = a.messages.create(model="short", max_tokens=3, messages=[{"role": "user", "content": prompt}])
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
        r = c.chat.completions.create(model="short", max_tokens=32000, messages=[{"role": "user", "content": prompt}])
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 200 - r.usage.prompt_tokens
        short = c.chat.completions.create(model="short", max_tokens=32000, messages=[{"role": "user", "content": "hi"}])
        assert short.choices[0].finish_reason == "stop"  # room for the whole answer: not cut
        assert short.choices[0].message.content == "".join(f"word{i} " for i in range(60))
    with LocalServer(path, settings={"strict_max_tokens": True}) as srv:
        with pytest.raises(anthropic.BadRequestError) as e:
            srv.anthropic().messages.create(model="short", max_tokens=32000,
                                            messages=[{"role": "user", "content": prompt}])
        assert "'max_tokens'" in e.value.body["error"]["message"]


def test_the_tool_parser_comes_from_the_chat_template_used(tmp_path):
    """A tokenizer that declares no parser, served with a --chat-template whose text names
    json_tools' markup (as mlx-lm infers it from tokenizer_config.json's template)."""
    path = build(tmp_path / "bare", family=None, scripts={"default": "Reading it. " + CALL})
    own = template("json_tools")
    assert "tool_call.name" not in own
    # the same rendering, written as Qwen's templates write it (the text mlx-lm's inference reads)
    chosen = own.replace("{%- for tc in message.tool_calls or [] %}",
                         "{%- for tool_call in message.tool_calls or [] %}{%- set tool_call = tool_call.function %}")
    chosen = chosen.replace("tc.function.", "tool_call.")
    assert chosen != own and "tc." not in chosen
    with LocalServer(path) as srv:
        with pytest.raises(openai.BadRequestError):  # its own template names no parser
            srv.openai().chat.completions.create(model="bare", messages=[{"role": "user", "content": QUESTION}],
                                                 tools=TOOLS)
    with LocalServer(path, chat_template=chosen) as srv:
        r = srv.openai().chat.completions.create(model="bare", messages=[{"role": "user", "content": QUESTION}],
                                                 tools=TOOLS)
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("read_file", {"path": "src/app.py"})
    assert r.choices[0].finish_reason == "tool_calls"


def test_the_command_line_flags(tmp_path):
    """`segcache serve` itself: --help names the billing-header default, the log says it once,
    --served-model-name serves every name (the first listed first), --strict-max-tokens refuses."""
    help_text = subprocess.run([sys.executable, "-m", "segcache.cli", "serve", "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    squashed = " ".join(help_text.split())
    assert "--keep-volatile-system" in squashed and "x-anthropic-billing-header:" in squashed
    assert "--served-model-name" in squashed and "--strict-max-tokens" in squashed
    srv = Server(tmp_path / "store", "--served-model-name", "claude-sonnet-4-5", "--served-model-name", "local",
                 "--strict-max-tokens", log_path=tmp_path / "serve.log").start()
    try:
        c = srv.client()
        assert [m.id for m in c.models.list()] == ["claude-sonnet-4-5", "local"]
        assert c.models.retrieve("local").id == "local" and c.models.retrieve(TARGET.name).id == TARGET.name
        a = anthropic.Anthropic(base_url=srv.url, api_key="none", timeout=120, max_retries=0)
        m = a.messages.create(model="claude-sonnet-4-5", max_tokens=3, system=_system("abcde"),
                              messages=[{"role": "user", "content": "Hello"}])
        assert m.model == "claude-sonnet-4-5" and m.usage.output_tokens == 3
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(model="local", max_tokens=10 ** 6, messages=[{"role": "user", "content": "Hello"}])
        assert "--strict-max-tokens" in e.value.body["error"]["message"]
    finally:
        srv.stop()
    log = srv.log()
    assert log.count("x-anthropic-billing-header:") == 1 and "--keep-volatile-system keeps it" in log


# -- Responses custom tools -----------------------------------------------------------------------------

PATCH = "*** Begin Patch\n*** End Patch"
PATCH_LARK = 'start: "*** Begin Patch\\n" "*** End Patch"'
CUSTOM = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch to the repository",
           "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_LARK}},
          {"type": "custom", "name": "note", "description": "Write a note"},
          {"type": "custom", "name": "count", "format": {"type": "grammar", "syntax": "regex",
                                                          "definition": "(add|drop) [0-9]{2}"}}]


def _custom_call(name, text):
    return call_text("json_tools", json.dumps({"name": name, "arguments": {"input": text}}))


def test_responses_custom_tools_follow_their_grammar_or_pass_as_text(tmp_path):
    path = build(tmp_path / "codex", scripts={
        "default": "Patching. " + _custom_call("apply_patch", PATCH),
        "broken": "Hm. " + _custom_call("apply_patch", "rm -rf build"),
        "note": _custom_call("note", "any text at all"),
    })
    with LocalServer(path) as srv:
        c = srv.openai()
        r = c.responses.create(model="codex", input="Fix the bug", tools=CUSTOM)
        assert [o.type for o in r.output] == ["message", "custom_tool_call"]
        assert (r.output[1].name, r.output[1].input) == ("apply_patch", PATCH)
        # streamed: the custom call's input events, and the client's accumulation
        kinds = [e.type for e in c.responses.create(model="codex", input="Fix the bug", tools=CUSTOM, stream=True)]
        assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
        with c.responses.stream(model="codex", input="Fix the bug", tools=CUSTOM) as s:
            for _ in s:
                pass
            final = s.get_final_response()
        assert [(o.type, getattr(o, "input", None)) for o in final.output] == \
            [(o.type, getattr(o, "input", None)) for o in r.output]
        # an input that breaks the tool's grammar is no call: it comes back as text
        bad = c.responses.create(model="codex", input="Fix the bug", tools=CUSTOM,
                                 extra_body={"chat_template_kwargs": {"script": "broken"}})
        assert [o.type for o in bad.output] == ["message"] and "rm -rf build" in bad.output_text
        # a plain-text custom tool takes any input
        note = c.responses.create(model="codex", input="Note it", tools=CUSTOM,
                                  extra_body={"chat_template_kwargs": {"script": "note"}})
        assert [(o.type, o.name, o.input) for o in note.output] == [("custom_tool_call", "note", "any text at all")]
        # forced: the input is generated under the grammar (the model would write otherwise)
        forced = c.responses.create(model="codex", input="Count", tools=CUSTOM, max_output_tokens=40,
                                    tool_choice={"type": "custom", "name": "count"})
        [item] = forced.output
        assert item.type == "custom_tool_call" and item.name == "count"
        assert re.fullmatch("(add|drop) [0-9]{2}", item.input), item.input
        forced = c.responses.create(model="codex", input="Fix it", tools=CUSTOM[:1], tool_choice="required")
        assert [(o.type, o.input) for o in forced.output] == [("custom_tool_call", PATCH)]
        # the calls and their outputs go back in `input`
        nxt = c.responses.create(model="codex", tools=CUSTOM, input=[
            {"role": "user", "content": "Fix the bug"},
            {"type": "custom_tool_call", "call_id": r.output[1].call_id, "name": "apply_patch", "input": PATCH},
            {"type": "custom_tool_call_output", "call_id": r.output[1].call_id, "output": "Done."}])
        assert nxt.status == "completed" and nxt.usage.input_tokens > r.usage.input_tokens
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="codex", input="x", tools=[{"type": "custom", "name": "p", "format": {
                "type": "grammar", "syntax": "lark", "definition": "start: (("}}])
        assert e.value.body["param"] == "tools.0.format.definition"
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="codex", input="x", tools=[{"type": "custom", "name": "p", "format": {
                "type": "grammar", "syntax": "ebnf", "definition": "x"}}])
        assert e.value.body["param"] == "tools.0.format.syntax"
