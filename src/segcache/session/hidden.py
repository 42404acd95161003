"""A drafter's tapped states of the forwards a prompt's prefill ran (the MTP head's, DFlash's).

A drafter that keeps a segment one position behind its target (one_behind.py:
the MTP head's, mtp/state.py; the DFlash drafter's context, dflash/segment.py)
reads the target's tap (mtp/tap.py: the final hidden state; dflash/tap.py: the
tapped layers' outputs), which keeps every forward's states while collecting.
A prompt fed on its runtime feeds the runtime's segment as it goes; one fed as
a row of a padded `PrefillBatch` ends on another runtime, so its share of the
batch's states is fed to a copy of the segment it resumed with (`carry_segment`),
which the new runtime carries and publishes: one mechanism for both drafters.
With MTP and no live segment the row's states go to the decoder with the row
(`HiddenStates`), and what they do not cover (a prefix restored without the
head's records) the drafter computes itself; DFlash recomputes its context then.

    forward 1 [B, c1, H]   forward 2 [B, c2, H] ...     row i of each, in order
              └─ row i ─┐            └─ row i ─┐
    Hidden.parts:   [c1, H]               [c2, H] ...    -> HiddenStates(concatenated)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..mtp.drafter import HiddenStates

# The decoder's modes whose drafter keeps a segment on the target's runtime, fed from a tap, and
# that segment's name in `Runtime.drafters` (prompt lookup beside DFlash keeps DFlash's).
SEGMENT_OF = {"mtp": "mtp", "dflash": "dflash", "lookup+dflash": "dflash"}
SEGMENT_MODES = tuple(SEGMENT_OF)


class Hidden:
    """One prompt's tapped states, collected while its forwards run (nothing without a drafter
    segment: see SEGMENT_MODES).

    Invariant: `parts` are [n_k, ...] arrays of consecutive positions ending at the
    last position the prefill fed (a suffix of the prompt's positions).
    """

    def __init__(self, decoder):
        segmented = decoder.mode in SEGMENT_MODES
        self.tap = decoder.drafter.tap if segmented else None
        self.segment = SEGMENT_OF[decoder.mode] if segmented else None  # the drafter segment's name
        self.hands_states = decoder.mode == "mtp"  # an MTP row joins with them (`HiddenStates`)
        self.parts: list = []

    def rows(self, held: int) -> mx.array | None:
        """The states [N, ...] of the last N positions of the `held` tokens a runtime holds, or
        None when there are none (no drafter segment, nothing fed) or more than those (not this row's)."""
        if not self.parts:
            return None
        rows = mx.concatenate(self.parts, axis=0)
        return rows if rows.shape[0] <= held else None

    def states(self, held: int) -> HiddenStates | None:
        """The MTP row's `HiddenStates` of `rows(held)` (None as it)."""
        rows = self.rows(held)
        return None if rows is None else HiddenStates(rows)


def carry_segment(before, after, hidden: Hidden, ids: list) -> None:
    """A prompt fed as a batch row ends on `after` holding `ids`: give it the drafter segment
    `before` resumed with (the MTP head's, DFlash's context), fed the row's collected states of the
    positions the batch computed (nothing if `before` has no live segment or they do not cover the
    rest: `after` then carries none, as before segments, and the drafter recomputes at join)."""
    seg = before.drafters.get(hidden.segment) if hidden.segment is not None else None
    if seg is None or seg.stale or not hidden.parts or after.offset != len(ids):
        return
    rows = hidden.rows(len(ids))
    start = seg.offset  # past the resume where the row was fed alone first (batch/prefill.py's lone row)
    if rows is None or not start < len(ids) or start + rows.shape[0] < len(ids):
        return
    carried = seg.clone()
    carried.extend(rows[None, start - len(ids):], ids[start:])
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
