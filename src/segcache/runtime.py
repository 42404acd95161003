"""Runtime and Branch: the fork / commit / rollback stack over a model's layer caches.

    rt = Runtime(model)
    rt.forward(prompt)                  # plain mlx-lm forward, tokens recorded
    with rt.fork() as br:               # O(1): every layer pushes a mark
        rt.forward(draft)               # recurrent layers capture their inputs
        br.commit(accepted)             # keep the first `accepted` tokens, exactly
"""

from __future__ import annotations

from typing import Iterable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from . import adapters
from .errors import BranchError, InvariantError, UnsupportedModelError
from .layers import KVLayer, RecurrentLayer, WindowLayer
from .adapters.chunked import chunked_threshold
from .layers.recurrent import STRATEGIES
from .errors import StoreError

RECURRENT_STRATEGIES = ("auto",) + STRATEGIES


def default_recurrent_strategy() -> str:
    """"states" where the recurrence is a per-token loop anyway (CPU), else "replay".

    On the CPU mlx-lm's Gated DeltaNet runs one step at a time, so keeping each
    step's state inside a branch costs no compute and makes commit free. On
    Metal the fused kernel runs a whole block in one launch; splitting it per
    token would slow every speculative forward, so there we keep the inputs and
    replay the accepted prefix at commit. bench/branch.py measures both.
    """
    on_gpu = mx.default_device() == mx.gpu and mx.metal.is_available()
    return "replay" if on_gpu else "states"


class Branch:
    """One open level of a Runtime's branch stack; a context manager.

    Leaving a `with` block without `commit` (or by an exception) rolls it back.
    """

    def __init__(self, runtime: "Runtime", base_offset: int):
        self._runtime = runtime
        self.base_offset = base_offset
        self.open = True

    @property
    def length(self) -> int:
        """Tokens this branch appended so far (its nested branches included)."""
        return self._runtime.offset - self.base_offset if self.open else 0

    @property
    def tokens(self) -> list:
        """The token ids this branch appended."""
        return self._runtime.tokens[self.base_offset :] if self.open else []

    def commit(self, n: int | None = None) -> None:
        """Keep the first `n` tokens of this branch (all if None) and close it."""
        self._runtime._commit(self, n)

    def rollback(self) -> None:
        """Drop everything this branch appended and close it."""
        self._runtime._rollback(self)

    def __enter__(self) -> "Branch":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.open:
            rt = self._runtime
            while rt._branches and rt._branches[-1] is not self:
                rt._rollback(None)  # inner branches left open in the block
            rt._rollback(self)
        return False

    def __repr__(self) -> str:
        state = f"length={self.length}" if self.open else "closed"
        return f"Branch(base={self.base_offset}, {state})"


def _build_layers(model, strategy: str) -> list:
    native = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    layers = list(model.layers)
    if len(native) != len(layers):
        raise UnsupportedModelError(
            f"{type(model).__name__} makes {len(native)} caches for {len(layers)} layers; "
            "segcache needs one cache per decoder layer"
        )
    out = []
    for i, (cache, layer) in enumerate(zip(native, layers)):
        kind = type(cache)
        if kind is KVCache:
            out.append(KVLayer())
        elif kind is RotatingKVCache:
            out.append(WindowLayer(cache.max_size, cache.keep))
        elif kind is ArraysCache and len(cache.cache) == 2 and (found := adapters.find_recurrent_module(layer)):
            module, base = found
            adapters.adapt(module, base)
            out.append(RecurrentLayer(module.conv_kernel_size - 1, strategy))
        else:
            inner = adapters.describe_layer(layer)
            raise UnsupportedModelError(
                f"layer {i} ({type(layer).__name__}{inner}) uses {kind.__name__}, which segcache "
                "cannot roll back; supported: KVCache, RotatingKVCache, and ArraysCache for the "
                f"Gated DeltaNet of {', '.join(c.__module__.rsplit('.', 1)[-1] for c in adapters.FAMILIES)}"
            )
    return out


def _token_array(tokens: mx.array) -> mx.array:
    """`tokens` as a 1-D integer array, checked by shape and dtype only (values stay unread)."""
    if tokens.ndim == 2 and tokens.shape[0] == 1:
        tokens = tokens[0]
    if tokens.ndim != 1 or tokens.size == 0 or not mx.issubdtype(tokens.dtype, mx.integer):
        raise ValueError(
            f"tokens must be a non-empty 1-D integer array (or shape [1, S]); got {tokens.dtype} {tokens.shape}"
        )
    return tokens


def _token_ids(tokens) -> list[int]:
    if isinstance(tokens, mx.array):
        tokens = _token_array(tokens).tolist()
    ids = list(tokens) if isinstance(tokens, Iterable) else None
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"tokens must be a non-empty sequence of non-negative ints; got {tokens!r:.80}")
    return ids


class Runtime:
    """A model's cache as a stack of typed per-layer segments with exact branches.

    Args:
        model: an mlx-lm model (dense, sliding-window or Gated DeltaNet hybrid).
        store: a `PrefixStore` (`segcache.open_store`) for `prefill`/`publish`;
            clones share it.
        recurrent_strategy: "auto", "replay" or "states" (see
            `default_recurrent_strategy`).
        gdn_prefill: how Gated DeltaNet layers run blocks outside branches:
            "native" (mlx-lm's own path, bit for bit), "chunked" (the chunked
            recurrence for blocks of `adapters.chunked.CHUNKED_FROM` tokens or
            more; within float rounding of native), or "auto" (chunked off
            Metal, native on Metal; `adapters.chunked.default_gdn_prefill`).

    Attributes:
        model: the model.
        cache: the layer caches, usable anywhere mlx-lm takes a prompt cache.

    Raises:
        UnsupportedModelError: a layer's cache cannot be rolled back.
    """

    def __init__(self, model, *, store=None, recurrent_strategy: str = "auto", gdn_prefill: str = "auto"):
        if recurrent_strategy not in RECURRENT_STRATEGIES:
            raise ValueError(f"recurrent_strategy must be one of {RECURRENT_STRATEGIES}")
        chunked_from = chunked_threshold(gdn_prefill)  # raises ValueError on a bad name
        if recurrent_strategy == "auto":
            recurrent_strategy = default_recurrent_strategy()
        self.model = model
        self.recurrent_strategy = recurrent_strategy
        self.cache = _build_layers(model, recurrent_strategy)
        self.gdn_prefill = "native" if chunked_from is None else "chunked"
        for layer in self.cache:
            if isinstance(layer, RecurrentLayer):
                layer.chunked_from = chunked_from  # clones of the layer keep it
        # _tokens[i]: the id at position i, None where the model was called on
        # rt.cache directly. Ids given as mx.arrays wait unread in _pending
        # (reading them would sync the device every step), in order after
        # _tokens. len(_tokens) + _pending_len <= offset; after _sync_tokens()
        # _pending is empty and len(_tokens) == offset.
        self._tokens: list[int | None] = []
        self._pending: list[mx.array | list[int]] = []
        self._pending_len = 0
        # _branches[i].base_offset == every layer's mark i offset; innermost last.
        self._branches: list[Branch] = []
        self.store = store
        self._prefix = None  # store.prefix_cache.PrefixCache for `store`, made on first use; shared with clones

    # -- what the cache holds -------------------------------------------------

    @property
    def offset(self) -> int:
        """Tokens in the cache, open branches included."""
        return self.cache[0].offset

    @property
    def depth(self) -> int:
        """Number of open branches."""
        return len(self._branches)

    @property
    def tokens(self) -> list:
        """Token ids in the cache, in order (None where fed without `forward`)."""
        self._sync_tokens()
        return list(self._tokens)

    @property
    def committed_offset(self) -> int:
        """Tokens outside every open branch."""
        return self._branches[0].base_offset if self._branches else self.offset

    def _sync_tokens(self) -> None:
        if self._pending:
            for chunk in self._pending:
                self._tokens.extend(chunk.tolist() if isinstance(chunk, mx.array) else chunk)
            self._pending.clear()
            self._pending_len = 0
        gap = self.offset - len(self._tokens)
        if gap > 0:
            self._tokens.extend([None] * gap)
        elif gap < 0:
            del self._tokens[self.offset :]

    # -- forward ----------------------------------------------------------------

    def forward(self, tokens: Sequence[int] | mx.array) -> mx.array:
        """Run the model on `tokens` through this cache and record them.

        Args:
            tokens: token ids, a list or an integer mx.array of shape [S] or [1, S].
                An array is recorded without being read (reading it would wait
                for the device each step), so its values are not checked.

        Returns:
            The logits, [1, S, vocab] (lazy, as the model returns them).

        Raises:
            ValueError: `tokens` is empty or not token ids; nothing changed.
        """
        if isinstance(tokens, mx.array):
            chunk = _token_array(tokens)  # left unread: no device sync per step
        else:
            chunk = _token_ids(tokens)
        if len(self._tokens) + self._pending_len != self.offset:
            self._sync_tokens()  # the model was called on rt.cache directly
        saved = [layer.savepoint() for layer in self.cache]
        x = chunk[None] if isinstance(chunk, mx.array) else mx.array(chunk, dtype=mx.uint32)[None]
        try:
            logits = self.model(x, cache=self.cache)
        except BaseException:
            for layer, point in zip(self.cache, saved):
                layer.restore(point)
            raise
        if isinstance(chunk, mx.array) or self._pending:
            self._pending.append(chunk)  # after unread ids, lists wait too (order)
            self._pending_len += len(chunk)
        else:
            self._tokens.extend(chunk)
        return logits

    # -- branches ---------------------------------------------------------------

    def fork(self) -> Branch:
        """Open a branch on top of the current state; O(1) in the context length."""
        self._sync_tokens()
        branch = Branch(self, self.offset)
        for layer in self.cache:
            layer.fork()
        self._branches.append(branch)
        return branch

    def commit(self, n: int | None = None) -> None:
        """Keep the first `n` tokens of the innermost branch (all if None) and close it.

        Raises:
            BranchError: no open branch, or n not in 0..branch length; nothing changed.
        """
        self._commit(None, n)

    def rollback(self) -> None:
        """Drop the innermost branch entirely.

        Raises:
            BranchError: no open branch; nothing changed.
        """
        self._rollback(None)

    def _innermost(self, branch: Branch | None, verb: str) -> Branch:
        if not self._branches:
            raise BranchError(f"{verb}() with no open branch: open one with rt.fork() first")
        inner = self._branches[-1]
        if branch is not None and branch is not inner:
            if not branch.open:
                raise BranchError(f"{verb}() on a branch that is already closed (committed or rolled back)")
            raise BranchError(
                f"{verb}() on a branch that is not the innermost open one (depth {self.depth}); "
                "commit or roll back the branches opened inside it first"
            )
        return inner

    def _commit(self, branch: Branch | None, n: int | None) -> None:
        inner = self._innermost(branch, "commit")
        length = self.offset - inner.base_offset
        if n is None:
            n = length
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= length:
            raise BranchError(f"commit(n={n!r}): n must be an int in 0..{length}, the tokens this branch holds")
        self._sync_tokens()
        for layer in self.cache:
            layer.commit(n)
        del self._tokens[inner.base_offset + n :]
        self._close(inner)

    def _rollback(self, branch: Branch | None) -> None:
        inner = self._innermost(branch, "rollback")
        for layer in self.cache:
            layer.rollback()
        del self._tokens[inner.base_offset :]
        self._close(inner)

    def _close(self, branch: Branch) -> None:
        self._branches.pop()
        branch.open = False

    # -- prefix store -------------------------------------------------------------

    def prefill(
        self, tokens: Sequence[int] | mx.array, *, step_size: int = 2048, checkpoints: Iterable[int] = ()
    ) -> mx.array:
        """Run a prompt, resuming from the longest prefix the store holds, and publish it.

        Without a store this is a chunked `forward`. With one: restore the
        longest cached prefix (bit-identical to the state that was published),
        compute the rest in chunks of `step_size`, then publish the prompt's
        pages and a checkpoint at its end (and at the point where it leaves an
        earlier published prompt). Store failures make a miss, never an error.

        Args:
            tokens: the whole prompt. Tokens the runtime already holds must be its
                strict prefix (typically: none, or a previous turn of a chat).
            step_size: prompt tokens per forward.
            checkpoints: more positions inside the prompt to checkpoint on the way
                (e.g. chat message boundaries), so later prompts that share only
                that much resume there; positions outside 1..len-1 are ignored.

        Returns:
            The logits of the prompt's last position, [1, vocab].

        Raises:
            BranchError: a branch is open, or the runtime holds tokens that are not
                a strict prefix of `tokens`; nothing changed.
            ValueError: `tokens` is empty or not token ids.
        """
        ids = _token_ids(tokens)
        if self.store is None:
            from .store.prefix_cache import check_prefill, feed

            return feed(self, ids, check_prefill(self, ids), [len(ids)], step_size)
        return self.prefix_cache().prefill(self, ids, step_size=step_size, checkpoints=checkpoints)

    def publish(self) -> int:
        """Publish the committed tokens and state to the store (e.g. after generating).

        Tokens of an open branch are never published. The checkpoint carries no
        logits, so a later prefill of exactly these tokens recomputes the last one
        on dense models; longer prompts (the next turn) resume from it.

        Returns:
            The number of records written (0 also when the store failed: a warning).

        Raises:
            StoreError: no store, or tokens fed without `forward` (ids unknown).
        """
        if self.store is None:
            raise StoreError("publish() on a Runtime without a store: pass store=open_store(...) to Runtime()")
        return self.prefix_cache().publish_runtime(self)

    def prefix_cache(self):
        """The `PrefixCache` of this runtime's store (shared with clones; rebuilt if the store changed)."""
        if self.store is None:
            raise StoreError("this Runtime has no store: pass store=open_store(...) to Runtime()")
        if self._prefix is None or self._prefix.store is not self.store:
            from .store.prefix_cache import PrefixCache

            self._prefix = PrefixCache(self)
        return self._prefix

    @property
    def committed_tokens(self) -> list:
        """Token ids outside every open branch (None where fed without `forward`)."""
        return self.tokens[: self.committed_offset]

    def restore(self, ids: list[int], states: list) -> None:
        """Replace the whole committed state by a stored prefix of `ids`; all or nothing.

        Args:
            ids: the token ids the states were computed from.
            states: per layer, the arguments of its `load` (`layer.state_from(...)`).

        Raises:
            BranchError: a branch is open; nothing changed.
        """
        if self._branches:
            raise BranchError("restore() with an open branch: commit or roll it back first")
        saved = [layer.savepoint() for layer in self.cache]
        try:
            for layer, state in zip(self.cache, states):
                layer.load(*state)
        except BaseException:
            for layer, point in zip(self.cache, saved):
                layer.restore(point)
            raise
        self._tokens = list(ids)
        self._pending, self._pending_len = [], 0

    # -- sharing ----------------------------------------------------------------

    def clone(self) -> "Runtime":
        """An independent Runtime over the committed state, shared copy-on-write.

        Open branches are not cloned. Neither runtime ever sees the other's writes.
        """
        self._sync_tokens()
        other = object.__new__(type(self))
        other.model = self.model
        other.recurrent_strategy = self.recurrent_strategy
        other.gdn_prefill = self.gdn_prefill
        other.cache = [layer.clone() for layer in self.cache]
        other._tokens = self._tokens[: self.committed_offset]
        other._pending, other._pending_len = [], 0
        other._branches = []
        other.store, other._prefix = self.store, self._prefix
        return other

    # -- invariants -------------------------------------------------------------

    def check(self) -> None:
        """Verify every invariant of the runtime and its layers.

        Raises:
            InvariantError: naming the first violation found.
        """
        for i, layer in enumerate(self.cache):
            try:
                layer.check()
            except InvariantError as exc:
                raise InvariantError(f"layer {i}: {exc}") from None
            if layer.offset != self.offset:
                raise InvariantError(f"layer {i} holds {layer.offset} tokens, layer 0 holds {self.offset}")
            bases = layer.branch_offsets()
            expected = [b.base_offset for b in self._branches]
            if bases != expected:
                raise InvariantError(f"layer {i} has branches at {bases}, the runtime at {expected}")
        if any(not b.open for b in self._branches):
            raise InvariantError("a closed branch is still on the stack")
        if len(self._tokens) + self._pending_len > self.offset:
            raise InvariantError(
                f"{len(self._tokens) + self._pending_len} token ids recorded for {self.offset} cached tokens"
            )
        if self._pending_len != sum(len(chunk) for chunk in self._pending):
            raise InvariantError("the count of unread token ids is off")

    def __repr__(self) -> str:
        kinds = {}
        for layer in self.cache:
            kinds[type(layer).__name__] = kinds.get(type(layer).__name__, 0) + 1
        layout = ", ".join(f"{n}x{k}" for k, n in kinds.items())
        return f"Runtime(offset={self.offset}, depth={self.depth}, layers=[{layout}])"
