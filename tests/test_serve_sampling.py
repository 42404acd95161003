"""Every sampling control over HTTP, against mlx_lm.server on the shipped target; n choices;
structured output on every chat surface, with a draft model and with prompt lookup.

mlx_lm.server runs as a subprocess on the same model directory, segcache serve in this
process (chat_util.LocalServer). A seeded request goes through mlx_lm.server's sequential
path (it seeds mlx's global generator and runs `generate_step`), a request without a seed
through its batched path; both hand the processors the whole prompt when nothing is cached,
so every prompt here starts with words of its own (its prompt cache never hits).
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json
import os
import threading

import httpx
import jsonschema
import pytest

from chat_util import LocalServer, MlxLmServer
from serve_util import DRAFT, TARGET
from test_grammar import SCHEMAS, response_format

LONG = bool(os.environ.get("SEGCACHE_LONG"))

CODE = '''class Settings:

    def get_name(self):
        """Return the name."""
        return self._name

    def get_size(self):
'''

# control -> the request's fields. Sampled ones carry a seed: mlx_lm.server seeds mlx's global
# generator, segcache the request's own stream with the keys that generator would hand out, at
# every position it emits (speculating or not).
CONTROLS = {
    "temperature": dict(temperature=0.9, seed=11),
    "top_p": dict(temperature=1.0, top_p=0.7, seed=12),
    "top_k": dict(temperature=1.0, top_k=4, seed=13),
    "min_p": dict(temperature=1.0, min_p=0.2, seed=14),
    "xtc": dict(temperature=1.0, xtc_probability=0.6, xtc_threshold=0.05, seed=15),
    "seed": dict(temperature=1.5, seed=2**40 + 7),
    "logit_bias": dict(logit_bias={"30": 4.0, "31": 3.5}),  # and -100 on the greedy text's first tokens (below)
    "repetition_penalty": dict(repetition_penalty=1.8, repetition_context_size=40),
    "presence_penalty": dict(presence_penalty=1.5, presence_context_size=40),
    "frequency_penalty": dict(frequency_penalty=1.2, frequency_context_size=0),
    "penalties_sampled": dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.5,
                              seed=16),
    "everything": dict(temperature=0.9, top_p=0.9, top_k=20, min_p=0.05, xtc_probability=0.3, xtc_threshold=0.1,
                       logit_bias={"30": 2.0}, repetition_penalty=1.2, repetition_context_size=30,
                       presence_penalty=0.4, presence_context_size=10, frequency_penalty=0.3,
                       frequency_context_size=50, seed=17),
}


def prompt_of(name: str) -> str:
    return f"# {name.replace('_', ' ')} example\n{CODE}"


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    with MlxLmServer(TARGET, tmp_path_factory.mktemp("mlx") / "mlx_lm.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    with LocalServer(TARGET, store_dir=tmp_path_factory.mktemp("store") / "s") as srv:
        yield srv


@pytest.fixture(scope="module")
def drafting():
    """segcache serve with a draft model (one row), with prompt lookup (3 rows, batched), and
    batched without drafting (5 rows)."""
    with LocalServer(TARGET, engine=dict(draft_model=DRAFT)) as a, \
            LocalServer(TARGET, engine=dict(prompt_lookup=True, decode_concurrency=3)) as b, \
            LocalServer(TARGET, engine=dict(decode_concurrency=5)) as c:
        yield {"draft": a, "lookup": b, "batched": c}


def complete(srv, route: str, **body) -> dict:
    r = httpx.post(srv.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(body: dict, i: int = 0) -> str:
    c = body["choices"][i]
    return c["text"] if "text" in c else c["message"]["content"]


@pytest.mark.parametrize("name", list(CONTROLS))
def test_each_control_gives_what_mlx_lm_server_gives(theirs, ours, drafting, name):
    fields = dict(CONTROLS[name])
    plain = {k: v for k, v in fields.items() if k in ("temperature", "seed")}
    base = complete(theirs, "/v1/completions", prompt=prompt_of(name), max_tokens=32, **plain)
    if name == "logit_bias":  # bans the tokens the text without it starts with
        banned = ours.tokenizer.encode(text_of(base), add_special_tokens=False)[:3]
        fields["logit_bias"] = {**fields["logit_bias"], **{str(t): -100 for t in banned}}
    req = dict(prompt=prompt_of(name), max_tokens=32, **fields)
    want = complete(theirs, "/v1/completions", **req)
    got = complete(ours, "/v1/completions", **req)
    assert text_of(got) == text_of(want)
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    if name not in ("temperature", "seed"):  # the control matters: without it the text differs
        assert text_of(base) != text_of(want)
    # speculating (a draft model; prompt lookup on batched rows) or batched: the same tokens, greedy
    # or sampled (a seeded row draws with plain decoding's keys at every position it emits)
    for srv in drafting.values():
        assert text_of(complete(srv, "/v1/completions", **req)) == text_of(want)


def test_every_control_on_chat_as_mlx_lm_server(theirs, ours):
    fields = CONTROLS["everything"]
    req = dict(messages=[{"role": "system", "content": "chat with every control"},
                         {"role": "user", "content": CODE}], max_tokens=32, **fields)
    assert text_of(complete(ours, "/v1/chat/completions", **req)) == \
        text_of(complete(theirs, "/v1/chat/completions", **req))


def test_server_defaults_apply_to_requests_that_leave_them_out(theirs):
    """--temp --top-p --top-k --min-p: a request without the fields samples with them, as
    mlx_lm.server started with the same flags; a request's own field wins."""
    flags = dict(temperature=0.8, top_p=0.9, top_k=12, min_p=0.05)
    with LocalServer(TARGET, settings=flags) as ours:
        for seed in (3, 4):
            req = dict(prompt=prompt_of(f"defaults {seed}"), max_tokens=24, seed=seed)
            assert text_of(complete(ours, "/v1/completions", **req)) == \
                text_of(complete(theirs, "/v1/completions", **req, **flags))
        req = dict(prompt=prompt_of("defaults greedy"), max_tokens=24, temperature=0.0)
        assert text_of(complete(ours, "/v1/completions", **req)) == text_of(complete(theirs, "/v1/completions", **req))


BAD = [
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1536": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"one": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": -1.0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_context_size": -3}, "presence_context_size"),
    ("/v1/completions", {"prompt": "x", "xtc_probability": 1.5}, "xtc_probability"),
    ("/v1/completions", {"prompt": "x", "top_k": 1536}, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "minProperties": "two"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                         "schema": {"type": "nope"}}}}, "text.format.schema"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                      "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
     "output_config.format.schema"),
]


@pytest.mark.parametrize("route, body, param", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_a_control_that_cannot_be_honoured_is_a_400_naming_it(ours, route, body, param):
    queued = ours.store.stats()["prefills"]
    r = httpx.post(ours.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert f"'{param}'" in err["message"], err
    if route != "/v1/messages":  # Anthropic's error body has no param
        assert err["param"] == param
    assert ours.store.stats()["prefills"] == queued  # refused before it was queued


# -- n choices ------------------------------------------------------------------------------------


def stream_choices(srv, route: str, **body):
    """{index: text}, {index: finish_reason} and the usage of a streamed request."""
    texts, finishes, usage = {}, {}, None
    with httpx.stream("POST", srv.url + route, json=dict(body, stream=True, stream_options={"include_usage": True}),
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for c in ev["choices"]:
                piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if c["finish_reason"] is not None:
                    assert c["index"] not in finishes
                    finishes[c["index"]] = c["finish_reason"]
    return texts, finishes, usage


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_cost_one_prefill_and_are_reproducible(ours, drafting, route):
    body = dict(max_tokens=12, temperature=1.0, seed=21, n=4)
    if route == "/v1/completions":
        body["prompt"] = prompt_of("four choices") * 3
    else:
        body["messages"] = [{"role": "user", "content": prompt_of("four choices") * 3}]
    before = ours.store.stats()["prefills"]
    whole = complete(ours, route, **body)
    assert ours.store.stats()["prefills"] - before == 1  # the prompt was prefilled once, not 4 times
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    texts = [text_of(whole, i) for i in range(4)]
    assert len(set(texts)) > 1  # independent samples
    one = complete(ours, route, **dict(body, n=1))
    usage = whole["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counted once
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] == \
        one["usage"]["prompt_tokens"] + 4 * 12  # 12 tokens each (no EOS in 12 here)
    assert text_of(one) == texts[0]  # choice 0 draws what one choice with that seed draws
    streamed, reasons, susage = stream_choices(ours, route, **body)
    assert streamed == dict(enumerate(texts)) and reasons == {i: "length" for i in range(4)}
    assert {k: susage[k] for k in ("prompt_tokens", "completion_tokens")} == \
        {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}
    assert susage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]  # it resumed whole, once
    # the same choices when the 4 choices decode as rows of one batch beside a neighbour, plain or
    # speculating by prompt lookup
    for batched in (drafting["batched"], drafting["lookup"]):
        other = threading.Thread(target=complete, args=(batched, "/v1/completions"),
                                 kwargs=dict(prompt=prompt_of("neighbour"), max_tokens=24))
        other.start()
        again = complete(batched, route, **body)
        other.join(120)
        assert [text_of(again, i) for i in range(4)] == texts


# -- structured output ----------------------------------------------------------------------------


def _json_requests(srv, count: int, concurrency: int, seed0: int) -> list:
    """`count` chat requests cycling over SCHEMAS, `concurrency` at a time: [(schema, text, finish)]."""
    names = list(SCHEMAS)
    out = [None] * count
    errors = []

    def work(k):
        for i in range(k, count, concurrency):
            name = names[i % len(names)]
            try:
                body = complete(srv, "/v1/chat/completions", messages=[
                    {"role": "user", "content": f"Answer as JSON ({name}, #{i})."}], max_tokens=160,
                    temperature=1.0, seed=seed0 + i, response_format=response_format(SCHEMAS[name]))
            except AssertionError as exc:
                errors.append(exc)
                return
            out[i] = (name, text_of(body), body["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[0]
    return out


@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_json_schema_requests_all_parse_and_validate_while_speculating(drafting, mode):
    """10 schemas (nested objects, arrays, enums, required fields, anyOf, const, patterns):
    20 requests by default, 200 under SEGCACHE_LONG=1 (make test-long), sampled, each with
    its own seed; a draft model (one row) or prompt lookup (3 rows) speculating."""
    srv = drafting[mode]
    count = 200 if LONG else 20
    results = _json_requests(srv, count, 1 if mode == "draft" else 3, 500 if mode == "draft" else 900)
    for name, text, finish in results:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert len({text for _, text, _ in results}) > count // 2  # the samples differ


def test_structured_output_on_responses_and_messages(ours):
    schema = SCHEMAS["nested"]
    body = complete(ours, "/v1/responses", input="a user, as JSON", max_output_tokens=80, temperature=1.0,
                    text={"format": {"type": "json_schema", "name": "user", "schema": schema}})
    assert body["text"]["format"]["schema"] == schema
    jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), schema)
    body = complete(ours, "/v1/responses", input="anything, as a JSON object", max_output_tokens=80,
                    text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(body["output"][0]["content"][0]["text"]), dict)
    body = complete(ours, "/v1/messages", messages=[{"role": "user", "content": "a user, as JSON"}], max_tokens=80,
                    temperature=1.0, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert body["stop_reason"] == "end_turn"
    jsonschema.validate(json.loads(body["content"][0]["text"]), schema)
    # streamed: the same constraint on the Messages stream
    text = []
    with httpx.stream("POST", ours.url + "/v1/messages", timeout=120, json=dict(
            messages=[{"role": "user", "content": "a user, as JSON"}], max_tokens=80, stream=True, temperature=1.0,
            output_config={"format": {"type": "json_schema", "schema": schema}})) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev["type"] == "content_block_delta":
                    text.append(ev["delta"]["text"])
    jsonschema.validate(json.loads("".join(text)), schema)
