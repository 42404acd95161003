"""mlx-lm's KV cache quantization (`kv_bits`, `kv_group_size`, `quantized_kv_start`) as a Runtime setting.

mlx-lm's `generate_step` calls `maybe_quantize_kv_cache` after every model call
(each prefill chunk, each decode step, each speculative step): every cache that
has a `to_quantized` and holds `quantized_kv_start` tokens or more is replaced
by its quantized form, whose later rows are quantized as they are written.
Rows computed before that moment saw full-precision attention, rows after it
quantized attention, so *where* the switch happens changes the numbers.

A Runtime with a `KVQuantization` makes the same switch at the same moments:
after every `forward` outside a branch and at the commit that closes the
outermost branch (a switch inside a branch would turn rows that may still be
rolled back into committed quantized rows). Plain generation therefore feeds
mlx-lm's chunks and switches where mlx-lm's `generate_step` does: greedy text is
identical. Speculative rounds switch at the first commit at or past the start
rather than at the exact token.

Only full-attention KV layers switch (mlx-lm's `KVCache`); recurrent layers have
nothing to quantize (mlx-lm skips `ArraysCache` too), and a sliding-window layer
has no quantized form (mlx-lm's `RotatingKVCache.to_quantized` raises), so a
Runtime refuses the setting on a model that has one. Which kind does what is
each layer kind's own hook (`kv_switches`, `kv_refused`, `kv_form`:
layers/compat.py), so the switch (`KVSwitch`, a part of `Runtime`) tests no types.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BranchError

# mlx_lm.generate.DEFAULT_QUANTIZED_KV_START (mlx_lm.server's too)
DEFAULT_START = 5000
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class KVQuantization:
    """When and how a Runtime quantizes its full-attention KV layers.

    Attributes:
        bits: bits per quantized element (mlx-lm's `kv_bits`).
        group_size: elements sharing one scale and bias (`kv_group_size`).
        start: layers switch once they hold this many tokens (`quantized_kv_start`).

    Raises:
        ValueError: MLX cannot quantize with these bits and group size, or start < 0.
    """

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE
    start: int = DEFAULT_START

    def __post_init__(self) -> None:
        for name in ("bits", "group_size", "start"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"kv quantization: {name} must be an int, got {value!r}")
        if self.start < 0:
            raise ValueError(f"quantized_kv_start must be >= 0, got {self.start}")
        import mlx.core as mx

        try:  # ask MLX itself which (bits, group size) it quantizes with
            mx.quantize(mx.zeros((1, self.group_size)), group_size=self.group_size, bits=self.bits)
        except ValueError as exc:
            raise ValueError(
                f"kv_bits={self.bits} with kv_group_size={self.group_size}: MLX cannot quantize with these "
                f"({exc}); e.g. kv_bits 4 or 8 with kv_group_size 32, 64 or 128"
            ) from None

    @classmethod
    def of(cls, kv_bits, kv_group_size=DEFAULT_GROUP_SIZE, quantized_kv_start=DEFAULT_START):
        """The setting for mlx-lm's three arguments; None when `kv_bits` is None (no quantization)."""
        if kv_bits is None:
            return None
        return cls(kv_bits, kv_group_size, quantized_kv_start)

    def describe(self) -> str:
        return f"kv_bits={self.bits}, kv_group_size={self.group_size}, quantized_kv_start={self.start}"


class KVSwitch:
    """The kv_bits switch of a `Runtime` (a base class of it; see the module docstring).

    It works on the host's layers: `cache` (the layer caches, swapped here), `_layers`
    (the ones it owns), `_branches`, `_own_layers(verb)` and `kv_quantization`.
    """

    def quantize_kv(self, setting: KVQuantization) -> None:
        """Quantize full-attention layers from now on as mlx-lm's `kv_bits` does (see `segcache.kvquant`).

        As in mlx-lm, a layer switches after a forward (outside a branch; else at
        the commit closing the outermost branch) that leaves it holding
        `setting.start` tokens or more; so even at start 0 the first forward runs
        at full precision. Setting the same value again changes nothing.

        Raises:
            ValueError: another setting is in force, or a layer is a sliding window
                (it has no quantized form); nothing changed.
        """
        self.check_quantize_kv(setting)
        self.kv_quantization = setting

    def check_quantize_kv(self, setting: KVQuantization) -> None:
        """Raise what `quantize_kv(setting)` would raise, changing nothing."""
        if not isinstance(setting, KVQuantization):
            raise ValueError(f"quantize_kv() takes a segcache.kvquant.KVQuantization, got {setting!r}")
        if self.kv_quantization is not None and setting != self.kv_quantization:
            raise ValueError(
                f"this runtime quantizes KV with {self.kv_quantization.describe()} already; "
                f"build a new Runtime for {setting.describe()}"
            )
        self._own_layers("quantize_kv")
        refused = [i for i, layer in enumerate(self.cache) if layer.kv_refused]
        if refused:
            raise ValueError(
                f"kv_bits on a model whose layers {refused[:4]} are sliding windows "
                f"({type(self.cache[refused[0]]).__name__}): a window has no quantized form (mlx-lm's "
                "RotatingKVCache.to_quantized raises too); run this model without kv_bits"
            )

    def _quantize_due(self) -> None:
        """Swap every full-attention layer holding `start` tokens or more for its quantized form."""
        q = self.kv_quantization
        due = [i for i, layer in enumerate(self.cache) if layer.kv_switches and layer.offset >= q.start]
        if due:
            self.quantize_layers({i: (q.group_size, q.bits) for i in due})

    def quantize_layers(self, forms: dict) -> None:
        """Swap layer i (a `kv_switches` kind) for its quantized form `forms[i]` = (group_size, bits); all or nothing.

        The quantized layers are made first (MLX checks the shapes then: a group
        size that does not divide the head dimension raises), then swapped.

        Raises:
            ValueError: MLX cannot quantize a layer so; nothing changed.
        """
        try:
            made = {i: self.cache[i].to_quantized(group_size=g, bits=b) for i, (g, b) in forms.items()}
        except ValueError as exc:
            for i in forms:
                self.cache[i].replaced_by = None
            raise ValueError(f"cannot quantize the KV cache with group size / bits {sorted(set(forms.values()))}: {exc}") from None
        for i, layer in made.items():
            self.cache[i] = layer
        self._layers = tuple(self.cache)

    def quantized_forms(self) -> dict:
        """{layer index: (group_size, bits)} of the layers holding quantized K/V."""
        return {i: form for i, layer in enumerate(self.cache) if (form := layer.kv_form()) is not None}

    def quantize_like(self, other: "Runtime") -> None:
        """Quantize the layers `other` holds quantized, as `other` holds them (no branch may be open).

        The prefix store probes a fresh runtime of the same layout with this.

        Raises:
            BranchError: a branch is open; nothing changed.
            ValueError: the layouts differ; nothing changed.
        """
        if self._branches:
            raise BranchError("quantize_like() with an open branch: commit or roll it back first")
        self._own_layers("quantize_like")
        forms = {i: f for i, f in other.quantized_forms().items() if self.cache[i].kv_switches}
        if forms:
            self.quantize_layers(forms)

    def quantize_now(self) -> list:
        """Swap every `kv_switches` layer for its quantized form in force now (an empty runtime:
        empty quantized layers, e.g. to look a prompt up under the quantized layout); returns
        the layers it had, for `put_back`. No branch may be open."""
        own, q = list(self.cache), self.kv_quantization
        self.quantize_layers({i: (q.group_size, q.bits) for i, layer in enumerate(own) if layer.kv_switches})
        return own

    def put_back(self, layers: list) -> None:
        """Make `layers` (this runtime's own, of the same tokens, e.g. from `quantize_now`) its layers again."""
        for layer in layers:
            layer.replaced_by = None
        self.cache[:] = layers
        self._layers = tuple(layers)
