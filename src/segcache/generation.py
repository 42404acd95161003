"""Plain and speculative generation on segcache Runtimes.

Every speculative round, on any mix of dense and hybrid models:

    draft runtime:   fork ─ forward(gap + [y]) ─ forward([d1]) ... ─┐         commit(gap + kept)
    target runtime:                              fork ─ forward([y, d1..dK]) ─ commit(1 + n)
                                                        one verify forward      y' = t_n

y is the last emitted token (not yet fed), d1..dK the drafts, n the drafts
accepted, t_n the target's token after them. No code here trims a cache:
the runtimes' branches drop the rejected tail exactly.

Both forks stay open while the round's accepted drafts are yielded, and are
committed up to the tokens the caller actually received, so closing the
generator at any yield leaves the target holding exactly prompt + emitted.
The token after the last round is fed when the generation ends (as mlx-lm's
pipelined step does), so `rt.tokens == prompt + emitted`, all fed, and a
later call with `runtime=rt` continues the conversation. The draft runtime
always holds a prefix of what the target holds; a later call feeds it the
difference first.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .acceptors import Acceptor, make_acceptor
from .drafters import NO_DRAFT, Drafter, DraftModel, Lookup
from .drafters import eval_cache as _eval_cache
from .drafters import feed as _feed
from .drafters import normalize as _normalize
from .errors import BranchError
from .kvquant import KVQuantization
from .lookup import PromptLookup
from .runtime import Runtime

# The default `draft_min_prob` (see stream_generate). The shipped draft's
# greedy token matched the target's 95-100% of the time when it gave it
# p >= 0.3 and 50-68% below; 0.25 was among the fastest settings on
# held-out code prompts with 4 drafts per round (docs/benchmarks.md).
DRAFT_MIN_PROB = 0.25


@dataclass
class GenerationStats:
    """What one generation did and where the time went.

    Attributes:
        mode: "plain", "draft" or "lookup".
        prompt_tokens: tokens in the prompt (new tokens only when continuing a runtime).
        prompt_time: seconds until the first generated token (prefill included).
        generation_tokens: tokens emitted (an EOS included).
        generation_time: seconds from the first token to the last.
        rounds: target forwards after the prefill (one per round).
        drafted / accepted: draft tokens proposed / accepted by the target.
        draft_time / verify_time / commit_time: seconds drafting (building the
            draft model's graph and evaluating the drafts the gate reads, or
            n-gram lookup), in the verify forwards and acceptance (for a draft
            model this includes evaluating the drafts not read yet, which run
            in the same graph), and committing branches. With the "replay"
            recurrent strategy part of a commit's work is lazy and lands in
            the next forward.
        drafted_per_round / accepted_per_round: per verify round.
    """

    mode: str = "plain"
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    commit_time: float = 0.0
    drafted_per_round: List[int] = field(default_factory=list)
    accepted_per_round: List[int] = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_time if self.generation_time > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean drafts accepted per round (rounds that drafted nothing count as 0)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def summary(self) -> str:
        """A few human-readable lines, as `generate(verbose=True)` prints them."""
        lines = [
            f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.3f} tokens-per-sec",
            f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.3f} tokens-per-sec",
        ]
        if self.mode != "plain":
            lines.append(
                f"Speculative ({self.mode}): {self.rounds} rounds, drafted {self.drafted}, "
                f"accepted {self.accepted} ({self.acceptance_rate:.1%}), "
                f"{self.mean_accepted:.2f} accepted per round"
            )
            lines.append(
                f"Time: draft {self.draft_time:.3f}s, verify {self.verify_time:.3f}s, "
                f"commit {self.commit_time:.3f}s"
            )
        return "\n".join(lines)


@dataclass
class GenerationResponse:
    """One emitted token, as mlx-lm's `GenerationResponse`, plus the running stats.

    Attributes:
        text: the next segment of decoded text (may be empty).
        token: the token id.
        logprobs: the target's log probabilities at this position, [V].
        from_draft: the token was drafted and accepted.
        prompt_tokens, prompt_tps, generation_tokens, generation_tps, peak_memory:
            as in mlx-lm.
        finish_reason: "stop" (EOS), "length" (max_tokens) or None.
        stats: the generation's `GenerationStats` (final once finish_reason is set).
    """

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None


class _Speculator:
    """The round loop. `tokens()` yields (token, logprobs, from_draft) forever.

    The caller stops by closing the generator; every exit path commits the
    open branches up to what was emitted (`_settle`).
    """

    def __init__(self, target: Runtime, drafter: Optional[Drafter], acceptor: Acceptor, prompt, *,
                 width, max_tokens, prefill_step, stats, adaptive=True, prefill_checkpoints=()):
        self.target = target
        self.drafter = drafter
        self.acceptor = acceptor
        self.prompt = prompt
        self.width = width
        self.max_tokens = max_tokens
        self.prefill_step = prefill_step
        self.stats = stats
        self.prefill_checkpoints = tuple(prefill_checkpoints)
        # history[i] is the token at position i of the target; its last entry
        # is `pending`, the last emitted token, not yet fed to the target.
        self.history: list = target.tokens + list(prompt)
        self.pending_fed = False
        # The open round: the target's branch and how many of its tokens were emitted.
        self._tbr = None
        self._keep = 0
        # Unless the drafter sizes its own rounds (a gated draft model), the
        # width halves after a round that accepted nothing and doubles after
        # one that accepted everything (1..width): a miss costs a wider
        # verify, even for free drafts.
        self.adaptive = adaptive and drafter is not None and not drafter.gated
        self._cap = width

    def _settle(self) -> None:
        """Commit the open branches to the emitted tokens (0 if nothing emitted)."""
        tic = time.perf_counter()
        try:
            if self._tbr is not None and self._tbr.open:
                self._tbr.commit(min(self._keep, self._tbr.length))
        finally:
            self._tbr = None
            if self.drafter is not None:
                self.drafter.settle(self._keep)
            self._keep = 0
            self.stats.commit_time += time.perf_counter() - tic

    def _prefill(self) -> None:
        target = self.target
        if len(self.prompt) > 1:
            if target.store is not None:  # resume from the prefix store, publish the prompt
                target.prefill(self.history[:-1], step_size=self.prefill_step,
                               checkpoints=self.prefill_checkpoints)
            else:
                _feed(target, self.prompt[:-1], self.prefill_step)
        if self.drafter is not None:
            self.drafter.catch_up(self.history, target.offset)

    def _round(self, pending: int, width: int) -> tuple:
        """Draft, verify in one target forward (in a fork when there are drafts),
        accept. Returns (drafts, n accepted, next token, logprobs [K+1, V])."""
        t0 = time.perf_counter()
        draft = self.drafter.draft(self.history, self.target.offset, pending, width) if width else NO_DRAFT
        t1 = time.perf_counter()
        if len(draft):
            self._tbr = self.target.fork()
        # A draft model's chain (what its gate has not read) and the verify run as one graph.
        logprobs = _normalize(self.target.forward(draft.verify_input(pending))[0])
        choices = self.acceptor.choices(logprobs)
        mx.eval(draft.tokens if draft.lazy else (), logprobs, *choices)
        drafts = draft.ids()
        n, nxt = self.acceptor.accept(logprobs, drafts, draft.q, choices)
        self.pending_fed = True
        self._keep = 1
        s = self.stats
        s.draft_time += t1 - t0
        s.verify_time += time.perf_counter() - t1
        s.rounds += 1
        s.drafted += len(drafts)
        s.accepted += n
        s.drafted_per_round.append(len(drafts))
        s.accepted_per_round.append(n)
        if self.adaptive and drafts:
            if n == 0:
                self._cap = max(1, self._cap // 2)
            elif n == len(drafts):
                self._cap = min(self.width, 2 * self._cap)
        return drafts, n, nxt, logprobs

    def _emit(self, token: int) -> None:
        self.history.append(token)
        if self.drafter is not None:
            self.drafter.extend([token])

    def tokens(self) -> Iterator[tuple]:
        emitted = 0
        clean = False
        try:
            self._prefill()
            pending = self.history[-1]
            if self.drafter is None:
                yield from self._plain(pending)
            while True:
                remaining = self.width if self.max_tokens < 0 else self.max_tokens - emitted - 1
                width = max(0, min(self.width, self._cap, remaining))
                try:
                    drafts, n, nxt, logprobs = self._round(pending, width)
                    for i in range(n):
                        self._keep += 1
                        emitted += 1
                        self._emit(drafts[i])
                        yield drafts[i], logprobs[i], True
                finally:
                    self._settle()
                pending = nxt
                self.pending_fed = False
                self._emit(nxt)
                emitted += 1
                yield nxt, logprobs[n], False
        except GeneratorExit:
            clean = True
            raise
        finally:
            try:
                self._settle()
            finally:
                self._finish(clean)

    def _finish(self, clean: bool) -> None:
        # Feed the last emitted token only on a normal stop: after an error no
        # further forward is attempted (the runtime then holds one token less
        # than was emitted; rt.tokens says so).
        target = self.target
        if clean and not self.pending_fed:
            target.forward([self.history[-1]])
            _eval_cache(target)
            self.pending_fed = True
        if clean and target.store is not None:
            target.publish()  # the next turn resumes from prompt + reply

    def _plain(self, pending: int) -> Iterator[tuple]:
        """Plain decoding, pipelined as mlx-lm's generate_step: the forward of
        token i is queued (async_eval) before token i is read and yielded, so
        graph building overlaps the device. Token i is then fed when yielded;
        only the last one (max_tokens) is left for the finish to feed."""
        target, stats = self.target, self.stats

        def step(tokens: mx.array):
            logprobs = _normalize(target.forward(tokens)[0, -1])
            token = self.acceptor.sample(logprobs)
            mx.async_eval(token, logprobs)
            return token, logprobs

        token, logprobs = step(mx.array([pending], dtype=mx.uint32))
        emitted = 0
        while True:
            emitted += 1
            ahead = None
            if self.max_tokens < 0 or emitted < self.max_tokens:
                ahead = step(token.reshape(1))
            value = token.item()
            self.history.append(value)
            self.pending_fed = ahead is not None
            stats.rounds += 1
            yield value, logprobs, False
            if ahead is None:
                return
            token, logprobs = ahead


def _prompt_ids(tokenizer: TokenizerWrapper, prompt) -> list[int]:
    if isinstance(prompt, str):
        # As mlx-lm: add special tokens unless the text already starts with BOS.
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif isinstance(prompt, mx.array):
        ids = prompt.reshape(-1).tolist()
    else:
        try:
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError(f"prompt must be text or token ids, got {prompt!r:.80}") from None
    if not ids:
        raise ValueError("the prompt is empty: generation needs at least one new token to start from")
    if min(ids) < 0:
        raise ValueError(f"token ids must be non-negative, got {ids!r:.80}")
    return ids


def _check_runtime(rt: Runtime, model, name: str) -> None:
    if rt.model is not model:
        raise ValueError(f"{name}.model is not the model passed for it; pass the runtime built on that model")
    if rt.depth:
        raise BranchError(
            f"{name} has {rt.depth} open branch(es); commit or roll them back (or close the "
            "generator that opened them) before generating on it"
        )


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    *,
    draft_model=None,
    prompt_lookup: bool = False,
    num_draft_tokens: int = 4,
    max_tokens: int = 256,
    sampler=None,
    runtime: Optional[Runtime] = None,
    draft_runtime: Optional[Runtime] = None,
    prefill_step_size: int = 2048,
    adaptive: bool = True,
    draft_min_prob: float = DRAFT_MIN_PROB,
    prefill_checkpoints: Sequence[int] = (),
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    max_kv_size: Optional[int] = None,
) -> Iterator[GenerationResponse]:
    """Generate on segcache runtimes, speculatively with a draft model or prompt lookup.

    Stops at EOS and at `max_tokens` exactly as `mlx_lm.stream_generate` does;
    greedy output is token-identical to it. Afterwards the target runtime holds
    prompt + emitted tokens, all fed, with no open branch; the draft runtime a
    prefix of that (up to the last round's tokens short; the next call feeds
    it the rest first). After an exception the runtimes hold what was fed
    before it: prompt + emitted, possibly without the last emitted token. While the generator is suspended at a yield the runtimes
    may hold an open branch: exhaust or close it before using them.

    Args:
        model: the target mlx-lm model.
        tokenizer: its tokenizer (a `TokenizerWrapper` or an HF tokenizer).
        prompt: text or token ids; only the new tokens when `runtime` is given.
        draft_model: a draft mlx-lm model sharing the tokenizer (dense or hybrid).
        prompt_lookup: draft by n-gram lookup in prompt + output instead.
        num_draft_tokens: drafts per round (at most, with `adaptive`).
        max_tokens: tokens to generate; -1 for no limit.
        sampler: None for greedy; a `segcache.sampling.Sampler` for exact
            speculative sampling; any mlx-lm sampler (match rule, still exact).
        runtime: a target Runtime to continue (its model must be `model`).
        draft_runtime: a draft Runtime to continue (its model must be `draft_model`).
        prefill_step_size: prompt tokens per prefill forward.
        adaptive: adapt each round's width to how likely its drafts are to be
            accepted (between 1 and num_draft_tokens). With a draft model,
            a round stops drafting after the first draft whose probability
            under the draft model is below `draft_min_prob`; with prompt
            lookup (or draft_min_prob=0) the width halves after a round that
            accepted nothing and doubles after one that accepted all. Never
            changes the output, only the speed.
        draft_min_prob: the draft model's own probability below which a
            round drafts no further (its low-probability draft is still verified).
        prefill_checkpoints: with a store-backed `runtime`, more positions (in
            runtime tokens + prompt) its prefill checkpoints on the way, e.g.
            chat message boundaries (see `Runtime.prefill`).
        kv_bits, kv_group_size, quantized_kv_start: mlx-lm's KV cache
            quantization, for the runtimes made here and set on those given
            (`Runtime.quantize_kv`; both target and draft, as mlx-lm does).
        max_kv_size: as mlx-lm's: for a runtime made here, of a model without
            `make_cache`, sliding windows of this many tokens (ignored otherwise).

    Yields:
        GenerationResponse per token; the last one has `finish_reason` set.

    Raises:
        ValueError: invalid arguments or an empty prompt.
        BranchError: a given runtime has an open branch.
    """
    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit)")
    if draft_runtime is not None and draft_model is None:
        draft_model = draft_runtime.model
    if draft_model is not None and prompt_lookup:
        raise ValueError("choose one drafter: draft_model or prompt_lookup, not both")
    if (draft_model is not None or prompt_lookup) and num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if not 0.0 <= draft_min_prob <= 1.0:
        raise ValueError(f"draft_min_prob must be a probability in [0, 1], got {draft_min_prob}")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = _prompt_ids(tokenizer, prompt)

    quantization = KVQuantization.of(kv_bits, kv_group_size, quantized_kv_start)  # ValueError if bad
    if runtime is None:
        runtime = Runtime(model, max_kv_size=max_kv_size)
    _check_runtime(runtime, model, "runtime")
    if draft_runtime is not None and draft_runtime is runtime:
        raise ValueError("draft_runtime must be a runtime of its own, not the target's runtime")
    history = runtime.tokens + ids
    draft = None
    if draft_model is not None:
        draft = draft_runtime if draft_runtime is not None else Runtime(draft_model, max_kv_size=max_kv_size)
        _check_runtime(draft, draft_model, "draft_runtime")
        held = draft.tokens
        if held != history[: len(held)] or len(held) >= len(history):
            raise ValueError(
                f"draft_runtime holds {len(held)} tokens that are not a prefix of the target's "
                f"{len(history) - 1} + the prompt's last; pass a draft runtime that followed this target"
            )
        if None in history[len(held) : len(history) - 1]:  # ids the draft must still be fed
            raise ValueError(
                "the target runtime holds tokens fed without Runtime.forward (ids unknown) that the draft "
                "runtime has not seen, so it cannot be brought up to date; use prompt lookup, a draft "
                "runtime holding those tokens (e.g. loaded from the same prompt cache file), or a fresh runtime"
            )
    if quantization is not None:  # both checked before either changes
        for rt in filter(None, (runtime, draft)):
            rt.check_quantize_kv(quantization)
        for rt in filter(None, (runtime, draft)):
            rt.quantize_kv(quantization)
    lookup = None
    if prompt_lookup:
        lookup = PromptLookup()
        known = len(history) - history[::-1].index(None) if None in history else 0
        lookup.extend(history[known:])

    mode = "draft" if draft is not None else "lookup" if lookup is not None else "plain"
    stats = GenerationStats(mode=mode, prompt_tokens=len(ids))
    acceptor = make_acceptor(sampler)
    drafter: Optional[Drafter] = None
    if draft is not None:
        drafter = DraftModel(draft, acceptor, prefill_step=prefill_step_size,
                             min_prob=draft_min_prob if adaptive else 0.0)
    elif lookup is not None:
        drafter = Lookup(lookup)
    speculator = _Speculator(
        runtime, drafter, acceptor, ids,
        width=num_draft_tokens, max_tokens=max_tokens, prefill_step=prefill_step_size,
        stats=stats, adaptive=adaptive, prefill_checkpoints=prefill_checkpoints,
    )
    return _responses(speculator, tokenizer, max_tokens, stats)


def _responses(speculator: _Speculator, tokenizer, max_tokens: int, stats: GenerationStats):
    """mlx-lm's stream_generate loop over our token stream: same stops, same fields."""
    detokenizer = tokenizer.detokenizer
    eos = tokenizer.eos_token_ids
    tokens = speculator.tokens()
    tic = time.perf_counter()
    prompt_tps = 0.0

    def response(text, token, logprobs, from_draft, n, finish=None):
        stats.generation_tokens = n + 1
        stats.generation_time = time.perf_counter() - tic
        return GenerationResponse(
            text=text, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=stats.prompt_tokens, prompt_tps=prompt_tps,
            generation_tokens=n + 1, generation_tps=(n + 1) / stats.generation_time,
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish, stats=stats,
        )

    try:
        for n, (token, logprobs, from_draft) in enumerate(tokens):
            if n == 0:
                stats.prompt_time = time.perf_counter() - tic
                prompt_tps = stats.prompt_tps
                tic = time.perf_counter()
            if token in eos:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield response(detokenizer.last_segment, token, logprobs, from_draft, n)
        # Settle the runtimes before the last response, so a caller that stops
        # iterating there still finds them committed.
        tokens.close()
        detokenizer.finalize()
        finish = "stop" if token in eos else "length"
        yield response(detokenizer.last_segment, token, logprobs, from_draft, n, finish)
    finally:
        tokens.close()


def generate(model, tokenizer, prompt, *, verbose: bool = False, **kwargs) -> str:
    """Generate a complete response; see `stream_generate` for the arguments.

    Args:
        verbose: print the text as it is generated, then the stats.

    Returns:
        The generated text.
    """
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if response is not None:
            print(response.stats.summary())
            print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
