"""The quantized matmul and embedding lookup on the XLA path: dequantize inside the jit, then dot.

XLA compiles the dequantization (u8/i8 + f16 scales -> f32[K, N]) into one loop fusion feeding the
dot: a per-call temporary of one matrix, never a resident float copy of the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.quant.format import QuantizedWeight, dequantize, dequantize_rows, unpacked_int4

# A matrix of more than _CHUNKED_ABOVE weights (the LM head: 576 x 49152) is multiplied in column
# chunks of about _CHUNK_WEIGHTS, so the dequantized temporary is a few MB that stays in cache
# rather than a buffer the size of the head written and read back every step.
_CHUNK_WEIGHTS = 1 << 20
_CHUNKED_ABOVE = 4 << 20


def _num_column_chunks(k: int, n: int) -> int:
    if k * n <= _CHUNKED_ABOVE:
        return 1
    wanted = -(-k * n // _CHUNK_WEIGHTS)
    return next((c for c in range(wanted, n + 1) if n % c == 0), 1)


def quantized_matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """x: [..., K] @ the [K, N] weight -> [..., N] in x.dtype (XLA path; use under jax.jit).

    The weight must be a single matrix (no stacked leading dims: slice the layer first)."""
    k, n = qw.shape
    if qw.values.ndim != 2:
        raise ValueError(f"{qw.values.shape=} must be 2-D (slice stacked layers before the matmul)")
    if x.shape[-1] != k:
        raise ValueError(f"{x.shape=} must end in K={k}")
    num_chunks = _num_column_chunks(k, n)
    if num_chunks == 1:
        return _matmul(x, qw)
    width = n // num_chunks

    def chunk(c):  # columns c * width ... (c + 1) * width - 1
        cols = lambda a: None if a is None else jax.lax.dynamic_slice_in_dim(  # noqa: E731
            a, c * width, width, axis=-1)
        part = QuantizedWeight(cols(qw.values), cols(qw.scales), cols(qw.mins), qw.bits,
                               qw.group_size, (k, width))
        return _matmul(x, part)  # [..., width]

    y = jax.lax.map(chunk, jnp.arange(num_chunks))  # [C, ..., width]
    return jnp.moveaxis(y, 0, -2).reshape(*x.shape[:-1], n)


def _matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    k, _ = qw.shape
    dtype = x.dtype
    if qw.bits == 8 and qw.group_size >= k:  # per channel: scale after the dot
        return (x @ qw.values.astype(dtype)) * qw.scales[0].astype(dtype)
    if qw.bits == 8:
        return x @ dequantize_rows(qw, qw.values, 0, k, dtype)
    return x @ dequantize_rows(qw, unpacked_int4(qw.values, k), 0, k, dtype)


def quantized_embedding(qw: QuantizedWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows of the transposed weight: for a tied embedding stored as the LM head ([hidden, vocab]),
    ids: i32[T] -> dtype[T, hidden]. Gathers the columns, then dequantises only those."""
    if qw.values.ndim != 2:
        raise ValueError(f"{qw.values.shape=} must be 2-D")
    cols = QuantizedWeight(
        jnp.take(qw.values, ids, axis=-1), jnp.take(qw.scales, ids, axis=-1),
        None if qw.mins is None else jnp.take(qw.mins, ids, axis=-1),
        qw.bits, qw.group_size, (qw.shape[0], int(ids.shape[0])))
    return dequantize(cols, dtype).T

