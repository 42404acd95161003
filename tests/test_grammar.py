"""Structured output: JSON schemas as token masks that follow the row's tokens exactly."""

import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import json

import jsonschema
import mlx.core as mx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from segcache.errors import GrammarError
from segcache.grammar import Grammars, grammar_for
from segcache.processors import make_processors
from segcache.sampling import Keys, Sampler
from segcache.testing.decode import plain_decode, plain_decode_rows
from test_processors import shipped, speculative_greedy

OBJ = {"type": "object", "additionalProperties": False}

SCHEMAS = {
    "person": {**OBJ, "properties": {"name": {"type": "string", "maxLength": 16},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "enums": {**OBJ, "properties": {"status": {"enum": ["open", "closed", "pending"]},
                                    "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["status", "priority"]},
    "int_array": {**OBJ, "properties": {"values": {"type": "array", "minItems": 1, "maxItems": 5,
                                                   "items": {"type": "integer", "minimum": -100, "maximum": 100}}},
                  "required": ["values"]},
    "nested": {**OBJ, "properties": {"user": {**OBJ, "properties": {"id": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9999},
                                                                    "name": {"type": "string", "maxLength": 12}},
                                              "required": ["id", "name"]},
                                     "active": {"type": "boolean"}},
               "required": ["user", "active"]},
    "objects_array": {**OBJ, "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        **OBJ, "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                              "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    "optional": {**OBJ, "properties": {"title": {"type": "string", "maxLength": 20},
                                       "tags": {"type": "array", "maxItems": 4,
                                                "items": {"enum": ["a", "b", "c"]}},
                                       "draft": {"type": "boolean"}},
                 "required": ["title"]},
    "deep": {**OBJ, "properties": {"a": {**OBJ, "properties": {"b": {**OBJ, "properties": {
        "c": {**OBJ, "properties": {"d": {"enum": [1, 2, 3]}}, "required": ["d"]}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    "nullable": {**OBJ, "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                                                           {"type": "null"}]},
                                       "unit": {"enum": ["m", "s", "kg"]}},
                 "required": ["value", "unit"]},
    "top_array": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 8}},
    "mixed": {**OBJ, "properties": {"ok": {"type": "boolean"},
                                    "code": {"type": "integer", "minimum": 100, "maximum": 599},
                                    "reasons": {"type": "array", "maxItems": 2,
                                                "items": {"type": "string", "maxLength": 10}},
                                    "meta": {**OBJ, "properties": {"v": {"const": 2}}, "required": ["v"]}},
              "required": ["ok", "code", "reasons", "meta"]},
}

PROMPT = "# the answer, as JSON:\nresult = "


def response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def grammars():
    _, tokenizer = shipped()
    return Grammars(tokenizer, 1536)


def test_200_schema_generations_parse_and_validate(grammars):
    """10 schemas x 20 sampled generations on the shipped target, each with its own
    seed: every output is complete JSON that validates against its schema."""
    model, tokenizer = shipped()
    prompt = tokenizer.encode(PROMPT)
    eos = tokenizer.eos_token_ids
    outputs = set()
    for name, schema in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        rows = [(make_processors(vocab_size=1536, grammar=grammars.compile(response_format(schema))),
                 Sampler(1.0), Keys(1000 + i)) for i in range(20)]
        results = plain_decode_rows(model, prompt, rows, max_tokens=200, eos=eos)
        for (procs, _, _), tokens in zip(rows, results):
            assert tokens[-1] in eos, f"{name}: no EOS within 200 tokens: {tokenizer.decode(tokens)!r}"
            assert procs.grammar.done
            text = tokenizer.decode(tokens[:-1])
            value = json.loads(text)
            jsonschema.validate(value, schema)
            outputs.add((name, text))
    assert len(outputs) > 100  # the samples differ: the test did not check one answer 200 times


def test_json_object_is_any_object(grammars):
    model, tokenizer = shipped()
    g = grammars.compile({"type": "json_object"})
    procs = make_processors(vocab_size=1536, grammar=g)
    tokens, _ = plain_decode(model, tokenizer.encode(PROMPT), max_tokens=300, processors=procs,
                             eos=tokenizer.eos_token_ids)
    if tokens[-1] in tokenizer.eos_token_ids:
        assert isinstance(json.loads(tokenizer.decode(tokens[:-1])), dict)
    else:  # unbounded: the model may still be writing; what it wrote is a JSON object's prefix
        assert tokenizer.decode(tokens).startswith("{")
    assert grammars.compile({"type": "text"}) is None and grammar_for(None) is None


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format.type"),
    ({"json_schema": {}}, "response_format"),
    ("json", "response_format"),
])
def test_invalid_formats_raise_a_typed_error_naming_the_field(grammars, fmt, param):
    with pytest.raises(GrammarError) as e:
        grammars.compile(fmt)
    assert e.value.param == param and str(e.value)


# -- the state follows the emitted tokens: masks, advance, rollback, fork -------------------


def allowed(mask_row):
    return [t for t, v in enumerate(mask_row.tolist()) if v]


def test_verify_masks_are_the_masks_after_each_draft_and_change_nothing(grammars):
    _, tokenizer = shipped()
    g = grammars.compile(response_format(SCHEMAS["nested"]))
    text = '{"user": {"id": 42, "name": "bob"}, "active": true}'
    ids = tokenizer.encode(text)
    g.advance(ids[:3])
    drafts = ids[3:8]
    masks = g.masks(drafts)
    step = g.fork()
    for j in range(len(drafts) + 1):
        assert mx.array_equal(masks[j : j + 1], step.masks([])).item()
        assert mx.array_equal(g.mask_after(drafts[:j]), masks[j : j + 1]).item()
        if j < len(drafts):
            step.advance([drafts[j]])
    assert g.consumed == 3 and mx.array_equal(g.masks([]), masks[:1]).item()
    # A forbidden draft: its row forbids it, the rows after it are unreachable (all allowed).
    bad = tokenizer.encode("zz")[0]
    masks = g.masks([drafts[0], bad, drafts[1]])
    assert not masks[1, bad].item()
    assert masks[2:].all().item()
    g.check()


def test_a_forbidden_token_raises_and_changes_nothing(grammars):
    _, tokenizer = shipped()
    g = grammars.compile(response_format(SCHEMAS["enums"]))
    ids = tokenizer.encode('{"status": "open"')
    g.advance(ids)
    before = g.masks([])
    with pytest.raises(GrammarError):
        g.advance(tokenizer.encode(', "x'))
    assert g.consumed == len(ids) and mx.array_equal(g.masks([]), before).item()
    with pytest.raises(ValueError):
        g.rollback(len(ids) + 1)
    assert g.consumed == len(ids) and mx.array_equal(g.masks([]), before).item()
    g.check()


def test_eos_after_the_end_rolls_back_like_any_token(grammars):
    _, tokenizer = shipped()
    eos = sorted(tokenizer.eos_token_ids)[0]
    g = grammars.compile(response_format(SCHEMAS["enums"]))
    ids = tokenizer.encode('{"status": "open", "priority": 3}')
    g.advance(ids)
    assert g.done and allowed(g.masks([])[0]) == [eos]
    g.advance([eos])
    assert g.consumed == len(ids) + 1
    g.rollback(2)  # EOS and "}"
    assert not g.done and g.consumed == len(ids) - 1
    g.advance(ids[-1:] + [eos])
    g.check()


class GrammarMachine(RuleBasedStateMachine):
    """A grammar driven by random allowed tokens, forbidden tokens, rollbacks and
    forks, compared after every step with a fresh grammar fed the same tokens."""

    def __init__(self):
        super().__init__()
        _, self.tokenizer = shipped()
        self.grammars = Grammars(self.tokenizer, 1536)
        self.fmt = response_format(SCHEMAS["optional"])
        self.g = self.grammars.compile(self.fmt)
        self.tokens = []
        self.eos = set(self.tokenizer.eos_token_ids)

    def pick_chain(self, n, pick):
        """Up to n allowed tokens in a row, stopping at an EOS (generation ends there)."""
        chosen = []
        for _ in range(n):
            ok = allowed(self.g.mask_after(chosen)[0])
            chosen.append(ok[pick % len(ok)])
            if chosen[-1] in self.eos:
                break
        return chosen

    def reference(self):
        fresh = self.grammars.compile(self.fmt)
        fresh.advance(self.tokens)
        return fresh

    @precondition(lambda self: not (self.tokens and self.tokens[-1] in self.eos))
    @rule(pick=st.integers(0, 10**6), n=st.integers(1, 3))
    def advance_allowed(self, pick, n):
        chosen = self.pick_chain(n, pick)
        self.g.advance(chosen)
        self.tokens += chosen

    @rule(pick=st.integers(0, 1535))
    def advance_forbidden(self, pick):
        if self.g.mask_after([])[0, pick].item():
            return
        with pytest.raises(GrammarError):
            self.g.advance([pick])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def rollback(self, data):
        n = data.draw(st.integers(1, len(self.tokens)))
        self.g.rollback(n)
        del self.tokens[len(self.tokens) - n :]

    @precondition(lambda self: not (self.tokens and self.tokens[-1] in self.eos))
    @rule(pick=st.integers(0, 10**6))
    def fork_is_independent(self, pick):
        other = self.g.fork()
        ok = allowed(other.masks([])[0])
        other.advance([ok[pick % len(ok)]])
        assert other.consumed == self.g.consumed + 1

    @precondition(lambda self: not (self.tokens and self.tokens[-1] in self.eos))
    @rule(k=st.integers(0, 4), pick=st.integers(0, 10**6))
    def verify_masks(self, k, pick):
        drafts = self.pick_chain(k, pick)
        k = len(drafts)
        masks = self.g.masks(drafts)
        ref = self.reference()
        # Rows after an EOS draft are never used (generation ends at EOS): not compared.
        k = next((i for i, d in enumerate(drafts) if d in self.eos), k)
        for j in range(k + 1):
            assert mx.array_equal(masks[j : j + 1], ref.masks([])).item()
            if j < k:
                ref.advance([drafts[j]])

    @invariant()
    def same_as_fresh(self):
        self.g.check()
        assert self.g.consumed == len(self.tokens)
        assert mx.array_equal(self.g.masks([]), self.reference().masks([])).item()


TestGrammarMachine = GrammarMachine.TestCase
TestGrammarMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


# -- speculation: greedy with a grammar is plain greedy ---------------------------------


def test_greedy_speculation_with_a_schema_is_plain_greedy(grammars):
    model, tokenizer = shipped()
    prompt = tokenizer.encode(PROMPT)
    eos = tokenizer.eos_token_ids
    fmt = response_format(SCHEMAS["mixed"])
    want, _ = plain_decode(model, prompt, max_tokens=80, eos=eos,
                           processors=make_processors(vocab_size=1536, grammar=grammars.compile(fmt)))
    bias = mx.random.normal((1536,), key=mx.random.key(4)) * 3.0

    class Draft:
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, inputs, cache=None, **kwargs):
            return model(inputs, cache=cache, **kwargs) + bias

    procs = make_processors(vocab_size=1536, repetition_penalty=1.1, grammar=grammars.compile(fmt))
    want_pen, _ = plain_decode(model, prompt, max_tokens=80, eos=eos,
                               processors=make_processors(vocab_size=1536, repetition_penalty=1.1,
                                                          grammar=grammars.compile(fmt)))
    for processors, expect in ((make_processors(vocab_size=1536, grammar=grammars.compile(fmt)), want),
                               (procs, want_pen)):
        for draft, rows in ((Draft(), 1), (Draft(), 2), (None, 1), (None, 2)):  # a draft model or prompt lookup
            # every row its own grammar state (Processors.fork), from the same schema
            got, stats = speculative_greedy(model, draft, prompt, processors.fork(), width=3, max_tokens=80,
                                            eos=eos, rows=rows)
            assert got == expect, (draft, rows)
            if draft is not None:
                assert 0 < stats["accepted"] < stats["drafted"]
    json.loads(tokenizer.decode(want[:-1]))
