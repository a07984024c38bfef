"""The step buffer's format: named 4-byte arrays packed into one int32 buffer, and back.

Numpy only (no JAX), so the host packs it and tests read it without a device; `unpack` works on
a `jax.Array` too, given a `bitcast`, so the jitted step slices the same format back.

Why one buffer: a step's inputs (a few dozen small arrays) then cross to the device in one copy.
Format: the arrays back to back, each flattened C-order and bit-cast to int32 (f32 and u32 keep
their bits); `PackedField(name, offset, shape, dtype)` gives each one's offset in int32 words. The
layout is a hashable tuple, a static jit argument: it changes exactly when a shape or the set of
arrays changes, i.e. once per executable.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import numpy as np


class PackedField(NamedTuple):
    name: str
    offset: int  # in int32 words
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: int32 | float32 | uint32


PackedLayout = tuple[PackedField, ...]  # hashable: pass it to jit as a static argument

_DTYPE_NAMES = {"i": "int32", "f": "float32", "I": "uint32"}  # by dtype.char (dtype.name is slow)


def pack(arrays: Iterable[tuple[str, np.ndarray]]) -> tuple[np.ndarray, PackedLayout]:
    """(name, array) pairs of int32 / float32 / uint32 arrays -> (i32[n] buffer, layout)."""
    parts, layout, offset = [], [], 0
    for name, array in arrays:
        a = np.ascontiguousarray(array)
        if a.dtype.char not in _DTYPE_NAMES:
            raise ValueError(f"{name}: {a.dtype=} must be int32, float32 or uint32")
        parts.append(a.reshape(-1).view(np.int32))
        layout.append(PackedField(name, offset, tuple(a.shape), _DTYPE_NAMES[a.dtype.char]))
        offset += a.size
    return np.concatenate(parts), tuple(layout)


def unpack(buf: Any, layout: PackedLayout, bitcast: Callable[[Any, str], Any]) -> dict[str, Any]:
    """Slices a packed buffer back into named arrays. `bitcast(x_i32, dtype_name)`: numpy
    `lambda x, d: x.view(d)`; jax `lambda x, d: jax.lax.bitcast_convert_type(x, jnp.dtype(d))`."""
    out = {}
    for f in layout:
        size = int(np.prod(f.shape, dtype=np.int64))
        x = buf[f.offset:f.offset + size].reshape(f.shape)
        out[f.name] = x if f.dtype == "int32" else bitcast(x, f.dtype)
    return out
