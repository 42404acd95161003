"""A DFlash drafter's context cache as a drafter segment of a Runtime (drafter_segments.py).

    target   tokens 0 .. n-1; ctx[p] = the drafter's fc + norm of the tapped layers at p
    kv       every drafter layer's context K/V of ctx[0 .. held-1]      one behind: held = max(n - 1, 0)
    tail     ctx[n-1], [1, 1, H]                                      projected at the next draft

One behind like the MTP head's segment (mtp/state.py), so the prefix store keeps it the
same way (store/drafter_records.py: pages of K/V rows, the boundary's `tail` at a
checkpoint). A forward of S tokens through the runtime appends the K/V of [tail, ctx of
its first S-1 positions] at positions held.. and keeps its last ctx as the tail; the
layer outputs come from the target's tap (dflash/tap.py) of that very forward. K/V of
position p depend on ctx[p] and p only, so a branch's `commit(n)` keeps the first rows
of what its forwards appended, and the tail is the n-th kept ctx: exactly what feeding
only the kept tokens makes. The block's own K/V never enter the cache.

A stale segment (its runtime's state replaced without it, or lent to a drafter's rows)
holds nothing and ignores forwards until `load`.
"""

from __future__ import annotations

import hashlib
import weakref

import mlx.core as mx

from ..layers.kv import KVLayer
from ..one_behind import OneBehindSegment
from ..spec import spec_of
from ..store.identity import weights_fingerprint
from .model import Drafter, _target_parts
from .tap import install


class ContextSegment(OneBehindSegment):
    """The drafter's context K/V and unprojected last ctx, one row, as a drafter segment
    (one_behind.py: its states are the projected tapped layers, its rows the context K/V).

    Args:
        drafter: the `Drafter` bound to the runtime's model.
    """

    name = "dflash"
    label = "DFlash segment"

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        super().__init__(install(drafter.model, drafter.cfg.target_layer_ids))

    @property
    def identity(self) -> bytes:
        """What names the drafter in the store: its weights, layers and taps (and DFlash2's sizes)."""
        return drafter_identity(self.drafter)

    def states(self, h: mx.array) -> mx.array:
        """ctx [1, S, H] of the tapped layers' outputs `h` [1, S, m*H]."""
        return self.drafter.context(h)

    def feed(self, states: mx.array, tokens) -> None:
        """The context K/V of `states` at rows held.. (a context row depends on its ctx and its
        position only)."""
        self.kv.update_and_fetch(*self.drafter.context_kv(states, self.held))

    def probe(self) -> tuple:
        probe = _PROBES.get(self.drafter)
        if probe is None:
            probe = _PROBES[self.drafter] = _probe(self.drafter)
        return probe


_PROBES: "weakref.WeakKeyDictionary[Drafter, tuple]" = weakref.WeakKeyDictionary()


def _probe(drafter: Drafter) -> tuple:
    """The specs of one context row's K/V and of one ctx, from the dtype the target's layers hand on."""
    inner, _, _ = _target_parts(drafter.model)
    x = inner.embed_tokens(mx.array([[0]], dtype=mx.uint32))
    h = mx.zeros((1, 1, drafter.cfg.context_width), dtype=x.dtype)
    ctx = drafter.context(h)
    kv = KVLayer()
    kv.update_and_fetch(*drafter.context_kv(ctx, 0))
    return spec_of(kv.export_rows(0, 1)), spec_of({"hidden": ctx})["hidden"]


_IDENTITIES: "weakref.WeakKeyDictionary[Drafter, bytes]" = weakref.WeakKeyDictionary()


def drafter_identity(drafter: Drafter) -> bytes:
    found = _IDENTITIES.get(drafter)
    if found is None:
        h = hashlib.blake2b(digest_size=32, person=b"segcache.dfl.1")
        c = drafter.cfg
        h.update(f"dflash|layers={c.num_hidden_layers}|taps={list(c.target_layer_ids)}|".encode())
        if c.dflash2:  # the same context K/V as a DFlash drafter's; named apart all the same
            h.update(f"dflash2|conv={c.conv_kernel_size}x{c.conv_group_size}|".encode())
        h.update(weights_fingerprint(drafter.module))
        found = _IDENTITIES[drafter] = h.digest()
    return found


def segment(model, value) -> ContextSegment:
    """`Runtime(model, dflash=value)`: a `ContextSegment`, or one of a `Drafter` bound to `model`."""
    if isinstance(value, ContextSegment):
        value = value.drafter
    if not isinstance(value, Drafter):
        raise ValueError(f"dflash=: a DFlash Drafter (segcache.dflash.load_dflash(path, model)), not "
                         f"{type(value).__name__}")
    if value.model is not model:
        raise ValueError("dflash=: the drafter is bound to another model")
    return ContextSegment(value)
