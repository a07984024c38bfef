"""The storage format of quantized weights: `QuantizedWeight`, int4 packing, dequantization.

A weight is used as `x @ w` with `w: [K, N]` (K = in features, contracted; N = out features).
Groups run along K (the contraction axis), one scale per (group, output channel), like GGUF blocks.
Array leaves may carry leading stacked dims, e.g. `[L, ...]` for layers under `lax.scan`.

- bits=8: `values` i8[..., K, N]; w = values * scale. Per channel when group_size == K (the
  scale is applied after the dot), group-wise otherwise (GGUF Q8_0 is group size 32).
- bits=4: `values` u8[..., Kh, N] with Kh = ceil(K / 2): the low nibble of row i holds row i and
  the high nibble holds row Kh + i (the two halves of K), so unpacking is a shift by an iota over
  [2, Kh, N] and a free reshape to [K, N]: one elementwise fusion, no concatenate (XLA CPU emits a
  concatenate inside a fusion element by element), and the Pallas kernel reads the two halves as
  two column ranges of x. Nibbles are unsigned q in 0..15; symmetric: w = (q - 8) * scale
  (GGUF Q4_0), asymmetric: w = q * scale + min (GGUF Q4_1).
- `scales` (and `mins`) f16/f32[..., G, N], G = ceil(K / group_size); the last group may be
  partial (SmolLM2's K=576 is 4.5 groups of 128).
- The three arrays' rows may be longer than N (`padded`): columns past N are padding, there so
  that a kernel walking a block of columns down the rows does not find them all in the same
  cache sets (the CPU backend's stride, `ops.cpu_code_stride`). `shape` always says N.

This module imports no model code: quantizers (`quantize.py`, `search.py`), the GGUF import
(`gguf.py`) and the XLA matmul (`xla.py`) build on it, and so do the model's quantized layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

INT4_GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized `[K, N]` weight (a pytree: values/scales/mins are leaves, the rest static)."""

    values: jax.Array  # i8[..., K, N] (bits=8) | u8[..., ceil(K/2), N] (bits=4, halves packed)
    scales: jax.Array  # f16|f32[..., G, N], G = ceil(K / group_size)
    mins: jax.Array | None  # like scales (asymmetric int4), None when symmetric
    bits: int
    group_size: int  # == K for per-channel int8
    shape: tuple[int, int]  # logical (K, N) of the trailing two dims

    @property
    def num_groups(self) -> int:
        return math.ceil(self.shape[0] / self.group_size)

    @property
    def symmetric(self) -> bool:
        return self.mins is None

    @property
    def stride(self) -> int:
        """The arrays' row length in columns: N, or more where the rows are padded."""
        return int(self.values.shape[-1])

    def padded(self, stride: int) -> "QuantizedWeight":
        """The same weight with its rows `stride` columns long (zeros past N; `stride` >= N)."""
        n = self.shape[1]
        if stride < n:
            raise ValueError(f"{stride=} must be at least N={n}")
        return QuantizedWeight(*(None if a is None else _pad_columns(a[..., :n], stride)
                                 for a in (self.values, self.scales, self.mins)),
                               self.bits, self.group_size, self.shape)

    def unpadded(self) -> "QuantizedWeight":
        """The same weight with rows of exactly N columns (itself where they are)."""
        n = self.shape[1]
        if self.stride == n:
            return self
        return QuantizedWeight(*(None if a is None else a[..., :n]
                                 for a in (self.values, self.scales, self.mins)),
                               self.bits, self.group_size, self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.values, self.scales, self.mins) if a is not None)

    def __repr__(self):
        kind = "sym" if self.symmetric else "asym"
        lead = tuple(self.values.shape[:-2])
        return (f"QuantizedWeight(int{self.bits} {kind} g{self.group_size}, "
                f"shape={lead + self.shape}, scales={self.scales.dtype})")


jax.tree_util.register_dataclass(
    QuantizedWeight,
    data_fields=["values", "scales", "mins"],
    meta_fields=["bits", "group_size", "shape"],
)


def check_weight(w) -> tuple[int, int]:
    if w.ndim < 2:
        raise ValueError(f"{w.shape=} must have at least 2 dims [..., K, N]")
    return int(w.shape[-2]), int(w.shape[-1])


def _pad_columns(a: jax.Array, stride: int) -> jax.Array:
    """[..., R, N] -> [..., R, stride], zeros in the new columns."""
    widths = [(0, 0)] * (a.ndim - 1) + [(0, stride - a.shape[-1])]
    return jnp.pad(a, widths) if stride > a.shape[-1] else a


def grouped(w: jax.Array, group_size: int) -> jax.Array:
    """f32[..., K, N] -> f32[..., G, group_size, N]; the partial last group is padded with NaN."""
    k, n = w.shape[-2:]
    num_groups = math.ceil(k / group_size)
    pad = num_groups * group_size - k
    if pad:
        widths = [(0, 0)] * (w.ndim - 2) + [(0, pad), (0, 0)]
        w = jnp.pad(w, widths, constant_values=jnp.nan)
    return w.reshape(*w.shape[:-2], num_groups, group_size, n)


def ungrouped(q: jax.Array, k: int) -> jax.Array:
    """[..., G, group_size, N] -> [..., K, N] (drops the padding of the last group)."""
    return q.reshape(*q.shape[:-3], -1, q.shape[-1])[..., :k, :]


def safe_inverse(d: jax.Array) -> jax.Array:
    return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))



def pack_int4(q: jax.Array) -> jax.Array:
    """u8[..., K, N] nibbles (0..15) -> u8[..., ceil(K/2), N]: row i low, row Kh + i high."""
    k = q.shape[-2]
    kh = (k + 1) // 2
    q = q.astype(jnp.uint8)
    lo, hi = q[..., :kh, :], q[..., kh:, :]
    if hi.shape[-2] < kh:  # odd K: the last high nibble is padding
        widths = [(0, 0)] * (q.ndim - 2) + [(0, kh - hi.shape[-2]), (0, 0)]
        hi = jnp.pad(hi, widths)
    return lo | (hi << 4)


def unpacked_int4(values: jax.Array, k: int) -> jax.Array:
    """u8[..., Kh, N] -> nibbles u8[..., K, N]. For even K as one elementwise fusion (a shift by
    an iota over the two halves, then a free reshape): XLA CPU emits a concatenate inside a
    fusion element by element (docs/quantization.md), so it is used only for odd K."""
    kh, n = values.shape[-2:]
    if k % 2:
        lo, hi = unpack_int4(values, k)
        return jnp.concatenate([lo, hi], axis=-2)
    half = jax.lax.broadcasted_iota(jnp.uint8, (2, kh, n), 0)
    q = (values[..., None, :, :] >> (half * 4)) & 15  # u8[..., 2, Kh, N]
    return q.reshape(*values.shape[:-2], k, n)


def unpack_int4(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """u8[..., Kh, N] -> (lo u8[..., Kh, N] = rows 0..Kh-1, hi u8[..., K - Kh, N] = rows Kh..K-1)."""
    kh = values.shape[-2]
    return values & 15, (values >> 4)[..., : k - kh, :]



def int4_codes(g: jax.Array, scales: jax.Array, mins: jax.Array | None) -> jax.Array:
    """Grouped f32[..., G, gs, N] and (rounded) parameters [..., G, N] -> nibbles (NaN kept)."""
    inv = safe_inverse(scales.astype(jnp.float32))[..., None, :]
    if mins is None:
        return jnp.clip(jnp.round(g * inv) + 8, 0, 15)
    return jnp.clip(jnp.round((g - mins.astype(jnp.float32)[..., None, :]) * inv), 0, 15)


def int4_from_params(w, scales, mins, group_size) -> QuantizedWeight:
    """Round w to the nearest code under the given (stored-precision) parameters and pack."""
    k, n = w.shape[-2:]
    q = jnp.nan_to_num(int4_codes(grouped(w, group_size), scales, mins)).astype(jnp.uint8)
    return QuantizedWeight(pack_int4(ungrouped(q, k)), scales, mins, 4, group_size, (k, n))



def row_params(a: jax.Array, group_size: int, start: int, stop: int, dtype) -> jax.Array:
    """Per-group [..., G, N] -> per-row [..., stop - start, N] for rows start..stop-1 of K."""
    *lead, num_groups, n = a.shape
    rows = jnp.broadcast_to(a.astype(dtype)[..., None, :], (*lead, num_groups, group_size, n))
    return rows.reshape(*lead, num_groups * group_size, n)[..., start:stop, :]  # fuses (no gather)


def dequantize_rows(qw: QuantizedWeight, q: jax.Array, start: int, stop: int, dtype) -> jax.Array:
    """Integer rows start..stop-1 of K ([..., stop-start, N]) -> float rows of the weight."""
    gs = qw.group_size
    scale = row_params(qw.scales, gs, start, stop, dtype)
    if qw.bits == 8:
        return q.astype(dtype) * scale
    if qw.mins is None:
        return (q.astype(jnp.int8) - 8).astype(dtype) * scale
    return q.astype(dtype) * scale + row_params(qw.mins, gs, start, stop, dtype)


def dequantize(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """QuantizedWeight -> dtype[..., K, N]. In float32 this equals gguf.quants.dequantize
    bit-exactly for weights imported from Q8_0 / Q4_0 / Q4_1."""
    return _dequantize(qw, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(qw: QuantizedWeight, dtype) -> jax.Array:
    k, _ = qw.shape
    q = qw.values if qw.bits == 8 else unpacked_int4(qw.values, k)
    return dequantize_rows(qw, q, 0, k, dtype)


# A matrix larger than _CHUNKED_ABOVE weights (the LM head: 576 x 49152) is multiplied in column
# chunks of about _CHUNK_WEIGHTS, so the dequantised temp is a few MB that stays in cache rather


def permute_output_channels(qw: QuantizedWeight, perm) -> QuantizedWeight:
    """Reorder the N (output) axis: per-channel quantization commutes with a row permutation of
    the [N, K] matrix (e.g. undoing llama.cpp's Q/K head permutation)."""
    perm = np.asarray(perm)
    if sorted(perm.tolist()) != list(range(qw.shape[1])):
        raise ValueError(f"perm must be a permutation of range({qw.shape[1]})")
    take = lambda a: None if a is None else jnp.take(a, perm, axis=-1)  # noqa: E731
    return dataclasses.replace(qw, values=take(qw.values), scales=take(qw.scales), mins=take(qw.mins))


def stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Per-layer weights -> one QuantizedWeight with a leading [L] axis (for lax.scan)."""
    first = weights[0]
    for w in weights[1:]:
        if (w.bits, w.group_size, w.shape, w.mins is None) != (
                first.bits, first.group_size, first.shape, first.mins is None):
            raise ValueError(f"cannot stack {w!r} with {first!r}")
    return jax.tree.map(lambda *a: jnp.stack(a), *weights)



def concat_output_channels(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Fuse projections along N (e.g. q, k, v -> qkv); all must share bits/group_size/symmetry."""
    first = weights[0]
    for w in weights[1:]:
        if (w.bits, w.group_size, w.shape[0], w.mins is None) != (
                first.bits, first.group_size, first.shape[0], first.mins is None):
            raise ValueError(f"cannot fuse {w!r} with {first!r}")
    cat = lambda *a: None if a[0] is None else jnp.concatenate(a, axis=-1)  # noqa: E731
    return QuantizedWeight(
        cat(*[w.values for w in weights]), cat(*[w.scales for w in weights]),
        cat(*[w.mins for w in weights]), first.bits, first.group_size,
        (first.shape[0], sum(w.shape[1] for w in weights)))

