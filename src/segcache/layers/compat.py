"""The parts of mlx-lm's cache protocol that models never call, answered by every segment kind.

mlx-lm's helpers reach past `update_and_fetch`:

* `save_prompt_cache` writes `type(c).__name__` and `c.state`; `load_prompt_cache`
  looks the name up in `mlx_lm.models.cache`'s globals and calls `from_state`.
  Each layer's `state` is its *committed* state with everything `from_state`
  needs (an open branch is never saved, as it is never published), and
  `from_state` runs `__init__` (mlx-lm's default skips it, losing the marks).
  `register_names` makes the loader find the classes (see its docstring).
* `trim_prompt_cache` calls `trim(n)` on every layer. A layer refuses a trim
  that reaches below its innermost branch (`BranchError`, before any change;
  every layer has the same marks, so the first layer refuses for all), and
  notes how far down a trim went (`take_trim`), so the runtime's token ledger
  forgets those ids even if direct calls refill the positions before it looks.
* `generate_step(kv_bits=...)` swaps entries for what `to_quantized` returns:
  a `KVLayer` gives a `QuantizedKVLayer` (layers/quantized.py), which branches
  as a `KVLayer` does and which the runtime adopts at its next operation; it
  refuses inside a branch (`BranchError`, nothing swapped). A window refuses
  (mlx-lm's `RotatingKVCache` cannot be quantized either). The prefix store
  keeps quantized rows as pages of their own layout (layers/quantized.py).
* `BatchGenerator` calls `merge` on the first cache's class, then `extract`,
  `filter`, `extend`, `prepare` / `finalize` on what it returned. `KVLayer.merge`
  gives a `BatchKVLayer` (per-row lengths, no left padding), `RecurrentLayer.merge`
  a `BatchRecurrentLayer` (the layer's conv tail, per-row token counts),
  `StateLayer.merge` a `BatchStateLayer` (slots stacked, per-row token counts),
  `CompositeLayer.merge` a `BatchCompositeLayer` of its children merged; their
  `extract(i)` gives the single-sequence kind back. Layers with an open branch
  refuse (`BranchError`). `QuantizedKVLayer` has no batched form and refuses
  `merge` (`UnsupportedOperationError`), as do rows a batch cannot stack (a
  window that dropped tokens, an n-gram context still growing). A single
  layer's own `extract` / `filter` / `extend` / `prepare` refuse (it holds one
  sequence; merge first).
"""

from __future__ import annotations

import warnings

from mlx_lm.models import cache as mlx_cache

from ..errors import InvariantError, UnsupportedOperationError

BATCHING = (
    "this kind has no batched form: batch mlx-lm's own caches (make_prompt_cache(model)), "
    "or Gated DeltaNet / attention models with segcache.BatchRuntime (join(row_id, runtime) adds a Runtime as a row)"
)
ONE_SEQUENCE = "a layer holds one sequence: merge layers first (type(layer).merge([...])), then call it on the merged layer"


class MlxCompat:
    """Mixin for segment kinds: trim bookkeeping and the refusals above."""

    # The lowest offset a trim left since the runtime last looked (None: no trim
    # since). Positions from there on may have been refilled by direct calls.
    _trimmed_to: int | None = None
    # The layer `to_quantized` made of this one (mlx-lm's kv_bits puts it in this
    # layer's place in `rt.cache`; the runtime adopts exactly that object).
    replaced_by = None
    # How mlx-lm's kv_bits treats the kind (Runtime.quantize_kv): a hook per kind, so the
    # runtime tests no types. `kv_switches`: the kind becomes `to_quantized`'s layer once it
    # holds `quantized_kv_start` tokens (full attention); `kv_refused`: kv_bits cannot run on
    # a model with this kind (a window has no quantized form); neither: kv_bits leaves it be.
    kv_switches = False
    kv_refused = False
    # The kind verifies trees of drafts (layers/tree.py: tree_begin, tree_end, take_path);
    # a model with a layer of a kind that does not verifies chains only.
    takes_trees = False

    def captures(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens keeps this layer's state at positions inside it
        (`cuts`, `export_cut`: a prefill's boundary checkpoints taken from one forward, prefill.py).
        No kind does but Gated DeltaNet's chunked forward (layers/recurrent.py)."""
        return False

    def kv_form(self) -> tuple[int, int] | None:
        """(group_size, bits) of the quantized K/V this layer holds; None if it holds none."""
        return None

    def _note_trim(self) -> None:
        low = self._trimmed_to
        self._trimmed_to = self.offset if low is None else min(low, self.offset)

    def take_trim(self) -> int | None:
        """The lowest offset a trim left since the last call (None if none), and forget it."""
        low, self._trimmed_to = self._trimmed_to, None
        return low

    def peek_trim(self) -> int | None:
        """What `take_trim` would return, changing nothing."""
        return self._trimmed_to

    def _checked(self):
        """This freshly loaded layer, or ValueError if the file held an inconsistent state."""
        try:
            self.check()
        except InvariantError as exc:
            raise ValueError(f"load_prompt_cache: {exc}") from None
        return self

    @classmethod
    def merge(cls, caches):
        raise UnsupportedOperationError(f"{cls.__name__}.merge() (mlx-lm's BatchGenerator): {BATCHING}")


class BatchingRefused:
    """Mixin for ArraysCache kinds: mlx-lm's per-row batching calls on a single layer raise
    (it holds one sequence; the batched kind `merge` makes answers them)."""

    def extract(self, idx):
        raise UnsupportedOperationError(f"{type(self).__name__}.extract({idx}): {ONE_SEQUENCE}")

    def filter(self, batch_indices):
        raise UnsupportedOperationError(f"{type(self).__name__}.filter(): {ONE_SEQUENCE}")

    def extend(self, other):
        raise UnsupportedOperationError(f"{type(self).__name__}.extend(): {ONE_SEQUENCE}")

    def prepare(self, lengths=None, **kwargs):
        raise UnsupportedOperationError(f"{type(self).__name__}.prepare(lengths=...): {ONE_SEQUENCE}")


class QuantizeRefused:
    """Mixin for window kinds: `to_quantized` raises instead of handing mlx-lm a replacement
    (mlx-lm's `RotatingKVCache.to_quantized` raises NotImplementedError too)."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise UnsupportedOperationError(
            f"{type(self).__name__}.to_quantized(bits={bits}) (mlx-lm's kv_bits / maybe_quantize_kv_cache): "
            "a sliding-window ring has no quantized kind (mlx-lm's RotatingKVCache has none either); "
            "this layer was kept as it is (full-attention layers before it in the list were quantized). "
            "Run without kv_bits on a model with sliding windows"
        )


def register_names(*classes: type) -> None:
    """Make `mlx_lm.models.cache.load_prompt_cache` find segcache's layer classes.

    mlx-lm's loader resolves the saved class name with `globals()[name]` in
    its own module and offers no registry, so the only way for its loader to
    find a class is a name in that module. This adds each class under its own
    name (KVLayer, WindowLayer, RecurrentLayer), which mlx-lm does not define:
    nothing of mlx-lm's is replaced or wrapped. Importing any segcache layer
    (hence `segcache.Runtime`) does it; a name mlx-lm already uses for
    something else is left alone, with a warning.
    """
    for cls in classes:
        present = vars(mlx_cache).get(cls.__name__)
        if present is None:
            setattr(mlx_cache, cls.__name__, cls)
        elif present is not cls:
            warnings.warn(
                f"mlx_lm.models.cache defines {cls.__name__} already; load_prompt_cache will not "
                f"find segcache's {cls.__name__}",
                RuntimeWarning,
                stacklevel=2,
            )
