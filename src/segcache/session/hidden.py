"""An MTP drafter's hidden states of the forwards a prompt's prefill ran.

With an MTP drafter, the target's tap (mtp/tap.py) keeps the final hidden
state of every forward while collecting. A prefill hands its row's share of
them to the decoder with the row (`HiddenStates`), so the head needs no second
forward of the prompt. A prefix restored from the store has none: then the
drafter computes them itself.

    forward 1 [B, c1, H]   forward 2 [B, c2, H] ...     row i of each, in order
              └─ row i ─┐            └─ row i ─┐
    Hidden.parts:   [c1, H]               [c2, H] ...    -> HiddenStates(concatenated)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..mtp.drafter import HiddenStates


class Hidden:
    """One prompt's hidden states, collected while its forwards run (nothing without MTP).

    Invariant: `parts` are [n_k, H] arrays of consecutive positions ending at the
    last position the prefill fed (a suffix of the prompt's positions).
    """

    def __init__(self, decoder):
        self.tap = decoder.drafter.tap if decoder.mode == "mtp" else None
        self.parts: list = []

    def states(self, held: int) -> HiddenStates | None:
        """The row's `HiddenStates`: the last positions of the `held` tokens its runtime holds,
        or None when there are none (no MTP, nothing fed) or more than those (not this row's)."""
        if not self.parts:
            return None
        hidden = mx.concatenate(self.parts, axis=0)
        return HiddenStates(hidden) if hidden.shape[0] <= held else None


@contextmanager
def collecting(hiddens: Sequence[Hidden | None], fed: Optional[Callable[[], Sequence[int]]] = None):
    """While the block runs, row i of every forward's hidden states goes to `hiddens[i]`
    (a row of one prompt alone: [hidden]; a batch's rows in order; None: not kept). `fed`, for
    a block of one padded forward: each row's real count, read after it ran (its pads are cut)."""
    tap = next((h.tap for h in hiddens if h is not None and h.tap is not None), None)
    if tap is None:
        yield
        return
    with tap.collecting() as chunks:
        try:
            yield
        finally:  # a prefill's last forward ends its generator (StopIteration): keep what it ran
            counts = fed() if fed is not None and chunks else None
            for chunk in chunks:
                for i, h in enumerate(hiddens):
                    if h is not None:
                        h.parts.append(chunk[i] if counts is None else chunk[i, : counts[i]])
