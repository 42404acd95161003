"""Prefixes computed once (issue 32 item 5), through the official `anthropic` and `openai` clients
against a real server on loopback, on the shipped hybrid target served with a tools template:
a fan-out of requests sharing a long prefix computes it once (store counters, usage) and answers
as each request does alone; a waiter whose leader stalls or fails computes itself; and the first
turn checkpoints where the tool schemas end, on every chat surface."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import contextlib
import json
import random
import shutil
import threading
import time
import types

import mlx.core as mx
import mlx_lm
import openai
import pytest

from chat_util import LocalServer
from conftest import tiny
from serve_util import TARGET
from segcache import Runtime, open_store
from segcache import prefill as store_prefill
from segcache.serve import fanout
from segcache.testing import models as tiny_models
from segcache.testing.chat import template

TEXT = (TARGET.parent / "heldout_other.txt").read_text()
SYSTEM = "You are a coding agent in a Python repository. Read before you change anything.\n\n" + TEXT[:3000]
TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": TEXT[3000 + 400 * i : 3400 + 400 * i],
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "a path"}},
                   "required": ["path"]}}} for i in range(5)]
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
TASKS = ["Search the repository for every call of parse_date.", "Read tests/test_http.py and summarize it.",
         "Find where the command line flags are defined.", "Check whether README.md documents the config."]
MODEL = "default_model"
WAIT = 120  # seconds a test waits for its requests at most

# Tools rendered before the system text (as the shipped models' own template does).
TOOLS_FIRST = "".join([
    "{%- if tools %}<|im_start|>tools{{ '\\n' }}{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}"
    "{%- endfor %}<|im_end|>{{ '\\n' }}{%- endif %}",
    "{%- for message in messages %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>"
    "{{ '\\n' }}{%- endfor %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}",
])


def _with_template(src, dst, chat_template):
    """The model directory `src` again at `dst` (weights linked) with `chat_template` and JSON tool calls."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(chat_template=chat_template, tool_parser_type="json_tools")
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fanout")
    return {"system-first": _with_template(TARGET, root / "system-first", template("json_tools")),
            "tools-first": _with_template(TARGET, root / "tools-first", TOOLS_FIRST)}


@pytest.fixture(scope="module")
def tokenizer(models):
    return mlx_lm.load(str(models["system-first"]))[1]


def _ids(tokenizer, system, task):
    """The prompt as the template renders it for the model (independently of the server)."""
    return list(tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": task}],
                                              tools=TOOLS, add_generation_prompt=True))


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@contextlib.contextmanager
def held(srv, n):
    """The server's next scheduler step starts only once `n` requests are queued or running
    (at most WAIT seconds), so they meet while the first one's prompt is being prefilled."""
    sched = srv.worker.scheduler
    own = sched.begin_step

    def gate():
        sched.begin_step = own
        deadline = time.monotonic() + WAIT
        while sched.pending() < n and time.monotonic() < deadline:
            time.sleep(0.01)
        own()

    sched.begin_step = gate
    try:
        yield
    finally:
        sched.begin_step = own


def together(fns):
    """Run the callables at once on threads; their results (or exceptions) in order."""
    got = [None] * len(fns)

    def one(i):
        try:
            got[i] = fns[i]()
        except Exception as exc:  # the caller asserts on it
            got[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a request did not end"
    return got


def rate(monkeypatch, seconds_per_token):
    """The store's compute rate as the waiting sees it (what it bounds a wait by)."""
    real = store_prefill.lookahead
    monkeypatch.setattr(store_prefill, "lookahead", lambda rt, ids: (real(rt, ids)[0], seconds_per_token))


def ask_messages(client, task, **extra):
    m = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, tools=A_TOOLS,
                               messages=[{"role": "user", "content": task}], extra_body=extra or None)
    return "".join(getattr(b, "text", "") for b in m.content), m.usage


def ask_chat(client, task, **extra):
    r = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0.0, tools=TOOLS,
                                       messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
                                       extra_body=extra or None)
    return r.choices[0].message.content, r.usage


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])  # dense, hybrid, sliding window
def test_a_shared_prefix_is_published_as_soon_as_the_prefill_reaches_it(tmp_path, family):
    """`Prefill.share`: half way through a prefill the store holds the prefix already; a prompt
    through it resumes there and gets the logits of computing it cold; the end publishes the rest."""
    model, rnd = tiny(family), random.Random(7)
    a = [rnd.randrange(tiny_models.VOCAB) for _ in range(40)]
    b = a[:29] + [(t + 1) % tiny_models.VOCAB for t in a[29:35]]
    with open_store(tmp_path, page_tokens=16) as store:
        rt = Runtime(model, store=store)
        plan = store_prefill.begin(rt, a, 0)
        assert plan.share(29) and not plan.share(41)
        feed = plan.feed(rt, 8)
        for pos in feed:
            if pos >= 29:
                break
        assert plan.shared == {29} and plan.left == 11
        plan.check()
        got = Runtime(model, store=store).prefill_steps(b)
        assert next(got).restored == 29  # while the first prompt is still being prefilled
        logits = _drain(got)
        cold = Runtime(model).prefill(b)
        assert mx.allclose(logits, cold, atol=1e-4, rtol=1e-4).item(), mx.abs(logits - cold).max().item()
        for _ in feed:
            pass
        assert not plan.share(35) and plan.finish(rt) > 0
        assert next(Runtime(model, store=store).prefill_steps(a + [1])).restored == 40


def test_a_prompt_sharing_no_more_than_the_leaders_resume_looks_nothing_up(monkeypatch):
    """`Fanout.wait`: a prompt that shares with the one being prefilled little more than what that
    one restored from the store (a fan-out after the prefix was stored) returns at once, without
    the store lookup that sizes a wait; one sharing more than that looks it up."""
    lookups = []
    monkeypatch.setattr(fanout.store_prefill, "lookahead", lambda rt, ids: lookups.append(len(ids)) or (0, 1.0))
    engine = types.SimpleNamespace(model=tiny("llama"), store=None, prefill_batch=None)
    prefix = list(range(300))
    plan = types.SimpleNamespace(ids=prefix + [1] * 250, resume=store_prefill.Resume(290, 290), pos=290,
                                 shared=set(), share=lambda position: False)
    waits = fanout.Fanout(engine, enabled=True)
    waits.leads["lead"] = fanout.Lead("lead", None, types.SimpleNamespace(plan=plan, in_batch=False, fed=0))
    for task in ([2] * 40, [1] * 200 + [2] * 10):  # 10 and 210 tokens past the leader's restored 290
        for _ in waits.wait(types.SimpleNamespace(ids=prefix + task, cache_salt=None)):
            break
    assert lookups == [len(prefix) + 209]


def _drain(steps):
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def test_a_fan_out_computes_the_shared_prefix_once_and_answers_as_alone(models, tokenizer, tmp_path, monkeypatch):
    """Four subagents at once with one system prompt and tool list (~2,000 tokens): the first
    computes the prefix, the other three wait for its checkpoint and compute only their tasks."""
    ids = [_ids(tokenizer, SYSTEM, t) for t in TASKS]
    assert min(_common(ids[0], i) for i in ids[1:]) > 1500  # a long shared prefix
    with LocalServer(models["system-first"], store_dir=tmp_path / "s", engine=dict(decode_concurrency=8)) as srv:
        rate(monkeypatch, 1.0)  # a generous bound: the leader's pace on a loaded machine does not end a wait
        client = srv.anthropic()
        before = srv.store.stats()
        with held(srv, len(TASKS)):
            got = together([lambda t=t: ask_messages(client, t) for t in TASKS])
        after = srv.store.stats()
        assert not any(isinstance(g, Exception) for g in got), got
        usage = [u for _, u in got]
        assert [u.input_tokens + u.cache_read_input_tokens for u in usage] == [len(i) for i in ids]
        cached = [u.cache_read_input_tokens for u in usage]
        assert cached.count(0) == 1, cached  # one computed the prefix
        lead = cached.index(0)
        for k, (n, i) in enumerate(zip(cached, ids)):
            if k != lead:  # each other one resumed exactly what it shares with the leader
                assert n == _common(i[:-1], ids[lead][:-1]), (k, n)
        delta = {k: after[k] - before[k] for k in ("hits", "misses", "hit_tokens")}
        assert delta == {"hits": 3, "misses": 1, "hit_tokens": sum(cached)}, delta
        assert (srv.engine.fanout.waited, srv.engine.fanout.gave_up) == (3, 0)
        srv.engine.fanout.check()
        assert not srv.engine.fanout.leads  # every prefill ended
        # each computed alone (a domain of its own: nothing resumed, nobody in flight) answers the same
        for k, task in enumerate(TASKS):
            text, u = ask_messages(client, task, cache_salt=f"alone-{k}")
            assert u.cache_read_input_tokens == 0 and text == got[k][0], k


class Failing:
    """The server's prefill batch, its `fail`-th forward raising."""

    def __init__(self, batch, fail):
        self.batch, self.fail, self.calls = batch, fail, 0
        self.step = batch.step
        batch.step = self

    def __call__(self, budget):
        self.calls += 1
        if self.calls == self.fail:
            raise RuntimeError("this prefill forward fails")
        return self.step(budget)


class Stalled:
    """The engine's prefill-batch step: run `runs` times, then skipped (every prompt in the batch
    stalls) until `until()` holds."""

    def __init__(self, engine, runs, until):
        self.runs, self.until = runs, until
        self.step = engine._prefill_step
        engine._prefill_step = self

    def __call__(self):
        if self.runs > 0 or self.until():
            self.runs -= 1
            return self.step()
        time.sleep(0.01)  # a scheduler step in which the batch did not move


def _alone(client, task):
    return ask_chat(client, task, cache_salt=f"alone-{task}")[0]


def test_a_waiter_whose_leader_stalls_computes_itself(models, tmp_path, monkeypatch):
    """The leader stops moving after its first forward: the waiter waits no longer than its own
    cost at the store's rate, then computes its prompt itself (nothing resumed), answering as alone."""
    with LocalServer(models["system-first"], store_dir=tmp_path / "s", engine=dict(decode_concurrency=8)) as srv:
        rate(monkeypatch, 1e-4)  # the shared ~2,000 tokens: ~0.2 s
        client = srv.openai()
        fanout = srv.engine.fanout
        Stalled(srv.engine, runs=1, until=lambda: fanout.gave_up > 0)  # the first forward runs before the waiter arrives
        with held(srv, 2):
            got = together([lambda t=t: ask_chat(client, t) for t in TASKS[:2]])
        assert not any(isinstance(g, Exception) for g in got), got
        assert [u.prompt_tokens_details.cached_tokens for _, u in got] == [0, 0]
        assert (fanout.waited, fanout.gave_up) == (0, 1)
        assert [text for text, _ in got] == [_alone(client, t) for t in TASKS[:2]]


def test_a_waiter_whose_leader_fails_computes_itself(models, tmp_path, monkeypatch):
    """The leader's second prefill forward fails (a 500 for it) while the other request waits
    for its prefix: the waiter computes the prompt itself and answers as alone."""
    with LocalServer(models["system-first"], store_dir=tmp_path / "s", engine=dict(decode_concurrency=8)) as srv:
        rate(monkeypatch, 1.0)
        client = srv.openai()
        Failing(srv.engine.prefill_batch, fail=2)  # the first forward runs before the waiter arrives
        with held(srv, 2):
            got = together([lambda t=t: ask_chat(client, t) for t in TASKS[:2]])
        failed = [g for g in got if isinstance(g, Exception)]
        assert len(failed) == 1 and isinstance(failed[0], openai.InternalServerError), got
        k = next(k for k, g in enumerate(got) if not isinstance(g, Exception))
        text, usage = got[k]
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert (srv.engine.fanout.waited, srv.engine.fanout.gave_up) == (0, 1)
        assert text == _alone(client, TASKS[k])


def test_the_first_turn_checkpoints_where_the_tools_end_on_every_surface(models, tmp_path):
    """On a template that renders the tools before the system text, a new conversation with the
    same tools and another system prompt resumes where the tools end after one first turn (not
    at the grid checkpoint below it): Messages, chat completions and Responses."""
    tok = mlx_lm.load(str(models["tools-first"]))[1]
    other = "You are a search subagent. Answer with paths only."
    shared = _common(_ids(tok, SYSTEM, TASKS[0]), _ids(tok, other, TASKS[1]))
    grid = shared // 256 * 256
    assert shared - grid > 16  # the tools end lies well past the grid checkpoint below it
    r_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    with LocalServer(models["tools-first"], store_dir=tmp_path / "s") as srv:
        a, o = srv.anthropic(), srv.openai()

        def messages(system, task, salt):
            m = a.messages.create(model=MODEL, max_tokens=4, system=system, tools=A_TOOLS,
                                  messages=[{"role": "user", "content": task}], extra_body={"cache_salt": salt})
            return m.usage.cache_read_input_tokens

        def chat(system, task, salt):
            r = o.chat.completions.create(model=MODEL, max_tokens=4, tools=TOOLS, extra_body={"cache_salt": salt},
                                          messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": task}])
            return r.usage.prompt_tokens_details.cached_tokens

        def responses(system, task, salt):
            r = o.responses.create(model=MODEL, max_output_tokens=4, instructions=system, input=task,
                                   tools=r_tools, extra_body={"cache_salt": salt})
            return r.usage.input_tokens_details.cached_tokens

        for surface in (messages, chat, responses):
            assert surface(SYSTEM, TASKS[0], surface.__name__) == 0  # the first turn of a first conversation
            resumed = surface(other, TASKS[1], surface.__name__)
            assert grid < resumed <= shared and shared - resumed <= 8, (surface.__name__, resumed, shared)
