"""Runtime and Branch: the fork / commit / rollback stack over a model's layer caches.

    rt = Runtime(model)
    rt.forward(prompt)                  # plain mlx-lm forward, tokens recorded
    with rt.fork() as br:               # O(1): every layer pushes a mark
        rt.forward(draft)               # recurrent layers capture their inputs
        br.commit(accepted)             # keep the first `accepted` tokens, exactly
"""

from __future__ import annotations

from typing import Generator, Iterable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from . import drafter_segments, registry
from .adapters.chunked import chunked_threshold
from .adapters.head import last_logits
from .errors import (
    BranchError,
    InvariantError,
    StoreError,
    UnsupportedOperationError,
)
from .kvquant import DEFAULT_GROUP_SIZE, DEFAULT_START, KVQuantization, KVSwitch
from .layers.offset_branches import OffsetBranches
from .layers.protocol import UNSTORED
from .layers.recurrent import STRATEGIES, RecurrentLayer
from .layers.state import default_state_strategy
from .layers.tree import Tree
from .prompt_layers import load_layers
from .tree_rounds import TreeRounds
from .ranks import agreement
from . import prefill as store_prefill
from .store import PrefixCache, Resume
from .tokens import TokenLedger, token_array, token_ids

RECURRENT_STRATEGIES = ("auto",) + STRATEGIES
# Per runtime, over all recurrent layers: at Qwen3-Next sizes (36 GDN layers,
# ~2 MiB of state per token per layer) about 3 kept states per layer, enough
# for a short draft; a longer branch replays instead of running out of memory.
BRANCH_STATE_BYTES = 256 << 20


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
        self.tree: Tree | None = None  # the tree its one forward verified (forward_tree), until committed

    @property
    def length(self) -> int:
        """Tokens this branch appended so far (its nested branches included)."""
        return self._runtime.offset - self.base_offset if self.open else 0

    @property
    def tokens(self) -> list:
        """The token ids this branch appended."""
        return self._runtime.tokens[self.base_offset :] if self.open else []

    def commit(self, n: int | Sequence[int] | None = None) -> None:
        """Keep the first `n` tokens of this branch (all if None; a tree's: the path `n`) and close it."""
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


class Savepoint:
    """What `Runtime.undo` returns to (opaque; see `Runtime.savepoint`)."""

    __slots__ = ("runtime", "offset", "branches", "layers", "buffers", "own", "drafters")

    def __init__(self, runtime: "Runtime", offset: int, branches: tuple, layers: list, buffers: list, own: tuple,
                 drafters: tuple = ()):
        self.runtime, self.offset, self.branches = runtime, offset, branches
        self.layers, self.buffers = layers, buffers  # each layer's own savepoint; (cache, keys, values) views
        self.own = own  # the layer objects then (kv_bits may swap some for quantized ones since)
        self.drafters = drafters  # each drafter segment's savepoint


def _appended_in_place(layers) -> list:
    """The caches among `layers` (and their children) that a forward appends to in place.

    An append-only K/V buffer (`OffsetBranches`: full attention, quantized or
    not) is extended with a slice update, which rebinds the very array object
    the layer holds, and its own savepoint keeps only the offset. Every other
    kind keeps its arrays in its savepoint (windows, recurrent slots).
    """
    out = []
    for layer in layers:
        if isinstance(layer, OffsetBranches):
            out.append(layer)
        elif isinstance(layer, CacheList):  # CompositeLayer: its children
            out.extend(_appended_in_place(layer.caches))
    return out


def _view(a):
    """A new handle on the same buffer (no copy): it keeps the buffer as it is now."""
    if a is None:  # no token yet
        return None
    return tuple(x[...] for x in a) if isinstance(a, tuple) else a[...]


def _build_layers(model, strategy: str, branch_state_bytes: int, state_strategy: str | None = None,
                  max_kv_size: int | None = None) -> list:
    """One layer cache per decoder layer; the model is changed only if every layer is supported.

    First every layer is matched to a segment kind (raising before anything
    changed), then the recurrent modules are adapted, all or none.
    """
    plan = registry.plan(model, max_kv_size)
    recurrent = registry.recurrent_count(plan)
    options = registry.Options(strategy, branch_state_bytes // recurrent if recurrent else 0, state_strategy or strategy)
    registry.adapt(plan)
    return [kind.build(cache, matched, options) for kind, cache, matched in plan]


class Runtime(KVSwitch, TreeRounds):
    """A model's cache as a stack of typed per-layer segments with exact branches.

    Args:
        model: an mlx-lm model (dense, sliding-window or Gated DeltaNet hybrid).
        store: a `PrefixStore` (`segcache.open_store`) for `prefill`/`publish`;
            clones share it.
        cache_salt: the runtime's isolation domain in the store (a non-empty
            str or bytes; None: the shared domain). Its prefill resumes, and its
            publish stores, only what runtimes of the same salt see: another
            salt shares no prefix with it (e.g. one per user or API key, so no
            one can learn whether another's prompt is cached). Clones keep it.
        recurrent_strategy: "auto", "replay" or "states" (see
            `default_recurrent_strategy`; for the generic recurrent-state
            layers of SSM / short-conv families "auto" is "replay",
            `layers.state.default_state_strategy`).
        branch_state_bytes: with "states", the most bytes of per-token
            recurrent states the open branches may keep, split evenly over the
            recurrent layers (default 256 MiB). A branch whose next forward
            would pass its layer's share keeps no more states from then on and
            commits by replaying its inputs from the last kept state: exact
            either way, only slower. 0 means replay only.
        gdn_prefill: how Gated DeltaNet layers run blocks outside branches:
            "native" (the default: mlx-lm's own path, bit for bit), "chunked" (the
            chunked recurrence for blocks of `adapters.chunked.CHUNKED_FROM` tokens
            or more; within float rounding of native), or "auto" (chunked off
            Metal, native on Metal; `adapters.chunked.default_gdn_prefill`; what
            `segcache generate`, `serve` and `demo` use).
        kv_bits, kv_group_size, quantized_kv_start: mlx-lm's KV cache
            quantization, applied where mlx-lm's `generate_step` applies it:
            after each forward outside a branch, full-attention layers holding
            `quantized_kv_start` tokens or more become quantized layers
            (`segcache.kvquant`). None (the default): never.
        max_kv_size: as mlx-lm's `make_prompt_cache(model, max_kv_size)`: for a
            model without `make_cache`, every layer is a sliding window of this
            many tokens (keeping the first 4); ignored when the model makes its
            own cache, as in mlx-lm.
        group: a `segcache.distributed.Channel` when this runtime is one rank's of
            a sharded model: its prefills then resume only a prefix every rank
            resumes (docs/distributed.md); clones share it.
        mtp: the target's MTP head (`segcache.mtp.load_head`), the path of its
            weights, or its `HeadSegment`: the head's attention cache then is a
            drafter segment of this runtime (segcache/drafter_segments.py), fed by
            every forward, forked, committed, cloned and stored with the layers
            (docs/mtp.md). None (the default): no drafter segment.
        dflash: a DFlash drafter bound to `model` (`segcache.dflash.load_dflash`): its context K/V the same way.

    Attributes:
        model: the model.
        cache: the layer caches, usable anywhere mlx-lm takes a prompt cache.
        cache_salt: the isolation domain (see Args); may be set before a prefill
            or publish (a runtime split off a batch carries the salt of the one that joined).

    Raises:
        UnsupportedModelError: a layer's cache cannot be rolled back.
        ValueError: `cache_salt` is empty or not a str or bytes.
    """

    def __init__(
        self,
        model,
        *,
        store=None,
        cache_salt: str | bytes | None = None,
        recurrent_strategy: str = "auto",
        branch_state_bytes: int = BRANCH_STATE_BYTES,
        gdn_prefill: str = "native",
        kv_bits: int | None = None,
        kv_group_size: int = DEFAULT_GROUP_SIZE,
        quantized_kv_start: int = DEFAULT_START,
        max_kv_size: int | None = None,
        group=None,
        mtp=None,
        dflash=None,
    ):
        if recurrent_strategy not in RECURRENT_STRATEGIES:
            raise ValueError(f"recurrent_strategy must be one of {RECURRENT_STRATEGIES}")
        if not isinstance(branch_state_bytes, int) or isinstance(branch_state_bytes, bool) or branch_state_bytes < 0:
            raise ValueError(f"branch_state_bytes must be an int >= 0, got {branch_state_bytes!r}")
        if cache_salt is not None and (not isinstance(cache_salt, (str, bytes)) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty str or bytes (or None), got {cache_salt!r:.40}")
        # StateLayer (SSM, short conv, ...): "auto" is "replay" (layers/state.py)
        state_strategy = default_state_strategy() if recurrent_strategy == "auto" else recurrent_strategy
        chunked_from = chunked_threshold(gdn_prefill)  # raises ValueError on a bad name
        quantization = KVQuantization.of(kv_bits, kv_group_size, quantized_kv_start)  # ValueError if bad
        if max_kv_size is not None and (not isinstance(max_kv_size, int) or isinstance(max_kv_size, bool) or max_kv_size < 1):
            raise ValueError(f"max_kv_size must be a positive int or None, got {max_kv_size!r}")
        if recurrent_strategy == "auto":
            recurrent_strategy = default_recurrent_strategy()
        self.model = model
        self.recurrent_strategy = recurrent_strategy
        self.cache = _build_layers(model, recurrent_strategy, branch_state_bytes, state_strategy, max_kv_size)
        # cache[i] is _layers[i]: mlx-lm code may replace entries of the list
        # (kv_bits); every operation checks first (_own_layers).
        self._layers = tuple(self.cache)
        self._in_place = None  # (_layers, their caches appended in place), for savepoint()
        self.gdn_prefill = "native" if chunked_from is None else "chunked"
        for layer in self.cache:
            if isinstance(layer, RecurrentLayer):
                layer.chunked_from = chunked_from  # clones of the layer keep it
        # ids of the cached positions; every path below goes through it (tokens.py)
        self._ledger = TokenLedger()
        # _branches[i].base_offset == every layer's mark i offset; innermost last.
        self._branches: list[Branch] = []
        self.store = store
        self.cache_salt = cache_salt
        self._prefix: PrefixCache | None = None  # for `store`, made on first use; shared with clones
        self.group = group
        # Drafter segments: each accounts for `offset` tokens, or is stale (drafter_segments.py).
        self.drafters = drafter_segments.Drafters()
        for name, value in (("mtp", mtp), ("dflash", dflash)):
            if value is not None:
                self.attach(drafter_segments.make(name, model, value))
        self.kv_quantization = None
        if quantization is not None:
            self.quantize_kv(quantization)

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
        """Token ids in the cache, open branches included (None where fed without `forward`)."""
        self._sync()
        return self._ledger.ids(self.offset)

    @property
    def committed_tokens(self) -> list:
        """Token ids of the committed positions (None where fed without `forward`)."""
        self._sync()
        return self._ledger.ids(self.committed_offset)

    @property
    def committed_offset(self) -> int:
        """Tokens outside every open branch."""
        return self._branches[0].base_offset if self._branches else self.offset

    # -- forward ----------------------------------------------------------------

    def forward(self, tokens: Sequence[int] | mx.array, *, last_only: bool = False) -> mx.array:
        """Run the model on `tokens` through this cache and record them.

        Args:
            tokens: token ids, a list or an integer mx.array of shape [S] or [1, S].
                An array is recorded without being read (reading it would wait
                for the device each step), so its values are not checked.
            last_only: the head at the last position only (adapters/head.py), as a prefill reads.

        Returns:
            The logits, [1, S, vocab] (lazy, as the model returns them); [1, 1, vocab] with `last_only`.

        Raises:
            ValueError: `tokens` is empty or not token ids; nothing changed.
        """
        if isinstance(tokens, mx.array):
            chunk = token_array(tokens)  # left unread: no device sync per step
        else:
            chunk = token_ids(tokens)
        self._own_layers("forward")
        self._sync()
        if self._branches and self._branches[-1].tree is not None:
            raise BranchError("forward() after forward_tree() in the same branch: commit a path or roll back first")
        saved = [layer.savepoint() for layer in self.cache]
        marks = self.drafters.mark() if self.drafters else ()
        x = chunk[None] if isinstance(chunk, mx.array) else mx.array(chunk, dtype=mx.uint32)[None]
        try:
            logits = last_logits(self.model, x, self.cache) if last_only else self.model(x, cache=self.cache)
            if self.drafters:
                self.drafters.forwarded(chunk)
            if self.kv_quantization is not None and not self._branches:
                self._quantize_due()  # where mlx-lm's generate_step quantizes: after the model call
        except BaseException:
            for layer, point in zip(self.cache, saved):
                layer.restore(point)
            self.drafters.back(marks)
            raise
        self._ledger.append(chunk)
        return logits

    def savepoint(self) -> "Savepoint":
        """A point to undo the forwards that follow, as long as they are not evaluated (`undo`).

        Cheap (offsets and array handles, no copy) and, unlike a branch, it
        changes no code path: the forwards run as they would without it. `undo`
        also drops their unevaluated graphs from every layer (the K/V buffers
        they wrote into included), so nothing of them runs later: in a
        distributed group an abandoned forward must never reach a collective
        (`segcache.distributed`). Drop the savepoint before evaluating the
        forwards: a K/V buffer it still holds is copied by the write instead of
        being updated in place.

        Raises:
            UnsupportedOperationError: an entry of `rt.cache` was replaced.
        """
        self._own_layers("savepoint")
        self._sync()
        if self._in_place is None or self._in_place[0] != self._layers:
            self._in_place = (self._layers, _appended_in_place(self._layers))
        # K/V buffers are kept as views (quantized: a tuple of them; None before any token)
        buffers = [(c, _view(c.keys), _view(c.values)) for c in self._in_place[1]]
        return Savepoint(self, self.offset, tuple(self._branches), [c.savepoint() for c in self.cache], buffers,
                         self._layers, self.drafters.savepoint())

    def undo(self, point: "Savepoint") -> None:
        """Return to `point`: the forwards (and a `restore`) since are dropped, evaluated or not.

        Raises:
            BranchError: `point` is another runtime's, or a branch was opened or
                closed since it was taken; nothing changed.
        """
        if point.runtime is not self or tuple(self._branches) != point.branches or self.offset < point.offset:
            raise BranchError(
                "undo() to a savepoint of another runtime, or across a fork / commit / rollback since it "
                "was taken; undo only the forwards of one step"
            )
        self._own_layers("undo")
        if self._layers != point.own:  # kv_bits quantized layers since: the layers then are as they were
            self.put_back(list(point.own))
        self._sync()
        for layer, own in zip(self.cache, point.layers):
            layer.restore(own)
        for cache, keys, values in point.buffers:
            cache.keys, cache.values = keys, values
        self.drafters.restore(point.drafters)
        self._ledger.truncate(point.offset)

    # -- branches ---------------------------------------------------------------

    def fork(self) -> Branch:
        """Open a branch on top of the current state; O(1) in the context length."""
        self._own_layers("fork")
        self._sync()
        branch = Branch(self, self.offset)
        for layer in self.cache:
            layer.fork()
        self.drafters.fork()
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
        self._own_layers("commit")
        self._sync()
        length = self.offset - inner.base_offset
        if n is None:
            n = length
        if inner.tree is not None:  # a path of the tree (an int n: the chain of nodes 0..n-1)
            n = self.keep_path(n)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= length:
            raise BranchError(f"commit(n={n!r}): n must be an int in 0..{length}, the tokens this branch holds")
        for layer in self.cache:
            layer.commit(n)
        self.drafters.commit(n)
        self._ledger.truncate(inner.base_offset + n)
        self._close(inner)
        if self.kv_quantization is not None and not self._branches:
            self._quantize_due()  # deferred while a branch was open (kvquant)

    def _rollback(self, branch: Branch | None) -> None:
        inner = self._innermost(branch, "rollback")
        self._own_layers("rollback")
        self._sync()
        for layer in self.cache:
            layer.rollback()
        self.drafters.rollback()
        self._ledger.truncate(inner.base_offset)
        self._close(inner)

    def _close(self, branch: Branch) -> None:
        self._branches.pop()
        branch.open = False

    # -- prefix store (the prefill itself: segcache/prefill.py) -----------------

    def prefill(
        self, tokens: Sequence[int] | mx.array, *, step_size: int = 2048, checkpoints: Iterable[int] = ()
    ) -> mx.array:
        """Run a prompt, resuming from the longest prefix the store holds, and publish it.

        Without a store this is a chunked `forward`. With one: restore the
        longest cached prefix (bit-identical to the state that was published),
        compute the rest in chunks of `step_size`, then publish the prompt's
        pages and a checkpoint at its end (and at the point where it leaves an
        earlier published prompt). Store failures make a miss, never an error.
        With a `group`, only a prefix every rank resumes is resumed.

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
            ValueError: `tokens` is empty or not token ids, or `step_size` is not a
                positive int; nothing changed.
        """
        steps = self.prefill_steps(tokens, step_size=step_size, checkpoints=checkpoints)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(
        self, tokens: Sequence[int] | mx.array, *, step_size: int = 2048, checkpoints: Iterable[int] = ()
    ) -> Generator[Resume | int, None, mx.array]:
        """`prefill` one unit of work at a time, so a caller can run other work in between.

        The arguments are checked now (raising as `prefill` does); iterating runs
        the resume, then one forward of at most `step_size` tokens per step.

        Yields:
            First a `segcache.store.Resume` (once resumed: `tokens` held, `restored`
            from the store, the `tier` they came from; without a store, what the
            runtime held and nothing restored), then between two forwards the
            tokens the runtime holds (an int).

        Returns:
            (as the generator's return value) the logits of the prompt's last position.
            Closing the generator early stops the prefill there and publishes nothing.
        """
        return store_prefill.prefill_steps(self, tokens, step_size=step_size, checkpoints=checkpoints,
                                           agree=agreement(self.group))

    def restore(self, ids: list[int], states: list) -> None:
        """Replace the whole committed state by a stored prefix of `ids`; all or nothing.

        Each layer gets `layer.load(*states[i])` (KVLayer: keys, values;
        WindowLayer: keys, values, offset, idx; RecurrentLayer: conv, state,
        offset). Afterwards the runtime holds exactly `ids`.

        Args:
            ids: the token ids the states were computed from (may be empty; None
                where unknown, as in a prompt cache file: then it never publishes).
            states: one argument tuple per layer, in layer order.

        Raises:
            BranchError: a branch is open; nothing changed.
            ValueError: `ids` are not token ids, `states` do not match the layers,
                or a layer would hold another number of tokens than `ids`;
                nothing changed.
            Exception: whatever a layer's `load` raised; every layer was put back.
        """
        self._own_layers("restore")
        if self._branches:
            raise BranchError(
                f"restore() with {self.depth} open branch(es): commit or roll them back first"
            )
        ids = list(ids)
        if not all(t is None or isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"restore(): ids must be non-negative ints (or None); got {ids!r:.80}")
        if len(states) != len(self.cache) or not all(isinstance(s, tuple) for s in states):
            raise ValueError(
                f"restore(): {len(states)} state tuples for {len(self.cache)} layers; pass one tuple per layer"
            )
        self._load(states, ids)

    def _load(self, states: list, ids: list) -> None:
        """`layer.load(*states[i])` on every layer and the ledger reset to `ids`, all or nothing."""
        # load() rebinds a layer's attributes and never writes into its arrays,
        # so the attributes (lists copied) are enough to put a layer back.
        saved = [{k: list(v) if isinstance(v, list) else v for k, v in vars(layer).items()} for layer in self.cache]
        try:
            for i, (layer, state) in enumerate(zip(self.cache, states)):
                layer.load(*state)
                if layer.offset != len(ids):
                    raise ValueError(
                        f"layer {i} holds {layer.offset} tokens after load, "
                        f"but {len(ids)} ids were given"
                    )
        except BaseException:
            for layer, attrs in zip(self.cache, saved):
                vars(layer).clear()
                vars(layer).update(attrs)
            raise
        for layer in self.cache:
            layer.take_trim()  # the ledger starts over
        self.drafters.invalidate()  # until the store loads theirs (prefill.py), they hold nothing
        self._ledger.reset(ids)

    @classmethod
    def from_prompt_cache(cls, model, cache: Sequence, **options) -> "Runtime":
        """A Runtime holding the committed state of segcache layer caches, e.g. loaded back
        with mlx-lm's `load_prompt_cache` from a file `save_prompt_cache(path, rt.cache)` wrote.

        Its token ids are None (the file does not hold them): it forks and generates,
        but does not publish. See `segcache.prompt_layers.load_layers`.

        Args:
            model: the model the cache was computed with.
            cache: one segcache layer per decoder layer, of the kinds and layouts
                `Runtime(model)` builds, all holding the same count.
            **options: as for `Runtime(model, ...)`.

        Raises:
            ValueError: `cache` does not fit the model's layers.
        """
        return load_layers(cls(model, **options), cache)

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
        return store_prefill.publish(self)

    def prefix_cache(self):
        """The `PrefixCache` of this runtime's store (shared with clones; rebuilt if the store changed)."""
        if self.store is None:
            raise StoreError("this Runtime has no store: pass store=open_store(...) to Runtime()")
        self._own_layers("prefix_cache")
        unstored = [i for i, layer in enumerate(self.cache) if layer.resumes_from == UNSTORED]
        if unstored:
            raise UnsupportedOperationError(
                f"the prefix store on a runtime whose layers {unstored} are {type(self.cache[unstored[0]]).__name__}, "
                "a kind the store cannot hold; use a Runtime without a store; nothing was changed"
            )
        if self._prefix is None or self._prefix.store is not self.store or self._prefix.layouts != self._layouts():
            self._prefix = PrefixCache(self)  # layouts change when kv_bits quantizes the KV layers
        return self._prefix

    def _layouts(self) -> list:
        return [layer.layout() for layer in self.cache]

    # -- sharing ----------------------------------------------------------------

    def clone(self) -> "Runtime":
        """An independent Runtime over the committed state, shared copy-on-write.

        Open branches are not cloned. Neither runtime ever sees the other's writes.
        """
        other = object.__new__(type(self))
        other.model = self.model
        other.recurrent_strategy = self.recurrent_strategy
        self._own_layers("clone")
        self._sync()
        other.gdn_prefill = self.gdn_prefill
        other.cache = [layer.clone() for layer in self.cache]
        other._layers = tuple(other.cache)
        other._in_place = None
        other._ledger = self._ledger.copy(self.committed_offset)
        other._branches = []
        other.store, other._prefix, other.cache_salt = self.store, self._prefix, self.cache_salt
        other.group = self.group
        other.drafters = self.drafters.clone()
        other.kv_quantization = self.kv_quantization
        return other

    def attach(self, segment) -> None:
        """Carry a drafter segment (drafter_segments.py) beside the layers, replacing one of its name.

        Raises:
            BranchError: a branch is open; nothing changed.
        """
        if self._branches:
            raise BranchError(f"attach() with {self.depth} open branch(es): commit or roll them back first")
        if self.offset and segment.offset != self.offset:
            segment.invalidate()  # it has not seen what this runtime holds
        self.drafters = self.drafters.attach(segment)

    # -- invariants -------------------------------------------------------------

    def check(self) -> None:
        """Verify every invariant of the runtime and its layers.

        Raises:
            InvariantError: naming the first violation found.
        """
        try:
            self._own_layers("check")
        except UnsupportedOperationError as exc:
            raise InvariantError(str(exc)) from None
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
        if self._ledger.recorded == self.offset and all(layer.peek_trim() is None for layer in self.cache):
            self.drafters.check(self.offset, [b.base_offset for b in self._branches])  # else _sync drops them
        lows = [low for layer in self.cache if (low := layer.peek_trim()) is not None]
        if lows:  # check what the next read will see, changing nothing
            ledger = self._ledger.copy(min(lows))
            ledger.check(self.offset)
        else:
            self._ledger.check(self.offset)

    # -- calls that bypassed the runtime (rt.cache used by mlx-lm directly) ----------

    def _sync(self) -> None:
        """Bring the ledger up to date: trimmed positions are forgotten (even if
        refilled since), positions fed directly read None."""
        lows = [low for layer in self.cache if (low := layer.take_trim()) is not None]
        if lows:
            self._ledger.truncate(min(lows))
        if self.drafters and (lows or self._ledger.recorded != self.offset):
            self.drafters.invalidate()  # fed or trimmed around the runtime: they never saw it
        self._ledger.sync(self.offset)

    def _own_layers(self, verb: str) -> None:
        """Raise if an entry of `rt.cache` is no longer the layer this runtime built.

        An entry that is exactly the layer one of ours made of itself (mlx-lm's
        kv_bits: `KVLayer.to_quantized`, refused inside a branch) is adopted:
        it holds the same tokens and speaks the same branch protocol.
        """
        if len(self.cache) == len(self._layers) and any(
            layer is not own and layer is own.replaced_by for layer, own in zip(self.cache, self._layers)
        ):
            self._layers = tuple(
                layer if layer is own.replaced_by else own for layer, own in zip(self.cache, self._layers)
            )
        for i, (layer, own) in enumerate(zip(self.cache, self._layers)):
            if layer is not own:
                raise UnsupportedOperationError(
                    f"{verb}(): rt.cache[{i}] is a {type(layer).__name__}, not the {type(own).__name__} this "
                    "runtime built; something replaced it (e.g. with mlx-lm's own QuantizedKVCache). "
                    "The runtime cannot branch over it: build a new Runtime"
                )
        if len(self.cache) != len(self._layers):
            raise UnsupportedOperationError(
                f"{verb}(): rt.cache has {len(self.cache)} entries, this runtime built {len(self._layers)}; "
                "build a new Runtime"
            )

    def __repr__(self) -> str:
        kinds = {}
        for layer in self.cache:
            kinds[type(layer).__name__] = kinds.get(type(layer).__name__, 0) + 1
        layout = ", ".join(f"{n}x{k}" for k, n in kinds.items())
        return f"Runtime(offset={self.offset}, depth={self.depth}, layers=[{layout}])"
