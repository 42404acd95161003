"""An MTP drafter's hidden states of the forwards a prompt's prefill ran.

With an MTP drafter, the target's tap (mtp/tap.py) keeps the final hidden
state of every forward while collecting. A prompt fed on its runtime feeds the
runtime's head segment as it goes (mtp/state.py); one fed as a row of a padded
`PrefillBatch` ends on another runtime, so its share of the batch's states is
fed to a copy of the segment it resumed with (`carry_head`), which the new
runtime carries and publishes. Without a live segment the row's states go to
the decoder with the row (`HiddenStates`), and what they do not cover (a prefix
restored without the head's records) the drafter computes itself.

    forward 1 [B, c1, H]   forward 2 [B, c2, H] ...     row i of each, in order
              └─ row i ─┐            └─ row i ─┐
    Hidden.parts:   [c1, H]               [c2, H] ...    -> HiddenStates(concatenated)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..mtp.drafter import HiddenStates
from ..mtp.state import HeadSegment


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


def carry_head(before, after, hidden: Hidden, ids: list) -> None:
    """A prompt fed as a batch row ends on `after`: give it the head segment `before` resumed with,
    fed the row's collected states of the positions the batch computed (nothing if `before` has no
    live segment or they do not cover the rest: `after` then carries none, as before segments)."""
    seg = before.drafters.get(HeadSegment.name)
    if seg is None or seg.stale or not hidden.parts or after.offset != len(ids):
        return
    states = hidden.states(len(ids))
    start = seg.offset  # past the resume where the row was fed alone first (batch/prefill.py's lone row)
    if states is None or not start < len(ids) or start + states.hidden.shape[0] < len(ids):
        return
    carried = seg.clone()
    carried.extend(states.hidden[None, start - len(ids):], ids[start:])
    after.attach(carried)


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
