"""Plain and speculative generation on segcache Runtimes: one row of the decoder.

Every speculative round, on any mix of dense and hybrid models, is the
decoder's (`batch/decoder.py`), run here on the target's Runtime itself as a
row of one (and the draft model's Runtime as its draft row):

    draft runtime:   fork ─ forward(lag + [y]) ─ forward([d1]) ... ─┐         commit(lag + kept)
    target runtime:                              fork ─ forward([y, d1..dK]) ─ commit(1 + n)
                                                        one verify forward      y' = t_n

y is the last emitted token (not yet fed), d1..dK the drafts, n the drafts
accepted, t_n the target's token after them. No code here trims a cache:
the runtimes' branches drop the rejected tail exactly.

A round stays open while its accepted drafts are yielded, and is committed
up to the tokens the caller actually received, so closing the generator at
any yield leaves the target holding exactly prompt + emitted. The token after
the last round is fed when the generation ends (as mlx-lm's pipelined step
does), so `rt.tokens == prompt + emitted`, all fed, and a later call with
`runtime=rt` continues the conversation. The draft runtime always holds a
prefix of what the target holds; a later call feeds it the difference first.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .acceptors import make_acceptor
from .batch.gate import DRAFT_MIN_PROB
from .dflash.load import bound_drafter
from .drafters import make_decoder
from .errors import BranchError
from .kvquant import KVQuantization
from .processors import Processors
from .ranks import agreement
from .runtime import Runtime
from .sampling import Keys
from .session.session import Session
from .stats import GenerationStats

__all__ = ["DRAFT_MIN_PROB", "GenerationResponse", "GenerationStats", "generate", "stream_generate"]

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


def _tokens(session: Session, *, prefill_step: int, **row) -> Iterator[tuple]:
    """The session's row 0: prefill, then the decoder's steps; yields (token, logprobs, from_draft)
    until closed. Every exit settles the row at the tokens yielded; only a close (not an error)
    feeds and publishes them (`Session.leave`)."""
    session.begin()
    for _ in session.feed(prefill_step):
        pass
    session.join(0, session.ready(), **row)
    failed = True
    emitted, taken = (), None  # the step whose tokens are being yielded, and how many were
    try:
        while True:
            emitted, taken = session.step(0), 0
            for token, logprobs, from_draft in emitted:
                taken += 1
                yield token, logprobs, from_draft
            taken = None
    except GeneratorExit:
        failed = False
        raise
    finally:
        if 0 in session.decoder.rows and taken is not None and taken < len(emitted):
            session.settle(0, taken)  # closed mid-round: keep what was yielded
        session.leave(0, failed=failed)


def _mtp_head(model, mtp):
    """The MTP head `mtp` names for `model` (segcache.mtp.weights.head_named)."""
    from .mtp.weights import head_named

    return head_named(model, mtp)


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
    draft_tree: int = 0,
    max_tokens: int = 256,
    sampler=None,
    runtime: Optional[Runtime] = None,
    draft_runtime: Optional[Runtime] = None,
    prefill_step_size: int = 2048,
    adaptive: bool = True,
    draft_min_prob: float = DRAFT_MIN_PROB,
    prefill_checkpoints: Sequence[int] = (),
    seed: Optional[int] = None,
    processors: Optional[Processors] = None,
    mtp=None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    max_kv_size: Optional[int] = None,
    whole_prompt: bool = False,
    dflash=None,
    block_size: Optional[int] = None,
) -> Iterator[GenerationResponse]:
    """Generate on segcache runtimes, speculatively with a draft model or prompt lookup.

    Stops at EOS and at `max_tokens` exactly as `mlx_lm.stream_generate` does; greedy output is
    token-identical to it. Afterwards the target runtime holds prompt + emitted tokens, all fed,
    with no open branch; the draft runtime a prefix of that (up to the last round's tokens short;
    the next call feeds it the rest first). After an exception the runtimes hold what was fed
    before it: prompt + emitted, possibly without the last emitted token. While the generator is
    suspended at a yield the runtimes may hold an open branch: exhaust or close it before using them.

    Args:
        model: the target mlx-lm model.
        tokenizer: its tokenizer (a `TokenizerWrapper` or an HF tokenizer).
        prompt: text or token ids; only the new tokens when `runtime` is given.
        draft_model: a draft mlx-lm model sharing the tokenizer (dense or hybrid).
        prompt_lookup: draft by n-gram lookup in prompt + output instead; with `dflash`, beside it.
        num_draft_tokens: drafts per round (at most, with `adaptive`).
        max_tokens: tokens to generate; -1 for no limit.
        sampler: None for greedy; a `segcache.sampling.Sampler` for exact
            speculative sampling; any mlx-lm sampler (match rule, still exact).
        runtime: a target Runtime to continue (its model must be `model`).
        draft_runtime: a draft Runtime to continue (its model must be `draft_model`).
        prefill_step_size: prompt tokens per prefill forward.
        adaptive: adapt each round's width to how likely its drafts are to be accepted (between 1
            and num_draft_tokens). With a draft model, a round stops drafting after the first draft
            whose probability under the draft model is below `draft_min_prob`; with prompt lookup
            (or draft_min_prob=0) the width halves after a round that accepted nothing and doubles
            after one that accepted all. Never changes the output, only the speed.
        draft_tree: with prompt lookup, a draft model or the MTP head, verify up to this many draft nodes
            per round as a tree (several matches; the draft's or the head's likeliest alternatives)
            (docs/tree.md); 0: chains.
        draft_min_prob: the draft model's own probability below which a round drafts no further
            (its low-probability draft is still verified).
        prefill_checkpoints: with a store-backed `runtime`, more positions (in
            runtime tokens + prompt) its prefill checkpoints on the way, e.g.
            chat message boundaries (see `Runtime.prefill`).
        seed: with a `Sampler`, draw from a random stream of this generation's own,
            the one mlx's global state gives after `mx.random.seed(seed)` (None:
            mlx's global state, as mlx-lm).
        processors: logits processors (`segcache.make_processors`: penalties, logit
            bias, a grammar), applied at every position the target computes as plain
            decoding would, drafted positions included; the output equals plain
            decoding with them.
        mtp: draft with the target's own multi-token-prediction head (Qwen3-Next,
            Qwen3.5): an `MTPHead`, True (the head `segcache.mtp.load_head` loaded
            for this model), or a path (a model directory with `mtp.safetensors`,
            a head file, or an original checkpoint's mtp.* tensors). Depth
            `num_draft_tokens` (the head applied on its own outputs); `adaptive`
            halves and doubles it as for prompt lookup. Greedy output is unchanged.
        dflash, block_size: draft with a DFlash block drafter (docs/dflash.md): a `segcache.dflash.Drafter`
            bound to `model` or its checkpoint directory; `block_size` positions per block (None: its config's).
        kv_bits, kv_group_size, quantized_kv_start: mlx-lm's KV cache
            quantization, for the runtimes made here and set on those given
            (`Runtime.quantize_kv`; both target and draft, as mlx-lm does).
        max_kv_size: as mlx-lm's: for a runtime made here, of a model without
            `make_cache`, sliding windows of this many tokens (ignored otherwise).
        whole_prompt: prefill the whole prompt, its last token too (in a forward of its own, as
            the first decoding step would feed it: the same answer), and take the first token
            from its last logits: with a store that holds the whole prompt (a checkpoint at its
            end keeps the logits, as `Runtime.prefill`, a `whole_prompt` generation and the server
            publish) no forward runs before the first token. False (mlx-lm's shape): all but
            the last token, which the first decoding step feeds.

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
    if sum((draft_model is not None, bool(prompt_lookup) and dflash is None, mtp not in (None, False),
            dflash is not None)) > 1:  # prompt lookup goes beside DFlash: per row the better proposal
        raise ValueError("choose one drafter: draft_model or prompt_lookup or mtp or dflash (with prompt_lookup)")
    head = _mtp_head(model, mtp) if mtp not in (None, False) else None
    dflash = bound_drafter(model, dflash, block_size) if dflash is not None else None
    if (draft_model is not None or prompt_lookup or head is not None) and num_draft_tokens < 1:
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
    decoder = make_decoder(
        model, num_draft_tokens=num_draft_tokens if dflash is None and (draft is not None or prompt_lookup or head) else 0,
        dflash=dflash, prompt_lookup=bool(prompt_lookup) and dflash is not None,
        draft_model=draft_model if draft is not None else None, prefill_step=prefill_step_size,
        draft_min_prob=draft_min_prob if adaptive and draft is not None else 0.0,
        gate=False, one_row=True, adaptive=adaptive, mtp=head, draft_tree=draft_tree,
    )
    session = Session(decoder, runtime, history, draft=draft, checkpoints=prefill_checkpoints,  # checks the draft
                      prefill_step=prefill_step_size, agree=agreement(runtime.group), keep=True, whole=whole_prompt)
    if quantization is not None:  # both checked before either changes
        for rt in filter(None, (runtime, draft)):
            rt.check_quantize_kv(quantization)
        for rt in filter(None, (runtime, draft)):
            rt.quantize_kv(quantization)
    stats = GenerationStats(mode=decoder.mode, prompt_tokens=len(ids))
    acceptor = make_acceptor(sampler, None if seed is None else Keys(seed))
    tokens = _tokens(session, prefill_step=prefill_step_size, acceptor=acceptor, max_tokens=max_tokens,
                     stats=stats, processors=processors, stop_tokens=tokenizer.eos_token_ids)
    return _responses(tokens, tokenizer, max_tokens, stats)


def _responses(tokens, tokenizer, max_tokens: int, stats: GenerationStats):
    """mlx-lm's stream_generate loop over our token stream: same stops, same fields."""
    detokenizer = tokenizer.detokenizer
    eos = tokenizer.eos_token_ids
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
