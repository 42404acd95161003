"""Fuzzing `segcache serve`'s request models (issue 24): bodies drawn from the JSON the API
accepts and from near it (wrong types, out-of-range numbers, lone surrogates, truncated or
deeply nested JSON, unknown fields) get a 2xx or a 4xx, never a 5xx nor an error inside a 200
stream, and the request after each is served exactly as on a fresh server.

`make test-long` (SEGCACHE_LONG=1) runs 2,000 bodies; the default run a bounded few (40).
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json
import os

import httpx
import mlx_lm
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from serve_util import TARGET, Server

LONG = os.environ.get("SEGCACHE_LONG") == "1"
VOCAB = 1536  # the shipped target's
CONTEXT = 4096
CANARY = "def f(x):"
SURROGATE = "\u27e6lone\u27e7"  # a marker, turned into the escape "\ud800" in the serialized body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    srv = Server(d / "store", "--max-tokens", 4, "--max-body-bytes", "256K", "--ram-bytes", "4M",
                 log_path=d / "serve.log")
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    # one client for the module: httpx builds an SSL context per top-level call (~0.1 s)
    with httpx.Client(base_url=server.url, timeout=120, headers={"Content-Type": "application/json"}) as c:
        yield c


@pytest.fixture(scope="module")
def canary(client):
    """The next request's reference: greedy from mlx-lm, and the server's own seeded sample."""
    model, tok = mlx_lm.load(str(TARGET))
    greedy = mlx_lm.generate(model, tok, prompt=tok.encode(CANARY), max_tokens=4)
    seeded = _complete(client, temperature=0.9, seed=11)
    return greedy, seeded


def _complete(client, **kw) -> str:
    r = client.post("/v1/completions", content=json.dumps({"prompt": CANARY, "max_tokens": 4, **kw}))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# -- strategies: the API's JSON, and near it ---------------------------------------------------

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
text = st.text(max_size=40)
word = st.text(min_size=1, max_size=6)
lone = st.one_of(st.just(SURROGATE), st.text(max_size=6).map(lambda t: t + SURROGATE))
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
part = st.fixed_dictionaries({"type": st.just("text"), "text": text})

# field: (values the API takes, values near them it refuses); a body is drawn from the first,
# then some of its fields are swapped for the second (or for values of another type)
COMMON = {
    "model": (st.sampled_from(["target", "default_model"]), st.sampled_from(["other", "../x", ""])),
    "max_tokens": (st.integers(1, 6), st.sampled_from([-2, 0, CONTEXT + 1, 10**6, 2**64 + 5, 2.0, "3"])),
    "max_completion_tokens": (st.integers(1, 6), st.sampled_from([0, -1, CONTEXT + 1, 10**30, 1.5])),
    "temperature": (st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 1e-30, 1e-7, 1e30])),
                    st.sampled_from([-0.1, -1e30, "hot", [1]])),
    "top_p": (st.one_of(st.floats(0, 1), st.sampled_from([0, 1e-9, 1])), st.sampled_from([-0.1, 1.0001, 2])),
    "top_k": (st.one_of(st.integers(0, 40), st.integers(VOCAB - 3, VOCAB - 1)),
              st.sampled_from([-1, VOCAB, VOCAB + 1, 10**9, 2**70])),
    "min_p": (st.one_of(st.floats(0, 1), st.sampled_from([0, 1])), st.sampled_from([-0.5, 1.5])),
    "seed": (st.one_of(st.integers(0, 2**16), st.integers(2**64 - 3, 2**64 - 1)),
             st.sampled_from([-1, -(2**64), 2**64, 2**80, 1.5])),
    "stop": (st.one_of(word, st.lists(word, max_size=4)),
             st.one_of(lone, st.just([""]), st.lists(word, min_size=5, max_size=6))),
    "stream": (st.booleans(), st.sampled_from(["yes", 1, None])),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                       st.sampled_from([{"include_usage": "yes"}, [], "x"])),
    "n": (st.integers(1, 3), st.sampled_from([0, 17, -1, 2.5])),
    "presence_penalty": (st.floats(-2, 2), st.sampled_from(["x", [1]])),
    "frequency_penalty": (st.floats(-2, 2), st.sampled_from(["x", {}])),
    "repetition_penalty": (st.floats(0, 3), st.sampled_from([-1, "x"])),
    "repetition_context_size": (st.integers(0, 64), st.sampled_from([-1, 1.5, 2**70])),
    "presence_context_size": (st.integers(0, 64), st.sampled_from([-3, "20"])),
    "xtc_probability": (st.floats(0, 1), st.sampled_from([-0.1, 1.5])),
    "xtc_threshold": (st.floats(0, 0.5), st.sampled_from([0.51, -1])),
    "logit_bias": (st.dictionaries(st.sampled_from(["1", "7"]), st.integers(-100, 100)),
                   st.sampled_from([{"x": 1}, {str(VOCAB): 1}, {"-1": 2}, {"1": "a"}, {"1": True}, []])),
    "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                        st.sampled_from([{"type": "xml"}, "json", {"type": "json_schema"},
                                         {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}])),
    "user": (st.text(max_size=8), lone),
    "unknown_field": (junk, st.recursive(junk, lambda c: st.lists(c, max_size=2), max_leaves=6)),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": st.one_of(text, st.lists(part, max_size=3), st.none())},
)
bad_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["wizard", "", None]), "content": text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(lone, junk)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text"]), "text": st.one_of(lone, junk)}),
        min_size=1, max_size=2)}),
)
COMPLETION = {
    **COMMON,
    "prompt": (st.one_of(text.filter(bool), st.lists(text.filter(bool), min_size=1, max_size=1), token_ids),
               st.one_of(st.just(""), st.just([]), lone, st.lists(word, min_size=2, max_size=3),
                         st.lists(st.integers(-3, VOCAB + 3), min_size=1, max_size=5).filter(
                             lambda ids: any(not 0 <= t < VOCAB for t in ids)))),
    "logprobs": (st.one_of(st.booleans(), st.integers(0, 5)), st.sampled_from([-1, 6, "2"])),
    "echo": (st.just(False), st.just(True)),
    "suffix": (st.just(""), word),
}
CHAT = {
    **COMMON,
    "messages": (st.lists(message, min_size=1, max_size=4),
                 st.one_of(st.just([]), st.lists(st.one_of(message, bad_message), min_size=1, max_size=3))),
    "logprobs": (st.booleans(), st.sampled_from(["yes", 2])),
    "top_logprobs": (st.integers(0, 20), st.sampled_from([-1, 21, 10**9])),
}
ROUTES = {"/v1/completions": (COMPLETION, "prompt"), "/v1/chat/completions": (CHAT, "messages"),
          "/chat/completions": (CHAT, "messages")}


@st.composite
def requests(draw, route):
    """A body the API takes, with 0, 1 or 2 of its fields (or the required one) moved off it."""
    fields, required = ROUTES[route]
    optional = draw(st.lists(st.sampled_from(sorted(k for k in fields if k != required)), max_size=8, unique=True))
    names = [required] + optional
    body = {k: draw(fields[k][0]) for k in names}
    n = min(len(names), draw(st.sampled_from([0, 0, 1, 1, 2])))  # about 40% of the bodies are valid
    for k in draw(st.lists(st.sampled_from(names), min_size=n, max_size=n, unique=True)):
        body[k] = draw(st.one_of(fields[k][1], fields[k][1], junk))
    for k in ("max_tokens", "max_completion_tokens"):  # a valid long generation only costs time: none
        v = body.get(k)
        if type(v) is int and 6 < v <= CONTEXT:
            body[k] = CONTEXT + 1
    if draw(st.sampled_from([False] * 9 + [True])):  # (hypothesis favours small integers: not integers(0, 9))
        del body[required]
    return body


@st.composite
def bodies(draw):
    """(route, raw body): a drawn request, sometimes damaged after serialization."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    raw = json.dumps(draw(requests(route))).replace(json.dumps(SURROGATE)[1:-1], "\\ud800")
    damage = draw(st.sampled_from(["none"] * 30 + ["truncate", "array", "nest", "nan", "bytes", "empty"]))
    if damage == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif damage == "array":
        raw = f"[{raw}]"
    elif damage == "nest":
        depth = draw(st.sampled_from([150, 300, 5000]))
        raw = raw[:-1] + (", " if len(raw) > 2 else "") + '"deep": ' + "[" * depth + "]" * depth + "}"
    elif damage == "nan":
        raw = raw[:-1] + (", " if len(raw) > 2 else "") + '"temperature": NaN}'
    elif damage == "empty":
        raw = ""
    data = raw.encode("utf-8", "surrogatepass")
    if damage == "bytes":
        data += draw(st.binary(min_size=1, max_size=4))
    return route, data


@settings(max_examples=2000 if LONG else 40, deadline=None, derandomize=not LONG,
          suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_every_body_gets_a_2xx_or_4xx_and_the_next_request_is_unaffected(client, canary, case):
    route, raw = case
    r = client.post(route, content=raw)
    event(f"{r.status_code} {r.json()['error']['message'][:70] if r.status_code >= 400 else ''}")
    assert r.status_code < 500 and (r.status_code < 300 or r.status_code >= 400), (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and set(err) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), r.text
    else:
        assert r.json()["choices"], r.text
    greedy, seeded = canary
    assert _complete(client) == greedy
    assert _complete(client, temperature=0.9, seed=11) == seeded
    _complete(client, temperature=1.0)  # unseeded sampling still served


def test_the_fuzzed_server_is_healthy(server):
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    assert "Traceback" not in server.log()
