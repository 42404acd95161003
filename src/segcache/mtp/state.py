"""The MTP head's attention cache as a drafter segment of a Runtime (drafter_segments.py).

    target   tokens 0 .. n-1, hidden[0 .. n-1]                   (the runtime's layers)
    kv       pairs (hidden[p], token[p+1]) for p < held           one behind: held = max(n - 1, 0)
    tail     hidden[n-1], [1, 1, H]                               not fed yet (its token comes next)

Every forward of S tokens through the runtime feeds the head the pairs it
completes: (tail, t_0), (h_0, t_1), ..., (h_{S-2}, t_{S-1}) in one head call
(the first forward has no tail: S - 1 pairs), and keeps h_{S-1} as the new
tail; the hidden states come from the target's tap (mtp/tap.py) of that very
forward. A branch forks the head's KV layer with the target's layers and keeps
the hidden states its forwards produced, so `commit(n)` keeps the pairs of the
n kept tokens and takes the tail from the n-th kept state, exactly what feeding
only those tokens would have made (the K/V of a pair depend on that pair and
the pairs before it, nothing later).

A stale segment (the runtime's state was replaced by a `restore` the store did
not accompany with the head's, or a decoder took the head's state for its rows:
`lend`) holds nothing and ignores forwards until `load`.

The store saves `kv`'s rows as pages and the tail as the boundary's hidden
state (store/drafter_records.py), under an identity naming the head's weights.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from ..layers.kv import KVLayer
from ..one_behind import OneBehindSegment
from ..spec import spec_of
from .module import MTPHead, _text_parts
from .tap import install
from .weights import head_named


class HeadSegment(OneBehindSegment):
    """The MTP head's attention cache and unfed hidden state, one row, as a drafter segment
    (one_behind.py: its states are the target's hidden states, its rows the head's pairs).

    Args:
        head: the target's `MTPHead` (a drafter runs `head.for_drafting()`; so does this).
    """

    name = "mtp"
    label = "MTP head's segment"

    def __init__(self, head: MTPHead):
        self.head = head.for_drafting()
        super().__init__(install(self.head.model))

    @property
    def identity(self) -> bytes:
        """What names the head in the store: its weights and layers (another head is a miss)."""
        return head_identity(self.head)

    def feed(self, states: mx.array, tokens) -> None:
        """The pairs (states[p], tokens[p]) in one head call (depth 0: layer 0's cache)."""
        toks = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)
        self.head(states, toks[None], [self.kv] * self.head.num_layers)

    def probe(self) -> tuple:
        probe = _PROBES.get(self.head)
        if probe is None:
            probe = _PROBES[self.head] = _probe(self.head)
        return probe

    def lend(self) -> tuple:
        """Hand the state to a drafter's rows (HeadRows): (keys [1, h, held, D] or None, values, tail
        [1, 1, H] or None); the segment is stale afterwards (the decoder's rounds keep the head's
        state from then on).

        Raises:
            BranchError: a branch is open. InvariantError: the segment is stale.
        """
        keys, values, _, tail = super().lend()
        return keys, values, tail


_PROBES: "weakref.WeakKeyDictionary[MTPHead, tuple]" = weakref.WeakKeyDictionary()


def _probe(head: MTPHead) -> tuple:
    """The specs of one pair's K/V and of one hidden state: the target's final norm of one token's
    embedding (the dtype and width its backbone hands the output head; not through the tap, which
    may be collecting a prefill's states), fed to the head with a token."""
    _, text_model, _, _ = _text_parts(head.model)
    hidden = install(head.model).norm(text_model.embed_tokens(mx.array([[0]], dtype=mx.uint32)))
    kv = KVLayer()
    head(hidden, mx.array([[0]], dtype=mx.uint32), [kv] * head.num_layers)
    return spec_of(kv.export_rows(0, 1)), spec_of({"hidden": hidden})["hidden"]


def head_identity(head: MTPHead) -> bytes:
    """The head's name in the store (`MTPHead.identity`)."""
    return head.identity


def segment(model, value) -> HeadSegment:
    """`Runtime(model, mtp=value)`: a `HeadSegment`, or a head as `head_named` reads `value` (an
    MTPHead, True, or a path)."""
    if isinstance(value, HeadSegment):
        if value.head.model is not model:
            raise ValueError("mtp=: the segment's head is another model's")
        return value
    return HeadSegment(head_named(model, value))
