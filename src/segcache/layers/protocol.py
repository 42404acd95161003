"""What every segment kind answers so the prefix cache can save and load it without knowing it.

A `Spec` names the arrays of a record and their dtype and shape; a shape entry is
an int, or a `range` where the size depends on history (a ring's length). The
prefix cache probes each layer once (a fresh runtime fed one token) and asks the
layer how that probe scales to `tokens` tokens, so every array read back is
checked against the runtime's own layout before it is decoded or loaded.

Two ways to resume:

* "pages": the state after r tokens is the concatenation of per-token rows
  (full-attention K/V), so any prefix of stored pages restores it;
* "checkpoint": the state is a summary (a window ring, a conv tail and an SSM
  state) that exists only where it was taken;
* "unstored": the store cannot hold this kind, so a runtime holding one
  refuses `prefill` / `publish` with a store (`Runtime.prefix_cache`). No
  kind needs it at present (quantized KV is a "pages" kind of its own layout).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import mlx.core as mx

from ..spec import Spec

PAGES, CHECKPOINT, UNSTORED = "pages", "checkpoint", "unstored"


class Persistent(Protocol):
    """The persistence half of a segment kind (the other half is mlx-lm's cache protocol)."""

    resumes_from: str  # PAGES, CHECKPOINT or UNSTORED

    def layout(self) -> list:
        """Kind and parameters that change the bytes (part of the store identity)."""

    def spec(self, probe: Spec, tokens: int) -> dict[str, tuple[str, tuple]]:
        """The spec of this layer's arrays for `tokens` tokens, given those exported after one."""

    def state_from(self, arrays: Mapping[str, Any], meta: Mapping[str, Any], tokens: int) -> tuple:
        """Validate stored arrays for `tokens` tokens; returns the arguments of `load`. Changes nothing.

        PAGES kinds get each name's row chunks in position order (a list of
        arrays, token axis 2); CHECKPOINT kinds get one array per name.

        Raises:
            ValueError: they do not fit this layer.
        """

    def load(self, *state) -> None:
        """Replace the layer's committed state (no branch may be open)."""

    # PAGES kinds
    def export_rows(self, start: int, end: int, *, share: bool = False) -> dict[str, mx.array]:
        """Own copies of the committed rows [start, end), token axis 2 (`share`: views of the
        layer's buffer instead, for a store that shares a hot runtime's buffer: store/sharing.py)."""

    # CHECKPOINT kinds
    def export_state(self) -> tuple[dict[str, mx.array], dict]:
        """The committed state as immutable arrays and plain meta."""
