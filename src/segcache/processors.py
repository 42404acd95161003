"""Logits processors with mlx_lm.server's semantics, exact under speculation.

Plain decoding (mlx-lm's `generate_step`) hands each processor the tokens so
far and one row of raw logits; position i of a generation sees the prompt
and the i tokens emitted before it. A speculative verify forward yields the
logits of K+1 positions at once, position j following the drafts d_1..d_j
that have not been accepted yet. `Processors.process` gives every position
what plain decoding would have given it had d_1..d_j been emitted:

    history h (prompt + emitted, the pending token last)    drafts d1 d2 d3
    position 0 sees h           -> processed row 0
    position 1 sees h + d1      -> processed row 1
    position 2 sees h + d1 d2   -> processed row 2
    position 3 sees h + d1 d2 d3 -> processed row 3

The history-dependent processors (the penalties) are stateless: they read
the last `context_size` tokens of each position's sequence, all K+1 rows in
one gather/scatter. A stateful one (a grammar, `segcache.grammar`) advances
only on the tokens the row really emits (`advance`).

Every processor reproduces mlx-lm's `make_logits_processors` bit for bit:
the same operations in the same dtype on the same elements (tests compare
each against mlx-lm's own processor applied one position at a time).
Two behaviours of mlx-lm are kept on purpose: a context size of 0 means the
whole history (mlx-lm slices `tokens[-0:]`), and the processors run on raw
logits (the repetition penalty divides positive and multiplies negative
logits, so it is not shift-invariant: processors must get the model's
logits, not normalized logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union

import mlx.core as mx
import numpy as np

from .errors import ParamError

# mlx_lm.server's default context size of each penalty.
CONTEXT_SIZE = 20

TokenSeq = Union[Sequence[int], mx.array]


def normalize(logits: mx.array) -> mx.array:
    """Logprobs from logits, row by row, as mlx-lm computes them."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@dataclass(frozen=True)
class Windows:
    """The token contexts of R positions that extend one sequence by a token each.

    `seq` holds the tail of the history (what the widest context needs) and then
    the drafts; position j's context is `seq[starts[j] : ends[j]]`.

    Attributes:
        seq: token ids [L + K] (an mx array; may be unevaluated).
        index: [R, W] indices into `seq`, row j's context then padding.
        valid: [R, W] which entries of `index` are context, not padding.
        nonempty: [R, 1] which rows have any context at all.
    """

    seq: mx.array
    index: mx.array
    valid: mx.array
    nonempty: mx.array

    @property
    def tokens(self) -> mx.array:
        """[R, W] token ids; padding repeats the row's first context token."""
        return self.seq[self.index]


def windows(history: TokenSeq, drafts: TokenSeq, context_size: int) -> Optional[Windows]:
    """The contexts of the K+1 positions of a verify: history + drafts[:j], last
    `context_size` tokens of each (0 = all, as mlx-lm). None when all are empty.

    Args:
        history: the tokens before position 0 (prompt + emitted), list or array.
        drafts: the K drafts (list or [K] array, possibly unevaluated).
        context_size: tokens of context per position; 0 for the whole sequence.
    """
    if context_size < 0:
        raise ValueError(f"a context size is >= 0 (0 = whole history), got {context_size}")
    n_hist = history.size if isinstance(history, mx.array) else len(history)
    k = drafts.size if isinstance(drafts, mx.array) else len(drafts)
    # Only the last context_size - 1 tokens of the history reach row K's context
    # beyond row 0's; row 0 needs context_size of them.
    keep = n_hist if context_size == 0 else min(n_hist, context_size)
    if keep + k == 0:
        return None
    tail = history[n_hist - keep:] if keep else []
    seq = _concat(tail, drafts)
    ends = keep + np.arange(k + 1)
    starts = np.zeros_like(ends) if context_size == 0 else np.maximum(0, ends - context_size)
    lengths = ends - starts
    width = max(int(lengths.max()), 1)
    cols = np.arange(width)[None, :]
    valid = cols < lengths[:, None]
    # Padding points at the row's first context token: a scatter that sets the
    # same value twice is harmless, and frequency counts only `valid` entries.
    # A row without context points at 0 and is left as it is (`nonempty`).
    first = np.where(lengths > 0, starts, 0)[:, None]
    index = np.where(valid, starts[:, None] + cols, first)
    return Windows(seq, mx.array(index.astype(np.int32)), mx.array(valid),
                   mx.array((lengths > 0)[:, None]))


def _concat(a: TokenSeq, b: TokenSeq) -> mx.array:
    parts = [x if isinstance(x, mx.array) else mx.array(list(x), dtype=mx.int32) for x in (a, b)]
    parts = [x.astype(mx.int32).reshape(-1) for x in parts if x.size]
    if not parts:
        return mx.zeros((0,), dtype=mx.int32)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


class Penalty(Protocol):
    """A logits processor over rows: logits [R, V] and their contexts -> logits [R, V]."""

    context_size: int

    def __call__(self, logits: mx.array, ctx: Windows) -> mx.array: ...


def _rows(ctx: Windows) -> mx.array:
    r, w = ctx.index.shape
    return mx.broadcast_to(mx.arange(r)[:, None], (r, w))


class RepetitionPenalty:
    """mlx-lm's `make_repetition_penalty`: logits of tokens in the context are
    divided by `penalty` when positive and multiplied when negative."""

    def __init__(self, penalty: float, context_size: int = CONTEXT_SIZE):
        if not penalty >= 0:
            raise ParamError("repetition_penalty", f"repetition_penalty must be >= 0, got {penalty}")
        self.penalty = float(penalty)
        self.context_size = context_size

    def __call__(self, logits, ctx):
        tokens = ctx.tokens
        sel = mx.take_along_axis(logits, tokens, axis=-1)
        new = mx.where(sel < 0, sel * self.penalty, sel / self.penalty)
        return mx.put_along_axis(logits, tokens, mx.where(ctx.nonempty, new, sel), axis=-1)


class PresencePenalty:
    """mlx-lm's `make_presence_penalty`: `penalty` off every token in the context, once."""

    def __init__(self, penalty: float, context_size: int = CONTEXT_SIZE):
        self.penalty = float(penalty)
        self.context_size = context_size

    def __call__(self, logits, ctx):
        tokens = ctx.tokens
        sel = mx.take_along_axis(logits, tokens, axis=-1)
        return mx.put_along_axis(logits, tokens, mx.where(ctx.nonempty, sel - self.penalty, sel), axis=-1)


class FrequencyPenalty:
    """mlx-lm's `make_frequency_penalty`: `penalty` off a token for each time it is in
    the context (one scatter-subtract per occurrence, as mlx-lm)."""

    def __init__(self, penalty: float, context_size: int = CONTEXT_SIZE):
        self.penalty = float(penalty)
        self.context_size = context_size

    def __call__(self, logits, ctx):
        # Padding subtracts 0: x - 0 is x exactly, so the result is mlx-lm's sequence
        # of subtractions of `penalty`, one per occurrence.
        amount = mx.where(ctx.valid, mx.array(self.penalty, logits.dtype), mx.array(0, logits.dtype))
        return logits.at[_rows(ctx), ctx.tokens].subtract(amount)


class LogitBias:
    """mlx-lm's logit bias: a fixed amount added to the logits of given tokens.

    Args:
        bias: token id -> amount.
        vocab_size: the model's vocabulary size (ids must be below it).
    """

    context_size = -1  # reads no history

    def __init__(self, bias: dict, vocab_size: int):
        bad = [t for t in bias if not (isinstance(t, (int, np.integer)) and 0 <= int(t) < vocab_size)]
        if bad:
            raise ParamError("logit_bias", f"logit_bias names token ids outside the vocabulary "
                             f"[0, {vocab_size}): {bad[:5]}")
        self.bias = {int(t): float(v) for t, v in bias.items()}
        self._indices = mx.array(list(self.bias.keys()))
        self._values = mx.array(list(self.bias.values()))

    def __call__(self, logits, ctx):
        return logits.at[:, self._indices].add(self._values)


class Stateful(Protocol):
    """A processor with a state that follows the emitted tokens (a grammar).

    `masks` gives the allowed tokens at each of the K+1 positions of a verify
    without changing the state; `advance` / `rollback` move the state over
    tokens really emitted / withdrawn; `fork` copies it for another branch.
    """

    def masks(self, drafts: Sequence[int]) -> mx.array:
        """[K+1, V] bool: allowed tokens after the state + drafts[:j]."""

    def mask_after(self, drafts: Sequence[int]) -> mx.array:
        """[1, V] bool: allowed tokens after the state + all of `drafts`."""

    def advance(self, tokens: Sequence[int]) -> None: ...

    def rollback(self, n: int) -> None: ...

    def fork(self) -> "Stateful": ...

    def check(self) -> None: ...


class Processors:
    """One row's processors for one request: plain and speculative alike.

    Args:
        penalties: stateless processors, applied in order (mlx-lm's order:
            logit bias, repetition, presence, frequency).
        grammar: an optional stateful token mask, applied last.
    """

    def __init__(self, penalties: Sequence[Penalty] = (), grammar: Optional[Stateful] = None):
        self.penalties = list(penalties)
        self.grammar = grammar

    @property
    def window(self) -> int:
        """History tokens `process` reads: the last `window` (0 = all of it, -1 = none)."""
        sizes = [p.context_size for p in self.penalties if p.context_size >= 0]
        if not sizes:
            return -1
        return 0 if 0 in sizes else max(sizes)

    def __bool__(self) -> bool:
        return bool(self.penalties) or self.grammar is not None

    def process(self, logits: mx.array, history: TokenSeq, drafts: TokenSeq = ()) -> mx.array:
        """Processed logprobs [K+1, V] of a forward's raw logits [K+1, V].

        Row j is what plain decoding computes after history + drafts[:j]. Does
        not change any state.

        Args:
            logits: the model's raw logits of the K+1 positions (any float dtype).
            history: prompt + emitted tokens up to the pending one (its last
                `window` tokens suffice).
            drafts: the K drafts (ids, or an unevaluated array without a grammar).
        """
        k = drafts.size if isinstance(drafts, mx.array) else len(drafts)
        if logits.ndim != 2 or logits.shape[0] != k + 1:
            raise ValueError(f"logits are {logits.shape} for {k} drafts; expected [{k + 1}, V]")
        cache = {}
        for p in self.penalties:
            size = p.context_size
            if size < 0:
                logits = p(logits, None)
                continue
            if size not in cache:
                cache[size] = windows(history, drafts, size)
            if cache[size] is not None:
                logits = p(logits, cache[size])
        if self.grammar is not None:
            ids = drafts.tolist() if isinstance(drafts, mx.array) else list(drafts)
            logits = mx.where(self.grammar.masks(ids), logits, mx.array(-mx.inf, logits.dtype))
        return normalize(logits)

    def process_next(self, logits: mx.array, history: TokenSeq, drafts: TokenSeq = ()) -> mx.array:
        """Processed logprobs [1, V] of one position after history + drafts (a
        drafter's step: it proposes the draft after `drafts` from these).

        Penalties accept an unevaluated `drafts` array (the draft chain stays
        lazy); a grammar needs the drafts' ids. Does not change any state.
        """
        logits = logits.reshape(1, -1)
        window = self.window
        if window >= 0:
            n_hist = history.size if isinstance(history, mx.array) else len(history)
            tail = history if window == 0 else history[max(0, n_hist - window):]
            seq = _concat(tail, drafts)
        for p in self.penalties:
            if p.context_size < 0:
                logits = p(logits, None)
                continue
            ctx = windows(seq, (), p.context_size)
            if ctx is not None:
                logits = p(logits, ctx)
        if self.grammar is not None:
            ids = drafts.tolist() if isinstance(drafts, mx.array) else list(drafts)
            logits = mx.where(self.grammar.mask_after(ids), logits, mx.array(-mx.inf, logits.dtype))
        return normalize(logits)

    def advance(self, tokens: Sequence[int]) -> None:
        """The row emitted `tokens` (after everything it emitted before)."""
        if self.grammar is not None:
            self.grammar.advance(tokens)

    def rollback(self, n: int) -> None:
        """Withdraw the last `n` emitted tokens (a branch rolled back)."""
        if self.grammar is not None:
            self.grammar.rollback(n)

    def fork(self) -> "Processors":
        """An independent copy (another choice of the same request)."""
        return Processors(self.penalties, None if self.grammar is None else self.grammar.fork())

    def check(self) -> None:
        if self.grammar is not None:
            self.grammar.check()


def make_processors(*, vocab_size: int, logit_bias: Optional[dict] = None,
                    repetition_penalty: Optional[float] = None, repetition_context_size: int = CONTEXT_SIZE,
                    presence_penalty: Optional[float] = None, presence_context_size: int = CONTEXT_SIZE,
                    frequency_penalty: Optional[float] = None, frequency_context_size: int = CONTEXT_SIZE,
                    grammar: Optional[Stateful] = None) -> Processors:
    """A row's `Processors`, as mlx-lm's `make_logits_processors` (a penalty of 0
    or None is off; a context size of 0 is the whole history) plus a grammar."""
    for name, size in (("repetition_context_size", repetition_context_size),
                       ("presence_context_size", presence_context_size),
                       ("frequency_context_size", frequency_context_size)):
        if size < 0:
            raise ParamError(name, f"{name} must be >= 0 (0 = the whole history), got {size}")
    penalties: list = []
    if logit_bias:
        penalties.append(LogitBias(logit_bias, vocab_size))
    for cls, penalty, size in ((RepetitionPenalty, repetition_penalty, repetition_context_size),
                               (PresencePenalty, presence_penalty, presence_context_size),
                               (FrequencyPenalty, frequency_penalty, frequency_context_size)):
        if penalty is not None and penalty != 0:
            penalties.append(cls(penalty, size))
    return Processors(penalties, grammar)
