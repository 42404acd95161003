"""`segcache serve` against mlx-lm: one real server process shared by the module.

Texts are compared with mlx_lm.generate (and segcache.generate) on the same
token ids; chat prompts are built with mlx_lm.server's own `convert_chat`,
the plain template the shipped models (which have no chat template) get.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json

import httpx
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.server import convert_chat

from segcache import generate as segcache_generate

from serve_util import TARGET, Server

SYSTEM = open(TARGET.parent / "heldout_stdlib.txt").read()[:1500]


@pytest.fixture(scope="module")
def ref():
    return mlx_lm.load(str(TARGET))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve") / "store", "--max-body-bytes", "1M")
    try:
        yield srv.start()
    finally:
        srv.stop()


def expected(ref, ids, n):
    model, tok = ref
    return mlx_lm.generate(model, tok, prompt=list(ids), max_tokens=n)


def chat_ids(ref, messages):
    return ref[1].encode(convert_chat(messages))


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def stream_text(client, kind, **kw):
    """(text, finish_reason, usage) of a streamed request through the openai client."""
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    text, finish, usage = [], None, None
    for ev in create(stream=True, stream_options={"include_usage": True}, **kw):
        if ev.usage is not None:
            usage = ev.usage
        for c in ev.choices:
            piece = c.delta.content if kind == "chat" else c.text
            text.append(piece or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, usage


PROMPT = '''class Settings:

    def get_name(self):
        """Return the name."""
        return self._name

    def get_size(self):
'''


def test_completions_match_mlx_lm(server, ref):
    client = server.client()
    ids = ref[1].encode(PROMPT)
    want = expected(ref, ids, 40)
    assert want == segcache_generate(*ref, ids, max_tokens=40)
    r = client.completions.create(model="default_model", prompt=PROMPT, max_tokens=40)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 40, len(ids) + 40)
    text, finish, usage = stream_text(client, "text", model="target", prompt=PROMPT, max_tokens=40)
    assert (text, finish) == (want, "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 40)
    # the second request resumed the first's prompt from the prefix cache: all of it, its end's logits
    # too (the server's sessions are whole: no forward before the first token)
    assert usage.prompt_tokens_details.cached_tokens == len(ids)
    # token ids as the prompt, and the model's path as its name
    r = client.completions.create(model=str(TARGET), prompt=ids, max_tokens=40)
    assert r.choices[0].text == want


def test_chat_matches_mlx_lm(server, ref):
    client = server.client()
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": PROMPT}]
    ids = chat_ids(ref, messages)
    want = expected(ref, ids, 32)
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=32)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert (r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens) == ("length", len(ids), 32)
    text, finish, usage = stream_text(client, "chat", model="target", messages=messages, max_completion_tokens=32)
    assert (text, finish, usage.prompt_tokens, usage.completion_tokens) == (want, "length", len(ids), 32)


def test_conversation_resumes_on_the_hybrid(server, ref):
    client = server.client()

    def turn(messages, n=24):
        r = client.chat.completions.create(model="target", messages=messages, max_tokens=n)
        ids = chat_ids(ref, messages)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == expected(ref, ids, n)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, ids

    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def parse(text):"}]
    a1, c1, _ = turn(msgs)
    cached = []
    for q in ("def render(node):", "def main():"):
        msgs = msgs + [{"role": "assistant", "content": a1}, {"role": "user", "content": q}]
        a1, c, ids = turn(msgs)
        cached.append(c)
    assert all(c > 0 for c in cached), cached  # turns 2 and 3

    # regenerate the last turn: its whole prompt is cached, with its end's logits
    _, c, ids = turn(msgs)
    assert c == len(ids)

    # edit the last question: resumes at least from the start of the last user message
    before_last = "".join(f"{'ASSISTANT' + chr(39) + 's RULE' if m['role'] == 'system' else m['role'].upper()}: "
                          f"{m['content']}\n" for m in msgs[:-1])
    edited = msgs[:-1] + [{"role": "user", "content": "def close(self):"}]
    _, c, ids = turn(edited)
    boundary = lcp(ref[1].encode(before_last), ids)
    assert boundary > 0 and boundary <= c < len(ids)

    # a second conversation with the same system prompt resumes from its end
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "class Queue:"}]
    _, c, ids = turn(other)
    sys_end = lcp(ref[1].encode(f"ASSISTANT's RULE: {SYSTEM}\n"), ids)
    assert sys_end > 100 and sys_end <= c < len(ids)


def test_stop_strings_and_max_tokens(server, ref):
    client = server.client()
    ids = ref[1].encode(PROMPT)
    full = expected(ref, ids, 40)
    stop = full[12:16]
    cut = full[: full.index(stop)]
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=40, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    text, finish, _ = stream_text(client, "text", model="target", prompt=PROMPT, max_tokens=40,
                                  stop=["\u2603never", stop])
    assert (text, finish) == (cut, "stop")
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=7)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 7)
    assert r.choices[0].text == expected(ref, ids, 7)


def test_logprobs_match_mlx_lm(server, ref):
    model, tok = ref
    messages = [{"role": "user", "content": PROMPT}]
    ids = chat_ids(ref, messages)
    steps = [(t, lp) for (t, lp), _ in zip(generate_step(mx.array(ids), model, max_tokens=6), range(6))]
    r = server.client().chat.completions.create(model="target", messages=messages, max_tokens=6,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry, (t, lp) in zip(content, steps):
        assert entry.token == tok.decode([int(t)])
        assert abs(entry.logprob - lp[int(t)].item()) < 1e-4
        top = mx.argsort(-lp)[:3].tolist()
        assert [a.token for a in entry.top_logprobs] == [tok.decode([i]) for i in top]
        assert entry.top_logprobs[0].logprob == pytest.approx(lp[top[0]].item(), abs=1e-4)
    streamed = [e for ev in server.client().chat.completions.create(
        model="target", messages=messages, max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
        for c in ev.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    r = server.client().completions.create(model="target", prompt=ids, max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.token_logprobs[0] == pytest.approx(steps[0][1][int(steps[0][0])].item(), abs=1e-4)


def test_models_and_health(server):
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    assert [m.id for m in server.client().models.list().data] == ["target"]


LONG = "hello world " * 3000
BAD = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, "body"),
    ("/v1/completions", b'["prompt"]', 400, "body"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    # a max_tokens beyond the context is capped there (--strict-max-tokens: a 400; test_serve_agents.py)
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "xtc_threshold": 0.9}, 400, "xtc_threshold"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}}, 400,
     "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "../../etc/passwd"}, 404, "model"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (3 << 20) + b'"}', 413, "body"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_gets_its_4xx_and_the_server_goes_on(server, ref, path, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body)
    r = server.post(path, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    ok = server.client().completions.create(model="target", prompt="def f(x):", max_tokens=4)
    assert ok.choices[0].text == expected(ref, ref[1].encode("def f(x):"), 4)


def test_unknown_route_and_method(server):
    assert httpx.get(server.url + "/v1/nothing", timeout=10).status_code == 404
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_sampling_with_a_seed_is_segcaches_sampler_on_that_seed(server, ref):
    from segcache import make_sampler

    ids = ref[1].encode(PROMPT)
    mx.random.seed(7)
    want = segcache_generate(*ref, ids, max_tokens=24, sampler=make_sampler(0.9, top_p=0.95))
    got = [server.client().completions.create(model="target", prompt=PROMPT, max_tokens=24, temperature=0.9,
                                              top_p=0.95, seed=7).choices[0].text for _ in range(2)]
    assert got == [want, want]
    other = server.client().completions.create(model="target", prompt=PROMPT, max_tokens=24, temperature=0.9,
                                               top_p=0.95, seed=8).choices[0].text
    assert other != want
