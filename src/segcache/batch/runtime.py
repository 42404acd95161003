"""BatchRuntime: B rows of one model, one forward per step, a branch per row.

    br = BatchRuntime(model)
    br.join("a", rt_a); br.join("b", rt_b)      # rows prefilled alone (store resume), merged in
    br.forward([[y_a], [y_b]])                    # one decode step for every row
    br.fork()                                     # a branch on every row
    br.forward([[y_a, d1, d2], [y_b]])            # ragged: row b padded on the right
    br.commit([3, 1])                             # each row keeps its own count
    br.leave("a")                                 # the others are untouched
    br.forward_padded([[p1, p2, p3], [q1]])       # outside a branch: masks keep row b's pads out

Rules that keep padding out of committed state: a forward whose rows differ
in length must run inside the branch and is its last forward (the branch is
then sealed); each row commits at most the tokens it really fed. Rolling one
row back is committing 0 for it. One branch level.

Outside a branch, `forward_padded` runs rows of different lengths in one
call with per-row masks instead (mlx-lm's right-padding protocol, `prepare`
/ `finalize` on every layer), where every layer's kind takes them
(`pads_rows`: full attention, sliding window, Gated DeltaNet):

    row a  [ held a | p1 p2 p3 ]          KV / window: pads written past the row's end, which
    row b  [ held b | q1 pad pad ]        no real query sees; its length moves by its real count
                                          GDN: the mask holds the state through pads and zeroes
                                          their conv inputs; the tail is taken after q1

so each row ends holding exactly its real tokens, with nothing to commit or
replay (the chunked GDN recurrence runs over all rows at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import mlx.core as mx

from .. import registry
from ..errors import BranchError, InvariantError, UnsupportedModelError, UnsupportedOperationError
from ..adapters.chunked import chunked_threshold
from ..adapters.head import Head
from ..layers.quantized import QuantizedKVLayer
from ..layers.recurrent import RecurrentLayer
from ..layers.state import default_state_strategy
from ..layers.window import BatchWindowLayer
from ..runtime import Runtime, default_recurrent_strategy
from .tree_rows import TreeRows


@dataclass
class Row:
    """One sequence of the batch.

    Invariants: base is None iff no branch is open; 0 <= base <= len(tokens);
    fed_in_branch == len(tokens) - base inside a branch; a None in tokens (a
    token fed as an unevaluated array) lies in the open branch, until `fill`.
    """

    id: Hashable
    tokens: list = field(default_factory=list)  # ids at positions 0..length-1 (real tokens only; None: not read yet)
    base: int | None = None  # len(tokens) when the branch began
    # (store, cache_salt, gdn_prefill) of the Runtime it joined from: the Runtime it leaves as carries them
    home: tuple = (None, None, "native")

    @property
    def branch_length(self) -> int:
        return 0 if self.base is None else len(self.tokens) - self.base


def _build(model, strategy: str, state_strategy: str) -> list:
    """One batched layer per cache of the model, each of the kind the registry matched.

    Every layer is matched and its batched layer built before any module is
    adapted, so a model that cannot be batched is left as it was.
    """
    plan = registry.plan(model)
    options = registry.Options(strategy, 1 << 62, state_strategy)  # no budget: BatchRuntime keeps one branch level
    layers = []
    for i, (kind, cache, matched) in enumerate(plan):
        try:
            if kind.batched is None:
                batched = ", ".join(k.name for k in registry.KINDS if k.batched is not None)
                raise UnsupportedModelError(f"{kind.name} segments are not batched (batched kinds: {batched})")
            layers.append(kind.batched(cache, matched, options))
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(
                f"layer {i} uses {type(cache).__name__}: {exc} (serve such models with --decode-concurrency 1)"
            ) from None
    registry.adapt(plan)
    return layers


class BatchRuntime(TreeRows):
    """Rows of one model in shared batched layer caches (the rows protocol of batch/rows.py).

    Args:
        model: an mlx-lm model with full-attention, sliding-window, Gated DeltaNet and/or
            the recurrent layers of `StateLayer` families (SSM, short conv, RWKV-7, ...).
        recurrent_strategy: "auto", "replay" or "states", as for `Runtime`.
        gdn_prefill: how Gated DeltaNet rows run blocks outside branches, as for
            `Runtime` ("native", "chunked" or "auto"): a forward where every row feeds
            the same block (no padding) runs the chunked recurrence over all rows.

    Raises:
        UnsupportedModelError: a layer kind that is not batched (`CacheList` layers,
            attention sinks, recurrent_gemma, longcat_flash_ngram: docs/batching.md);
            the model is left as it was.
    """

    # A plain step's lookahead runs in a branch: a row joining before the next step
    # (its pending token not fed) rolls it back, so every row holds history[:-1] again.
    lookahead_in_branch = True

    def __init__(self, model, *, recurrent_strategy: str = "auto", gdn_prefill: str = "native"):
        chunked_from = chunked_threshold(gdn_prefill)  # raises ValueError on a bad name
        # StateLayer families (SSM, short conv, ...): "auto" is "replay", as in Runtime
        state_strategy = default_state_strategy() if recurrent_strategy == "auto" else recurrent_strategy
        if recurrent_strategy == "auto":
            recurrent_strategy = default_recurrent_strategy()
        self.model = model
        self.head = Head(model)  # a prefill's logits at each row's last position only
        self.recurrent_strategy = recurrent_strategy
        self.cache = _build(model, recurrent_strategy, state_strategy)
        for layer in self.cache:
            if isinstance(layer, RecurrentLayer):
                layer.chunked_from = chunked_from
        self.rows: list[Row] = []  # row i of every layer is rows[i]
        self.branch_open = False
        self.sealed = False  # a ragged forward ran in the open branch: no more forwards in it

    # -- rows -------------------------------------------------------------------------

    @property
    def ids(self) -> list:
        return [r.id for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        """Tokens each row holds, its branch included."""
        return [len(r.tokens) for r in self.rows]

    def index(self, row_id) -> int:
        for i, r in enumerate(self.rows):
            if r.id == row_id:
                return i
        raise KeyError(f"no row {row_id!r} in the batch (rows: {self.ids})")

    def tokens(self, row_id) -> list:
        return list(self.rows[self.index(row_id)].tokens)

    def join(self, row_id, runtime: Runtime | None = None) -> None:
        """Add a row holding `runtime`'s committed state (empty if None); between steps.

        Raises:
            BranchError: a branch is open here or in `runtime`; nothing changed.
            ValueError: the id is taken or the runtime is of another model.
        """
        if self.branch_open:
            raise BranchError(f"join({row_id!r}) with a branch open: commit or roll it back first")
        if any(r.id == row_id for r in self.rows):
            raise ValueError(f"join({row_id!r}): a row with that id is already in the batch")
        tokens: list = []
        states = [None] * len(self.cache)
        home = (None, None, "native") if runtime is None else (runtime.store, runtime.cache_salt, runtime.gdn_prefill)
        if runtime is not None:
            if runtime.model is not self.model:
                raise ValueError("join(): the runtime is of another model")
            if runtime.depth:
                raise BranchError(f"join({row_id!r}): the runtime has {runtime.depth} open branch(es)")
            if any(isinstance(layer, QuantizedKVLayer) for layer in runtime.cache):
                raise UnsupportedOperationError(
                    f"join({row_id!r}): the runtime holds quantized KV (mlx-lm's kv_bits); batch rows hold "
                    "unquantized K/V: join before quantizing"
                )
            tokens = runtime.tokens
            states = [layer.state for layer in runtime.cache]
        # every layer's row first (a ring in temporal order, ...): one that cannot join raises
        # before any layer changed
        rows = [layer.row_from(state) for layer, state in zip(self.cache, states)]
        for layer, row in zip(self.cache, rows):
            layer.add_row(*row)
        self.rows.append(Row(row_id, tokens, home=home))

    def leave(self, *row_ids) -> None:
        """Drop rows (finished or cancelled); the others keep their state and branch."""
        gone = {self.index(r) for r in row_ids}
        self.filter([i for i in range(len(self.rows)) if i not in gone])

    def filter(self, keep: Sequence[int]) -> None:
        """Keep the rows at `keep` (indices, in that order), branch records included."""
        keep = list(keep)
        if len(set(keep)) != len(keep) or any(not 0 <= i < len(self.rows) for i in keep):
            raise ValueError(f"filter({keep}): indices must be distinct, in 0..{len(self.rows) - 1}")
        for layer in self.cache:
            layer.take(keep)
        self.rows = [self.rows[i] for i in keep]

    def extract(self, row_id) -> "BatchRuntime":
        """A new one-row batch with this row's state and branch records; the row leaves this batch."""
        other = self.copy_row(row_id)
        self.leave(row_id)
        return other

    def copy_row(self, row_id) -> "BatchRuntime":
        """A new one-row batch with this row's state and branch records; this batch is unchanged.

        Arrays are shared, never written through either batch (each forward or
        commit makes new ones), so the copy costs no device memory until it moves.
        """
        i = self.index(row_id)
        other = BatchRuntime.__new__(BatchRuntime)
        other.model, other.head, other.recurrent_strategy = self.model, self.head, self.recurrent_strategy
        other.branch_open, other.sealed = self.branch_open, self.sealed
        other.cache = []
        for layer in self.cache:
            clone = _shallow(layer)
            clone.take([i])
            other.cache.append(clone)
        row = self.rows[i]
        other.rows = [Row(row.id, list(row.tokens), row.base, row.home)]
        return other

    def to_runtime(self, row_id) -> Runtime:
        """A single-sequence Runtime holding the row's committed state (copies), with the store and
        isolation domain of the Runtime the row joined from; outside a branch."""
        if self.branch_open:
            raise BranchError("to_runtime() with a branch open: commit or roll it back first")
        i = self.index(row_id)
        store, salt, gdn = self.rows[i].home  # a hot runtime's clones prefill as the runtime it joined from
        rt = Runtime(self.model, store=store, cache_salt=salt, recurrent_strategy=self.recurrent_strategy, gdn_prefill=gdn)
        tokens = self.rows[i].tokens
        if tokens:
            rt.restore(tokens, [layer.row_load(i, len(tokens)) for layer in self.cache])
        return rt

    # -- forward ------------------------------------------------------------------------

    def forward(self, tokens: Sequence[Sequence[int]] | mx.array) -> mx.array:
        """One model call over every row: `tokens[i]` for row i (non-empty).

        Rows of different lengths are padded on the right; that needs an open
        branch and seals it (its last forward). Returns logits [B, S_max, V];
        row i's are valid at [:len(tokens[i])].

        `tokens` may be an unevaluated integer array [B, S] (e.g. the tokens just
        chosen, so the forward is built before they are read); inside a branch
        only. The rows record None for them until `fill` gives the ids.

        Raises:
            ValueError: wrong number of rows or an empty row; nothing changed.
            BranchError: ragged outside a branch, or a forward in a sealed branch.
        """
        if isinstance(tokens, mx.array):
            return self._forward_array(tokens)
        if len(tokens) != len(self.rows) or not self.rows or any(len(t) == 0 for t in tokens):
            raise ValueError(f"forward(): one non-empty token list per row ({len(self.rows)} rows)")
        if self.sealed:
            raise BranchError("forward() after a ragged forward in this branch: commit or roll it back first")
        S = max(len(t) for t in tokens)
        ragged = any(len(t) != S for t in tokens)
        if ragged and not self.branch_open:
            raise BranchError("rows of different lengths forward only inside a branch (padding is never committed)")
        x = mx.array([list(t) + [0] * (S - len(t)) for t in tokens], dtype=mx.uint32)
        logits = self.model(x, cache=self.cache)
        for row, t in zip(self.rows, tokens):
            row.tokens.extend(int(v) for v in t)
        self.sealed = ragged
        return logits

    @property
    def pads_rows(self) -> bool:
        """Whether `forward_padded` takes rows of different lengths (every layer's kind masks pads)."""
        return all(getattr(layer, "pads_rows", False) for layer in self.cache)

    def forward_padded(self, tokens: Sequence[Sequence[int]], *, pad: int = 0, last_only: bool = False) -> mx.array:
        """One model call over every row outside a branch, rows of different lengths right-padded.

        Every layer is told each row's real count (`prepare(lengths=...)`), so row i
        holds exactly `tokens[i]` after it: KV and window rows advance by their own
        count, recurrent rows keep their state and conv tail through the pads. Rows
        of one length are `forward`. `pad` is the id the pads carry: any id gives every
        row the same bits. Returns logits [B, S_max, V]; row i's are valid at
        [:len(tokens[i])]. `last_only`: the logits [B, V] of each row's last real
        token instead, the output head run at those positions only (adapters/head.py:
        what the full call gives there, a tenth of a small model's prefill saved).

        Raises:
            ValueError: wrong number of rows or an empty row; nothing changed.
            BranchError: a branch is open; nothing changed.
            UnsupportedOperationError: rows differ in length and a layer's kind cannot mask
                them (`pads_rows`: state kinds other than Gated DeltaNet); nothing changed.
        """
        if self.branch_open:
            raise BranchError("forward_padded() with a branch open: a branch pads with forward() and commit()")
        if len(tokens) != len(self.rows) or not self.rows or any(len(t) == 0 for t in tokens):
            raise ValueError(f"forward_padded(): one non-empty token list per row ({len(self.rows)} rows)")
        counts = [len(t) for t in tokens]
        S = max(counts)
        if min(counts) == S:
            if not last_only:
                return self.forward(tokens)
            x = mx.array([list(t) for t in tokens], dtype=mx.uint32)
            logits = self.head.rows_logits(x, self.cache, [n - 1 for n in counts])
            for row, t in zip(self.rows, tokens):
                row.tokens.extend(int(v) for v in t)
            return logits
        if not self.pads_rows:
            kinds = sorted({type(layer).__name__ for layer in self.cache if not getattr(layer, "pads_rows", False)})
            raise UnsupportedOperationError(f"forward_padded(): {', '.join(kinds)} cannot mask padded rows; "
                                            "feed rows of one length")
        x = mx.array([list(t) + [pad] * (S - len(t)) for t in tokens], dtype=mx.uint32)
        padding = [S - n for n in counts]
        for layer in self.cache:
            layer.prepare(lengths=counts, right_padding=padding)
        try:
            if last_only:
                logits = self.head.rows_logits(x, self.cache, [n - 1 for n in counts])
            else:
                logits = self.model(x, cache=self.cache)
        finally:  # a failed call leaves the batch to be dropped (as forward's), never masks behind
            for layer in self.cache:
                layer.finalize()
        for row, t in zip(self.rows, tokens):
            row.tokens.extend(int(v) for v in t)
        return logits

    def _forward_array(self, tokens: mx.array) -> mx.array:
        if tokens.ndim != 2 or tokens.shape[0] != len(self.rows) or not self.rows or tokens.shape[1] == 0:
            raise ValueError(f"forward(): an array of [{len(self.rows)}, S >= 1] tokens, got {tokens.shape}")
        if not self.branch_open:
            raise BranchError("forward() of unread tokens outside a branch: fork() first (fill() records them)")
        if self.sealed:
            raise BranchError("forward() after a ragged forward in this branch: commit or roll it back first")
        logits = self.model(tokens.astype(mx.uint32), cache=self.cache)
        for row in self.rows:
            row.tokens.extend([None] * tokens.shape[1])
        return logits

    def fill(self, ids: Sequence[Sequence[int]]) -> None:
        """Record the ids of the unread tokens each row fed last (row i: `ids[i]`, as many as it has).

        Raises:
            ValueError: not one list per row, or a length that is not the row's unread count; nothing changed.
        """
        unread = [len(r.tokens) - _known(r.tokens) for r in self.rows]
        if len(ids) != len(self.rows) or [len(t) for t in ids] != unread:
            raise ValueError(f"fill(): one list per row of its unread tokens {unread}")
        for row, t, n in zip(self.rows, ids, unread):
            if n:
                row.tokens[-n:] = [int(v) for v in t]

    # -- branches -----------------------------------------------------------------------

    def fork(self) -> None:
        """Open a branch on every row."""
        if self.branch_open:
            raise BranchError("fork(): a branch is open already (batches keep one level)")
        for layer in self.cache:
            layer.fork()
        for row in self.rows:
            row.base = len(row.tokens)
        self.branch_open = True
        self._trees = None  # a tree is pending only after forward_trees in this branch (tree_rows.py)

    def commit(self, ns: Sequence[int] | dict) -> None:
        """Keep the first ns[i] tokens of row i's branch (a dict: by row id; missing rows keep 0).

        Raises:
            BranchError: no branch, some n outside 0..what the row fed, or a token kept
                is not read yet (`fill`); nothing changed.
        """
        if not self.branch_open:
            raise BranchError("commit() with no open branch: fork() first")
        if isinstance(ns, dict):
            unknown = set(ns) - set(self.ids)
            if unknown:
                raise BranchError(f"commit(): no rows {sorted(map(repr, unknown))}")
            ns = [ns.get(r.id, 0) for r in self.rows]
        ns = list(ns)
        if len(ns) != len(self.rows) or any(
            not isinstance(n, int) or not 0 <= n <= r.branch_length for n, r in zip(ns, self.rows)
        ):
            raise BranchError(
                f"commit({ns}): one n per row, each in 0..its branch length {[r.branch_length for r in self.rows]}"
            )
        if any(None in r.tokens[r.base : r.base + n] for n, r in zip(ns, self.rows)):
            raise BranchError(f"commit({ns}): tokens fed as an array are not read yet: fill() them first")
        for layer in self.cache:
            layer.commit_rows(ns)
        for row, n in zip(self.rows, ns):
            del row.tokens[row.base + n :]
            row.base = None
        self.branch_open = self.sealed = False

    def rollback(self) -> None:
        """Drop the branch on every row (one row: commit 0 for it)."""
        if not self.branch_open:
            raise BranchError("rollback() with no open branch")
        for layer in self.cache:
            layer.rollback()
        for row in self.rows:
            del row.tokens[row.base :]
            row.base = None
        self.branch_open = self.sealed = False

    def check(self) -> None:
        """Every layer's invariants, and rows, lengths and branches in agreement."""
        for layer in self.cache:
            layer.check()
        for row in self.rows:
            if (row.base is None) == self.branch_open:
                raise InvariantError(f"row {row.id!r}: branch base {row.base} but branch_open={self.branch_open}")
            if None in row.tokens[: _known(row.tokens)] or _known(row.tokens) < (len(row.tokens) if row.base is None else row.base):
                raise InvariantError(f"row {row.id!r}: unread tokens outside the open branch's end")
        windows = [layer for layer in self.cache if isinstance(layer, BatchWindowLayer)]
        # the model builds one window mask from one layer for all: every window layer has one layout
        if any((w.max_size, w.starts, w.lengths) != (windows[0].max_size, windows[0].starts, windows[0].lengths)
               for w in windows):
            raise InvariantError("the sliding-window layers disagree on their layout")
        lengths = [len(r.tokens) for r in self.rows]
        bases = [r.base for r in self.rows] if self.branch_open else None
        for layer in self.cache:
            layer.check_rows(lengths, bases, self.sealed)

    def __repr__(self) -> str:
        return f"BatchRuntime(rows={[(r.id, len(r.tokens)) for r in self.rows]}, branch={self.branch_open})"


def _known(tokens: list) -> int:
    """Length of the prefix of `tokens` that is read (no None)."""
    n = len(tokens)
    while n and tokens[n - 1] is None:
        n -= 1
    return n


def _shallow(layer):
    """A layer object sharing `layer`'s arrays (arrays are never written through a taken copy,
    and `take` replaces the branch marks it cuts, never changes them)."""
    clone = type(layer).__new__(type(layer))
    vars(clone).update({k: (list(v) if isinstance(v, list) else v) for k, v in vars(layer).items()})
    return clone
