"""Array specs: what a stored record may hold, shared by the layers (who state it) and the store (who checks it).

A spec maps an array name to (dtype name, shape). A shape entry is an int, or a
`range` where the size depends on history (a window ring's length); a record
array fits when its dtype name is equal and every dimension equals the int or
lies in the range.
"""

from __future__ import annotations

from typing import Mapping

import mlx.core as mx

Spec = Mapping[str, tuple[str, tuple]]  # array name -> (dtype name, shape of int | range)


def dtype_name(dtype: mx.Dtype) -> str:
    """"float32", "bfloat16", ...: the names the store's codec uses."""
    return str(dtype).rsplit(".", 1)[-1]


def spec_of(arrays: Mapping[str, mx.array]) -> dict[str, tuple[str, tuple]]:
    """The exact spec of some arrays."""
    return {name: (dtype_name(a.dtype), tuple(a.shape)) for name, a in arrays.items()}


def conforms(dtype: str, shape, want: tuple[str, tuple]) -> bool:
    """True if an array of `dtype` and `shape` fits the spec entry `want`."""
    want_dtype, want_shape = want
    shape = tuple(shape)
    if dtype != want_dtype or len(shape) != len(want_shape):
        return False
    return all(d == w if isinstance(w, int) else d in w for d, w in zip(shape, want_shape))


def describe(want: tuple[str, tuple]) -> str:
    """A spec entry as people read it: float32[1, 2, 1..263, 16]."""
    dims = [str(w) if isinstance(w, int) else f"{w.start}..{w.stop - 1}" for w in want[1]]
    return f"{want[0]}[{', '.join(dims)}]"
