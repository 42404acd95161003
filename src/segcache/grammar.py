"""Structured output: a JSON schema as a token mask that follows the row's branches.

    response_format ──Grammars.compile──> Grammar (a matcher over the tokenizer)
    verify of K drafts ──Grammar.masks(drafts)──> [K+1, V] allowed tokens, state unchanged
    tokens emitted ──advance──> the state moves; rollback(n) withdraws; fork() copies

The engine is llguidance (a Rust Earley parser over a token trie; its masks are
computed lazily per step, so a 150k-token vocabulary costs no up-front index
and a schema compiles in milliseconds). A mask is a processor like the
penalties (`Processors(grammar=...)`): speculative decoding stays exact because
every position of a verify is masked for the state after the drafts before it,
so a draft the grammar forbids has probability 0 and is rejected.

Whitespace inside the JSON is fixed (", " between items, ": " after keys, no
newlines) so that a model cannot pad an answer forever; a schema may choose
otherwise with llguidance's "x-guidance" key.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .errors import GrammarError, InvariantError

# The JSON layout unless a schema's "x-guidance" says otherwise.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Compiled grammars kept per tokenizer (a copy of a compiled matcher is cheap).
CACHED_GRAMMARS = 64

_executor = None


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency
        raise GrammarError("response_format", "structured output needs the llguidance package "
                           "(pip install llguidance)") from e
    return llguidance


def _run_executor():
    global _executor
    if _executor is None:
        # One worker: the rows of a round are few and the model worker owns the other core.
        _executor = _llguidance().LLExecutor(num_threads=1)
    return _executor


def grammar_for(response_format) -> Optional[str]:
    """llguidance grammar text for an OpenAI `response_format` (None for plain text).

    Accepts {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}} and
    {"type": "grammar", "grammar": {"syntax": "lark" | "regex", "definition": ...}}.

    Raises:
        GrammarError: the field is malformed; `param` names the part at fault.
    """
    llg = _llguidance()
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise GrammarError("response_format", 'response_format must be an object with a "type" '
                           '("text", "json_object" or "json_schema")')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "grammar":  # segcache's own: a Responses custom tool's Lark or regex format
        spec = response_format.get("grammar")
        if not isinstance(spec, dict) or spec.get("syntax") not in ("lark", "regex") \
                or not isinstance(spec.get("definition"), str):
            raise GrammarError("response_format.grammar", 'a "grammar" response_format needs "grammar": '
                               '{"syntax": "lark" or "regex", "definition": text}')
        if spec["syntax"] == "regex":
            return llg.LLMatcher.grammar_from_regex(spec["definition"])
        return llg.LLMatcher.grammar_from_lark(spec["definition"])
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema", 'a "json_schema" response_format needs a '
                               '"json_schema" object with the schema under "schema"')
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema.schema",
                               '"json_schema.schema" must be a JSON schema object')
    else:
        raise GrammarError("response_format.type", f"response_format type {kind!r} is not one of "
                           '"text", "json_object", "json_schema"')
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as e:
        raise GrammarError("response_format.json_schema.schema", f"not a JSON schema: {e}") from None


class Grammars:
    """The grammar compiler of one tokenizer (build once per model; ~1 s at 150k tokens).

    Args:
        tokenizer: an mlx-lm `TokenizerWrapper` or a fast Hugging Face tokenizer.
        vocab_size: the model's vocabulary (its logits' width; may exceed the
            tokenizer's, the extra ids are never allowed).
    """

    def __init__(self, tokenizer, vocab_size: int):
        llg = _llguidance()

        hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        self.vocab_size = vocab_size
        self.eos = eos
        try:
            self.tokenizer = llg.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        except ValueError:  # a decoder llguidance cannot read (a word-level vocabulary, Fuse): each token's text
            self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_TokenTexts(hf, eos[0])), n_vocab=vocab_size,
                                             eos_token=eos)
        self._compiled: OrderedDict = OrderedDict()
        # compile() may run on the HTTP side (a bad schema is a 400 before any stream starts).
        self._lock = threading.Lock()

    def compile(self, response_format) -> Optional["Grammar"]:
        """A fresh `Grammar` at the start of the output (None for plain text).

        Raises:
            GrammarError: malformed field, invalid or unsupported schema (`param`
                names the field; the message says what the compiler found).
        """
        text = grammar_for(response_format)
        if text is None:
            return None
        param = "response_format.grammar" if response_format.get("type") == "grammar" else \
            "response_format.json_schema.schema"
        with self._lock:
            template = self._compiled.get(text)
            if template is not None:
                self._compiled.move_to_end(text)
        if template is None:
            template = self._build(text, param)
            with self._lock:
                self._compiled[text] = template
                if len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return Grammar(template.deep_copy(), self.vocab_size, self.eos)

    def _build(self, text: str, param: str):
        llg = _llguidance()
        what = "grammar" if param.endswith("grammar") else "schema"
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if is_error:
            raise GrammarError(param, f"the {what} cannot be compiled: {messages[0] if messages else 'invalid'}")
        template = llg.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise GrammarError(param, f"the {what} cannot be compiled: {template.get_error()}")
        return template


class _TokenTexts:
    """A tokenizer as llguidance's `TokenizerWrapper` reads one: each token's bytes (its decoded
    text alone; special tokens as nothing), and encoding."""

    def __init__(self, hf, eos: int):
        self.hf = hf
        self.eos_token_id = eos
        self.bos_token_id = hf.bos_token_id
        self.special_token_ids = list(hf.all_special_ids)
        special = set(self.special_token_ids)
        self.tokens = [b"" if i in special else hf.decode([i]).encode("utf-8") for i in range(len(hf))]

    def __call__(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)


class Grammar:
    """A grammar's state over one row's emitted tokens (the `Stateful` processor).

    Attributes:
        matcher: the llguidance matcher, at the state after `consumed` tokens.
        consumed: tokens emitted through `advance` and not rolled back (>= 0;
            never in an error state: `check()`).
    """

    def __init__(self, matcher, vocab_size: int, eos: Sequence[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = frozenset(eos)
        self.consumed = 0
        # EOS tokens emitted after the output was complete (not in the matcher); <= consumed.
        self._eos_after_stop = 0
        self._words = (vocab_size + 31) // 32

    def bitmasks(self, drafts: Sequence[int]) -> np.ndarray:
        """Packed masks [K+1, ceil(V/32)] int32 (bit t of row j: token t allowed
        after drafts[:j]). Rows after a draft the grammar forbids, or after an
        EOS, allow everything: the acceptors never reach them, and nothing is
        emitted after an EOS."""
        drafts = [int(d) for d in drafts]
        out = np.full((len(drafts) + 1, self._words), -1, dtype=np.int32)
        fill_bitmasks([(self, drafts)], out)
        return out

    def masks(self, drafts: Sequence[int]) -> mx.array:
        """[K+1, V] bool: the allowed tokens after drafts[:j]; the state is unchanged."""
        return unpack(self.bitmasks(drafts), self.vocab_size)

    def mask_after(self, drafts: Sequence[int]) -> mx.array:
        """[1, V] bool: the allowed tokens after all of `drafts` (a drafter's next
        step); the state is unchanged. After a forbidden draft, everything."""
        drafts = [int(d) for d in drafts]
        out = np.full((1, self._words), -1, dtype=np.int32)
        n = self.matcher.try_consume_tokens(drafts) if drafts else 0
        try:
            if n == len(drafts):
                self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        finally:
            if n:
                self.matcher.rollback(n)
        return unpack(out, self.vocab_size)

    def advance(self, tokens: Sequence[int]) -> None:
        """The row emitted `tokens`. Fails closed: a token the grammar forbids
        raises and leaves the state as it was."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        n = self.matcher.validate_tokens(tokens) if not self.matcher.is_stopped() else 0
        if n and not self.matcher.consume_tokens(tokens[:n]):
            raise InvariantError(f"the grammar matcher validated {tokens[:n]} but failed to consume them: "
                                 f"{self.matcher.get_error()}")
        rest = tokens[n:]
        # EOS after a finished output is allowed but llguidance does not record it: count it here.
        if rest and not (self.matcher.is_stopped() and all(t in self.eos for t in rest)):
            if n:
                self.matcher.rollback(n)
            raise GrammarError("response_format", f"token {rest[0]} (at {n} of {tokens}) is not allowed "
                               f"by the grammar after {self.consumed} tokens; the state is unchanged")
        self.consumed += len(tokens)
        self._eos_after_stop += len(rest)

    def rollback(self, n: int) -> None:
        """Withdraw the last `n` emitted tokens (0 <= n <= consumed)."""
        if not 0 <= n <= self.consumed:
            raise ValueError(f"cannot roll back {n} tokens: the grammar holds {self.consumed}")
        unrecorded = min(n, self._eos_after_stop)
        if n > unrecorded and not self.matcher.rollback(n - unrecorded):
            raise InvariantError(f"the grammar matcher refused to roll back {n} of {self.consumed} "
                                 f"tokens: {self.matcher.get_error()}")
        self._eos_after_stop -= unrecorded
        self.consumed -= n

    def fork(self) -> "Grammar":
        """An independent copy at the same state (another branch or choice)."""
        other = Grammar(self.matcher.deep_copy(), self.vocab_size, self.eos)
        other.consumed = self.consumed
        other._eos_after_stop = self._eos_after_stop
        return other

    @property
    def done(self) -> bool:
        """The output is complete: only EOS is allowed now."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The tokens so far form a complete output (EOS is allowed)."""
        return self.matcher.is_accepting()

    def check(self) -> None:
        if not 0 <= self._eos_after_stop <= self.consumed:
            raise InvariantError(f"grammar holds {self.consumed} tokens, {self._eos_after_stop} of them "
                                 "EOS after the end: expected 0 <= EOS after the end <= tokens")
        if self.matcher.is_error():
            raise InvariantError(f"grammar matcher in an error state: {self.matcher.get_error()}")


def fill_bitmasks(rows: Sequence[tuple], out: np.ndarray) -> None:
    """The masks of several rows' verifies in one call (llguidance walks each
    row's drafts and rolls them back itself).

    Args:
        rows: (grammar, drafts) per row; row i's K_i+1 masks go to consecutive
            rows of `out`, rows in order.
        out: int32 [sum(K_i + 1), ceil(V/32)], C-contiguous, every bit set on entry
            (rows past a forbidden draft are left so).
    """
    with_drafts, without, at, unreachable = [], [], 0, []
    for grammar, drafts in rows:
        drafts = list(drafts)
        if drafts:
            with_drafts.append((grammar.matcher, at, drafts))
            # Masks past the first draft the grammar forbids are unreachable.
            unreachable.append((at + grammar.matcher.validate_tokens(drafts) + 1, at + len(drafts) + 1))
        else:
            without.append((grammar.matcher, at))
        at += len(drafts) + 1
    if at != out.shape[0] or out.dtype != np.int32 or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"out must be C-contiguous int32 with {at} rows, got {out.dtype} {out.shape}")
    executor, row_bytes = _run_executor(), out.shape[1] * 4
    if with_drafts:
        executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, out.ctypes.data, row_bytes, at)
    if without:
        executor.unsafe_compute_mask_ptr(without, out.ctypes.data, row_bytes, at)
    for start, end in unreachable:
        out[start:end] = -1


_BITS = None


def unpack(bitmasks: np.ndarray, vocab_size: int) -> mx.array:
    """[R, ceil(V/32)] int32 packed masks -> [R, V] bool, on the device."""
    global _BITS
    if _BITS is None:
        _BITS = mx.arange(32, dtype=mx.uint32)
    words = mx.array(bitmasks.view(np.uint32))
    bits = (words[:, :, None] >> _BITS) & 1
    return bits.reshape(bits.shape[0], -1)[:, :vocab_size].astype(mx.bool_)
