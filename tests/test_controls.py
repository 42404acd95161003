"""A request's controls: mlx_lm.server's defaults, checks naming the field, the built pieces."""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import inspect
import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from segcache.controls import Controls
from segcache.errors import GrammarError, ParamError
from segcache.grammar import Grammars
from segcache.testing.decode import plain_decode
from test_processors import shipped


def test_defaults_are_mlx_lms():
    sampler = inspect.signature(make_sampler).parameters
    procs = inspect.signature(make_logits_processors).parameters
    c = Controls()
    assert c.xtc_threshold == sampler["xtc_threshold"].default
    assert c.xtc_probability == sampler["xtc_probability"].default
    assert c.top_k == sampler["top_k"].default and c.min_p == sampler["min_p"].default
    for name in ("repetition", "presence", "frequency"):
        assert getattr(c, f"{name}_context_size") == procs[f"{name}_context_size"].default
    assert c.sampler(None) is None  # temperature 0: greedy
    assert not c.processors(100)  # nothing on


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 1.5), ("min_p", -1), ("top_k", -1), ("top_k", 2.5),
    ("xtc_probability", 1.1), ("xtc_threshold", 0.6), ("repetition_penalty", -1.0),
    ("presence_penalty", float("nan")), ("frequency_penalty", "a lot"), ("frequency_context_size", -2),
    ("repetition_context_size", True), ("seed", 1.5), ("logit_bias", {"x": 1}), ("logit_bias", {"5": "big"}),
    ("logit_bias", {"100": 1.0}), ("logit_bias", {"-1": 1.0}), ("logit_bias", [1, 2]),
])
def test_a_bad_field_is_named(field, value):
    with pytest.raises(ParamError) as e:
        Controls(**{field: value}).check(vocab_size=100)
    assert e.value.param == field


def test_a_seeded_request_with_every_control_draws_what_mlx_lm_server_draws():
    """The fields as JSON sends them (logit_bias keys are strings); mlx_lm.server builds
    mlx-lm's sampler and processors from them and seeds the global generator."""
    model, tokenizer = shipped()
    body = json.loads('{"temperature": 0.9, "top_p": 0.95, "top_k": 50, "min_p": 0.02, "xtc_probability": 0.3,'
                      ' "xtc_threshold": 0.1, "logit_bias": {"17": 1.5, "262": -2}, "repetition_penalty": 1.2,'
                      ' "repetition_context_size": 10, "presence_penalty": 0.4, "frequency_penalty": 0.3,'
                      ' "frequency_context_size": 0, "seed": 5}')
    c = Controls(**body)
    c.check(vocab_size=1536)
    prompt = tokenizer.encode("class Stack:\n    def __init__(self):\n        ")
    mx.random.seed(5)
    ref_sampler = make_sampler(0.9, top_p=0.95, top_k=50, min_p=0.02, xtc_probability=0.3, xtc_threshold=0.1,
                               xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))
    ref_procs = make_logits_processors({17: 1.5, 262: -2.0}, 1.2, 10, 0.4, 20, 0.3, 0)
    want = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=30, sampler=ref_sampler,
                                        logits_processors=ref_procs)]
    got, _ = plain_decode(model, prompt, max_tokens=30, processors=c.processors(1536),
                          sampler=c.sampler(tokenizer), keys=c.keys())
    assert got == want


def test_response_format_builds_a_grammar():
    _, tokenizer = shipped()
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    procs = Controls(response_format=fmt).processors(1536, Grammars(tokenizer, 1536))
    assert procs.grammar is not None and procs.window == -1
    assert Controls(response_format={"type": "text"}).processors(1536).grammar is None
    with pytest.raises(ParamError) as e:
        Controls(response_format=fmt).processors(1536)  # a server without a grammar engine
    assert e.value.param == "response_format"
    with pytest.raises(GrammarError) as e:
        Controls(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 3}}}).processors(
            1536, Grammars(tokenizer, 1536))
    assert e.value.param == "response_format.json_schema.schema"


def test_choices_have_their_own_reproducible_streams():
    c = Controls(temperature=1.0, seed=9)
    base = c.keys()
    assert mx.array_equal(base.spawn(0).next(), Controls(seed=9).keys().next()).item()
    assert mx.array_equal(base.spawn(3).next(), c.keys().spawn(3).next()).item()
    assert not mx.array_equal(base.spawn(1).next(), base.spawn(2).next()).item()
