"""The serve package's pure parts: stop strings over streamed text, chat prompts
and their boundaries (against mlx_lm.server's own convert_chat), request parsing."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import json

import mlx_lm
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.server import convert_chat

from segcache.serve import schemas
from segcache.serve.chat import Prompter
from segcache.serve.errors import APIError
from segcache.serve.text import StopText
from serve_util import TARGET

ALPHABET = "ab\nc"


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=30), cuts=st.lists(st.integers(0, 30), max_size=8),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
def test_stop_text_emits_exactly_the_text_before_the_first_stop(text, cuts, stops):
    # the stop that completes first (then the longest) cuts the text at its start
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    want = text[: min(hits)[1]] if hits else text
    f = StopText(stops)
    out, pos = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        out.append(f.feed(text[pos:c]))
        pos = max(pos, c)
        # never emits beyond what is certain: a prefix of the answer at every step
        assert want.startswith("".join(out))
    out.append(f.flush())
    assert "".join(out) == want
    assert f.stopped == bool(hits)


@pytest.fixture(scope="module")
def tokenizer():
    return mlx_lm.load(str(TARGET))[1]


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_plain_chat_prompt_is_mlx_lm_servers_and_boundaries_are_shared_prefixes(tokenizer):
    p = Prompter(tokenizer)
    assert not p.templated
    pairs = [("system", "You write Python."), ("user", "def f(x):"), ("assistant", " return x"), ("user", "def g():")]
    prompt = p.chat(_msgs(*pairs))
    ids, cuts = prompt.ids, prompt.checkpoints
    assert ids == tokenizer.encode(convert_chat([{"role": r, "content": c} for r, c in pairs]))
    sys_end = len(tokenizer.encode("ASSISTANT's RULE: You write Python.\n"))
    last_user = tokenizer.encode("ASSISTANT's RULE: You write Python.\nUSER: def f(x):\nASSISTANT:  return x\n")
    whole = tokenizer.encode(convert_chat([{"role": r, "content": c} for r, c in pairs])[: -len("ASSISTANT:")])
    assert len(cuts) == 3  # the system prompt's end, the last question's start, the conversation's end
    assert 0 < cuts[0] <= sys_end and ids[: cuts[0]] == tokenizer.encode("ASSISTANT's RULE: You write Python.\n")[: cuts[0]]
    assert 0 < cuts[1] <= len(last_user) and ids[: cuts[1]] == last_user[: cuts[1]]
    assert cuts[1] >= len(last_user) - 2  # at most the merge across the boundary is lost
    assert ids[: cuts[2]] == whole[: cuts[2]] and cuts[2] >= len(whole) - 2
    # no system prompt, one user message: nothing to checkpoint inside the prompt
    assert p.chat(_msgs(("user", "hi"))).checkpoints == []


def test_chat_template_is_used_when_given(tokenizer):
    tmpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    p = Prompter(tokenizer, tmpl)
    prompt = p.chat(_msgs(("system", "S"), ("user", "U")))
    ids, cuts = prompt.ids, prompt.checkpoints
    assert tokenizer.decode(ids) == "<system>S\n<user>U\n<assistant>"
    assert cuts and tokenizer.decode(ids[: cuts[0]]).startswith("<system>S")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "presence_penalty": "much"}, "presence_penalty"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
])
def test_parse_refuses_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        schemas.parse(json.dumps(body).encode(), schemas.CompletionRequest)
    assert e.value.status == 400 and e.value.param == param


def test_parse_accepts_openai_clients_extras():
    req = schemas.parse(json.dumps({"prompt": "x", "user": "me", "presence_penalty": 0, "max_tokens": 3,
                                    "stop": "\n", "logprobs": 2}).encode(), schemas.CompletionRequest)
    assert (req.limit(), req.stops(), req.top_logprobs()) == (3, ["\n"], 2)
    req = schemas.parse(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                    "max_completion_tokens": 5, "max_tokens": 9}).encode(), schemas.ChatRequest)
    assert req.limit() == 5 and req.messages[0].text() == "hi"


class _FakeEngine:
    """Yields `n` chunks then a Finish per request; records the order of steps."""

    def __init__(self):
        self.steps, self.closed, self.flushes = [], [], 0

    def generate(self, req):
        from segcache.serve.engine import Chunk, Finish, Usage

        try:
            for i in range(req.max_tokens):
                self.steps.append(req.id)
                yield Chunk(str(i))
            yield Finish("length", Usage(len(req.ids), req.max_tokens, 0))
        finally:
            self.closed.append(req.id)

    def flush(self):
        self.flushes += 1


def test_scheduler_is_fifo_bounded_and_drops_cancelled_jobs():
    from segcache.serve.engine import Finish, GenRequest
    from segcache.serve.worker import Job, QueueFull, Scheduler

    eng = _FakeEngine()
    sch = Scheduler(eng, max_queue=2)
    got = {}
    jobs = [Job(GenRequest(id=f"r{i}", ids=[1], max_tokens=2), lambda ev, i=i: got.setdefault(i, []).append(ev))
            for i in range(4)]
    for j in jobs[:3]:  # one running slot + two waiting
        sch.submit(j)
    with pytest.raises(QueueFull):
        sch.submit(jobs[3])
    jobs[1].cancel()  # gone while waiting: never started
    while sch.step():
        pass
    assert eng.steps == ["r0", "r0", "r2", "r2"]  # whole requests, in arrival order
    assert 1 not in got and isinstance(got[0][-1], Finish) and isinstance(got[2][-1], Finish)
    assert eng.closed == ["r0", "r2"] and eng.flushes == 1  # flushed once idle, not while r2 waited
    # a running job cancelled mid-way is closed at the next step and delivers nothing more
    job = Job(GenRequest(id="r9", ids=[1], max_tokens=50), lambda ev: got.setdefault(9, []).append(ev))
    sch.submit(job)
    sch.step()
    job.cancel()
    while sch.step():
        pass
    assert len(got[9]) == 1 and eng.closed[-1] == "r9" and sch.pending() == 0


def test_default_store_dir_is_per_identity_under_the_user_cache_and_private(tmp_path, monkeypatch):
    import sys

    from segcache.serve.cli import parse_size
    from segcache.serve.paths import default_cache_dir, private_dirs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    a, b = default_cache_dir(b"\x01" * 32), default_cache_dir(b"\x02" * 32)
    assert a != b
    if sys.platform != "darwin":
        assert a.parent == tmp_path / "xdg" / "segcache" / "serve"
    private_dirs(a)
    for d in (a, a.parent, a.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700
    assert (parse_size("512M"), parse_size("4GiB"), parse_size("1024")) == (512 << 20, 4 << 30, 1024)


def test_cli_refuses_bad_flags_and_missing_models(tmp_path, capsys):
    from segcache.cli import main

    assert main(["serve", "--model", str(TARGET), "--num-draft-tokens", "0"]) == 2
    assert "--num-draft-tokens" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "nothing"), "--prompt-cache-dir", str(tmp_path / "s")]) == 1
    assert "cannot load the model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(TARGET), "--draft-model", "d", "--prompt-lookup"])  # one drafter


QWEN_LIKE = (TARGET.parent / "chat_template.jinja").read_text()  # one system message, first (Qwen's rule)


def test_system_messages_a_template_refuses_are_merged_into_the_first(tokenizer):
    """Codex CLI sends two developer messages in a row, Claude Code system messages later on:
    where the template takes one system message first, the leading ones render as one, in order,
    and later ones as user messages."""
    p = Prompter(tokenizer, QWEN_LIKE)

    def rendered(msgs):
        return tokenizer.apply_chat_template(msgs, chat_template=QWEN_LIKE, add_generation_prompt=True,
                                             tokenize=False)

    with pytest.raises(Exception, match="system message must come first"):
        rendered(_msgs(("system", "A"), ("system", "B"), ("user", "Q")))  # the template's own refusal
    expected = tokenizer.encode(rendered(_msgs(("system", "A\n\nB"), ("user", "Q"))), add_special_tokens=False)
    assert p.chat(_msgs(("developer", "A"), ("developer", "B"), ("user", "Q"))).ids == expected
    # a system message after another message: a user message where it is, so the prefix before it
    # renders as it did before it came (the prefix cache keeps serving it)
    later = _msgs(("system", "A"), ("user", "Q"), ("assistant", "R"), ("system", "B"), ("user", "Q2"))
    assert p.chat(later).ids == tokenizer.encode(rendered(_msgs(("system", "A"), ("user", "Q"), ("assistant", "R"),
                                                                ("user", "B"), ("user", "Q2"))),
                                                  add_special_tokens=False)
    # one system message first is rendered as sent
    one = _msgs(("system", "A"), ("user", "Q"))
    assert p.chat(one).ids == tokenizer.encode(rendered(one), add_special_tokens=False)
    # what the template refuses for another reason is still a 400 naming the field
    with pytest.raises(APIError) as e:
        p.chat(_msgs(("system", "A"), ("assistant", "B")))
    assert e.value.status == 400 and e.value.param == "messages"
