"""Weight-only quantization: int8 (per output channel or group-wise) and int4 group-wise (packed).

A weight is used as `x @ w` with `w: [K, N]` (K = in features, contracted; N = out features).
Groups run along K (the contraction axis), one scale per (group, output channel), like GGUF blocks.

Storage (`QuantizedWeight`; array leaves may carry leading stacked dims, e.g. `[L, ...]` for
layers under `lax.scan`):

- bits=8: `values` i8[..., K, N]; w = values * scale. Per channel when group_size == K (the
  scale is applied after the dot), group-wise otherwise (GGUF Q8_0 is group size 32).
- bits=4: `values` u8[..., Kh, N] with Kh = ceil(K / 2): the low nibble of row i holds row i and
  the high nibble holds row Kh + i (the two halves of K), so unpacking is a shift by an iota over
  [2, Kh, N] and a free reshape to [K, N]: one elementwise fusion, no concatenate (XLA CPU emits a
  concatenate inside a fusion element by element, 5-10x slower; and the Pallas kernel reads the
  two halves as two x column ranges). Nibbles are unsigned q in 0..15; symmetric:
  w = (q - 8) * scale (GGUF Q4_0), asymmetric: w = q * scale + min (GGUF Q4_1).
- `scales` (and `mins`) f16/f32[..., G, N], G = ceil(K / group_size); the last group may be
  partial (SmolLM2's K=576 is 4.5 groups of 128).

Matmul on XLA (`quantized_matmul`): dequantise inside the jitted function, then one dot. XLA
CPU (jax 0.10.2) compiles that to one loop fusion (u8/i8 + f16 scales -> f32[K, N]) and the dot:
a per-call temp of one matrix (3.5 MB for 576x1536), never a resident float copy of the model.
Measured on the 2-core CPU (benchmarks/quant.py --matmul): faster than f32 once the weights do
not sit in cache (30 stacked layers, batch 1: int8 and int4 ~2-3x faster than f32), slower for
one cache-resident matrix; a per-group batched dot (scales after the dot) was slower at batch 32
and no faster at batch 1, and jnp.int4 storage dequantised the same way was 2-4x slower. XLA GPU
fuses such converts into its GEMM fusions; not measured here (no GPU in this session).
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


def _check_weight(w) -> tuple[int, int]:
    if w.ndim < 2:
        raise ValueError(f"{w.shape=} must have at least 2 dims [..., K, N]")
    return int(w.shape[-2]), int(w.shape[-1])


def _grouped(w: jax.Array, group_size: int) -> jax.Array:
    """f32[..., K, N] -> f32[..., G, group_size, N]; the partial last group is padded with NaN."""
    k, n = w.shape[-2:]
    num_groups = math.ceil(k / group_size)
    pad = num_groups * group_size - k
    if pad:
        widths = [(0, 0)] * (w.ndim - 2) + [(0, pad), (0, 0)]
        w = jnp.pad(w, widths, constant_values=jnp.nan)
    return w.reshape(*w.shape[:-2], num_groups, group_size, n)


def _ungrouped(q: jax.Array, k: int) -> jax.Array:
    """[..., G, group_size, N] -> [..., K, N] (drops the padding of the last group)."""
    return q.reshape(*q.shape[:-3], -1, q.shape[-1])[..., :k, :]


def _safe_inverse(d: jax.Array) -> jax.Array:
    return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))


def quantize_int8(w, group_size: int | None = None, scale_dtype=jnp.float32) -> QuantizedWeight:
    """Symmetric int8: per output channel (group_size None) or group-wise along K.

    w: f32[..., K, N]; w ~= q * scale, q in -127..127, |error| <= scale / 2.
    """
    k, n = _check_weight(w)
    group_size = k if group_size is None else int(group_size)
    if group_size <= 0:
        raise ValueError(f"{group_size=} must be positive")
    return _quantize_int8(jnp.asarray(w, jnp.float32), group_size, jnp.dtype(scale_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_int8(w, group_size, scale_dtype):
    k, n = w.shape[-2:]
    g = _grouped(w, group_size)  # [..., G, gs, N]
    absmax = jnp.nanmax(jnp.abs(g), axis=-2)  # [..., G, N]
    scales = (absmax / 127.0).astype(scale_dtype)
    inv = _safe_inverse(scales.astype(jnp.float32))
    q = jnp.clip(jnp.round(g * inv[..., None, :]), -127, 127)
    q = jnp.nan_to_num(q).astype(jnp.int8)
    return QuantizedWeight(_ungrouped(q, k), scales, None, 8, group_size, (k, n))


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


def _unpacked_int4(values: jax.Array, k: int) -> jax.Array:
    """u8[..., Kh, N] -> nibbles u8[..., K, N]. For even K as one elementwise fusion (a shift by
    an iota over the two halves, then a free reshape): XLA CPU emits a concatenate inside a
    fusion element by element, 5-10x slower, so it is used only for odd K."""
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


def quantize_int4(w, group_size: int = 32, symmetric: bool = True, scale_dtype=jnp.float16,
                  *, search: bool = False, importance=None) -> QuantizedWeight:
    """Group-wise int4 along K, packed two per byte.

    Symmetric (Q4_0 style): scale = (the group's value of largest magnitude) / -8, so that value
    maps to q = 0 exactly; w ~= (q - 8) * scale, |error| <= |scale| (<= |scale|/2 except for a
    value of the opposite sign and the same magnitude, clipped to q = 15).
    Asymmetric (Q4_1 style): scale = (max - min) / 15, w ~= q * scale + min, |error| <= scale / 2
    (plus the rounding of scale and min to scale_dtype).

    search: instead of those min/max parameters, each group's (scale, min) minimises the
    squared error weighted by `importance` over a grid of candidate ranges, as llama.cpp's
    k-quants do (`search_int4_params`); the same storage, a lower error on average (a value
    outside the chosen range is clipped, so the bounds above no longer hold element-wise).
    importance: f32[..., K] (per input row, e.g. E[x_k^2] of the layer's inputs) or
    f32[..., K, N], the weights of the squared error; None: data-free defaults (uniform when
    asymmetric, `value_weights` when symmetric). Used only with search.
    """
    k, n = _check_weight(w)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{group_size=} must be one of {INT4_GROUP_SIZES}")
    w = jnp.asarray(w, jnp.float32)
    if not search:
        if importance is not None:
            raise ValueError("importance is used only with search=True")
        return _quantize_int4(w, group_size, bool(symmetric), jnp.dtype(scale_dtype))
    if importance is None:
        return _quantize_int4_search(w, None, group_size, bool(symmetric), jnp.dtype(scale_dtype))
    importance = jnp.asarray(importance, jnp.float32)
    if importance.shape[-1:] == (k,) and importance.ndim < w.ndim:  # per input row
        importance = importance[..., None]
    try:
        fits = jnp.broadcast_shapes(importance.shape, w.shape) == w.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{importance.shape=} must broadcast to {w.shape=} (or be [..., K])")
    return _quantize_int4_search(w, importance, group_size, bool(symmetric),
                                 jnp.dtype(scale_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_int4(w, group_size, symmetric, scale_dtype):
    k, n = w.shape[-2:]
    g = _grouped(w, group_size)  # [..., G, gs, N]
    filled = jnp.nan_to_num(g, nan=0.0)
    if symmetric:
        idx = jnp.argmax(jnp.abs(filled), axis=-2, keepdims=True)
        extreme = jnp.take_along_axis(filled, idx, axis=-2)[..., 0, :]  # [..., G, N]
        scales = (extreme / -8.0).astype(scale_dtype)
        inv = _safe_inverse(scales.astype(jnp.float32))
        q = jnp.clip(jnp.round(g * inv[..., None, :]) + 8, 0, 15)
        mins = None
    else:
        lo = jnp.nanmin(g, axis=-2)
        hi = jnp.nanmax(g, axis=-2)
        mins = lo.astype(scale_dtype)
        scales = ((hi - mins.astype(jnp.float32)) / 15.0).astype(scale_dtype)
        inv = _safe_inverse(scales.astype(jnp.float32))
        q = jnp.clip(jnp.round((g - mins.astype(jnp.float32)[..., None, :]) * inv[..., None, :]), 0, 15)
    q = jnp.nan_to_num(q).astype(jnp.uint8)
    return QuantizedWeight(pack_int4(_ungrouped(q, k)), scales, mins, 4, group_size, (k, n))


# ---------------------------------------------------------------------------------------------
# Error-minimising int4: the k-quant grid search and GPTQ
#
# Measured on SmolLM2-135M's tied embedding / LM head (576 x 49152, from the GGUF's Q8_0),
# perplexity with only the head quantized, int4-g32 asymmetric, float32 23.93:
#   min/max +7.2%;  search +6.2%;  search weighted by E[h_k^2] of the final hidden states +2.2%
#   (model-generated text) / +2.9% (random tokens);  GPTQ with the hidden states' covariance
#   and the weighted search for each group's parameters: +1.5% (generated text) / +1.7-2.2%
#   (random tokens: 1k-4k of them, short or long sequences, several seeds; equivalent runs
#   differ by ~0.5% from float rounding alone). Act-order GPTQ and calibrating on sequences
#   refined by parallel sampling did not help. Whole model, decoder Q4_1 as stored: +2.5%.
# The final hidden states have a few outlier dimensions (E[h_17^2] = 419 against a median of
# 0.86), so the head's error must be weighted by them; GPTQ also feeds each row's rounding error
# into the rows not yet quantized.

SEARCH_STEPS = 20  # candidate ranges per group: (15 - 1 + 0.1 s) / (max - min), s = 0..20


def _group_rows(a: jax.Array, group_size: int) -> jax.Array:
    """[..., K, N] -> [..., G, N, group_size] (NaN-padded partial last group): rows of one group
    contiguous, so the search's reductions run along the last axis."""
    return jnp.swapaxes(_grouped(a, group_size), -1, -2)


def search_int4_params(x: jax.Array, weight: jax.Array, symmetric: bool,
                       steps: int = SEARCH_STEPS) -> tuple[jax.Array, jax.Array | None]:
    """Per row of x: the int4 (scale, min) of lowest weighted squared error, llama.cpp-style.

    x: f32[M, gs] (NaN marks padding); weight: f32[M, gs] >= 0. Asymmetric (make_qkx2_quants):
    for each candidate inverse scale (15 - 1 + 0.1 s) / (max - min), s = 0..steps, round to
    q = clip(round((x - min) * iscale), 0, 15), then solve the weighted least squares for
    (scale, min) given q; keep the best candidate (the plain min/max parameters included), then
    re-round once with it and refit. Symmetric (make_qx_quants): candidates -(8 + 0.1 s) / extreme,
    s = -9..9, q = clip(round(x * iscale), -8, 7), scale = sum(w q x) / sum(w q^2); min is None.
    Returns f32 scale[M] (and min[M]); all reductions are sums along the last axis.
    """
    valid = ~jnp.isnan(x)
    wt = jnp.where(valid, weight, 0.0)
    x = jnp.where(valid, x, 0.0)
    sw = wt.sum(-1)
    sx = (wt * x).sum(-1)
    sx2 = (wt * x * x).sum(-1)

    if symmetric:
        mag = jnp.where(valid, jnp.abs(x), -1.0)
        extreme = jnp.take_along_axis(x, jnp.argmax(mag, -1, keepdims=True), -1)[..., 0]  # [M]
        safe = jnp.where(extreme == 0, 1.0, extreme)

        def codes(scale_inv):
            return jnp.clip(jnp.round(x * scale_inv[..., None]), -8, 7)

        def sums(q):
            return (wt * q * q).sum(-1), (wt * q * x).sum(-1)

        def fit(q):  # weighted least squares of x ~ scale * q
            sq2, sxq = sums(q)
            scale = jnp.where(sq2 > 0, sxq / jnp.where(sq2 > 0, sq2, 1.0), 0.0)
            return scale, sx2 - 2 * scale * sxq + scale * scale * sq2

        base = extreme / -8.0
        sq2, sxq = sums(codes(jnp.where(extreme == 0, 0.0, -8.0 / safe)))
        err0 = sx2 - 2 * base * sxq + base * base * sq2

        def candidate(s, carry):
            best_err, best_scale = carry
            scale, err = fit(codes(-(8.0 + 0.1 * (s - 9.0)) / safe))
            better = err < best_err
            return jnp.where(better, err, best_err), jnp.where(better, scale, best_scale)

        best_err, best_scale = jax.lax.fori_loop(
            0, 19, lambda s, c: candidate(s.astype(jnp.float32), c), (err0, base))
        scale, err = fit(codes(_safe_inverse(best_scale)))  # re-round with the best, refit
        return jnp.where(err < best_err, scale, best_scale), None

    lo = jnp.where(valid, x, jnp.inf).min(-1)
    hi = jnp.where(valid, x, -jnp.inf).max(-1)
    width = jnp.where(hi > lo, hi - lo, 1.0)

    def quantized(scale_inv, minimum):
        return jnp.clip(jnp.round((x - minimum[..., None]) * scale_inv[..., None]), 0, 15)

    def error(scale, minimum, q):
        sq, sq2, sxq = (wt * q).sum(-1), (wt * q * q).sum(-1), (wt * q * x).sum(-1)
        return (sx2 - 2 * scale * sxq - 2 * minimum * sx + scale * scale * sq2
                + 2 * scale * minimum * sq + minimum * minimum * sw), (sq, sq2, sxq)

    def fit(q):  # weighted least squares of x ~ scale * q + min
        _, (sq, sq2, sxq) = error(0.0, 0.0, q)
        det = sw * sq2 - sq * sq
        ok = det > 0
        det = jnp.where(ok, det, 1.0)
        scale = (sw * sxq - sx * sq) / det
        minimum = (sq2 * sx - sq * sxq) / det
        err = error(scale, minimum, q)[0]
        return scale, minimum, jnp.where(ok, err, jnp.inf)

    def keep_better(carry, scale, minimum, err):
        best_err, best_scale, best_min = carry
        better = err < best_err
        return (jnp.where(better, err, best_err), jnp.where(better, scale, best_scale),
                jnp.where(better, minimum, best_min))

    base_scale = (hi - lo) / 15.0
    base_inv = jnp.where(hi > lo, 15.0 / width, 0.0)
    carry = (error(base_scale, lo, quantized(base_inv, lo))[0], base_scale, lo)

    def candidate(s, carry):
        return keep_better(carry, *fit(quantized((15.0 - 1.0 + 0.1 * s) / width, lo)))

    carry = jax.lax.fori_loop(0, steps + 1, lambda s, c: candidate(s.astype(jnp.float32), c),
                              carry)
    _, scale, minimum = carry
    _, scale, minimum = keep_better(carry, *fit(quantized(_safe_inverse(scale), minimum)))
    return scale, minimum


def value_weights(x: jax.Array) -> jax.Array:
    """f32[M, gs] -> sqrt(sigma^2 + x^2), sigma^2 the row's mean square (NaN padding ignored):
    llama.cpp's per-value weighting of the error inside a group (quantize_row_q4_0_impl), which
    favours the large weights. The search's default for symmetric int4 when no activation
    statistics are given; asymmetric int4 uses the plain squared error. Measured on SmolLM2 with
    every Linear re-quantized from the GGUF's (dequantized Q4_1) weights, perplexity (float32
    23.93), min/max | search, uniform weights | search, these weights:
        g32 symmetric    28.70 | 28.80 | 27.79
        g64 asymmetric   34.25 | 30.31 | 30.20
        g128 asymmetric  46.08 | 35.56 | 37.36
    (symmetric: the plain error would rather clip a group's largest value than coarsen the
    step; with these weights it does not.) With activation statistics (the LM head's E[h_k^2])
    they made things worse (head-only +2.9% -> +3.7%), so they are not applied on top."""
    return jnp.sqrt(jnp.nanmean(x * x, axis=-1, keepdims=True) + x * x)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _quantize_int4_search(w, importance, group_size, symmetric, scale_dtype):
    k, n = w.shape[-2:]
    x = _group_rows(w, group_size)  # [..., G, N, gs]
    lead = x.shape[:-1]
    x = x.reshape(-1, group_size)
    if importance is None:  # see value_weights for the measurements behind this choice
        wt = value_weights(x) if symmetric else jnp.ones_like(x)
    else:
        wt = jnp.nan_to_num(_group_rows(jnp.broadcast_to(importance, w.shape), group_size))
        wt = wt.reshape(-1, group_size)
    scale, minimum = search_int4_params(x, wt, symmetric)
    scales = scale.reshape(lead).astype(scale_dtype)  # [..., G, N]
    mins = None if minimum is None else minimum.reshape(lead).astype(scale_dtype)
    return _int4_from_params(w, scales, mins, group_size)


def _int4_codes(g: jax.Array, scales: jax.Array, mins: jax.Array | None) -> jax.Array:
    """Grouped f32[..., G, gs, N] and (rounded) parameters [..., G, N] -> nibbles (NaN kept)."""
    inv = _safe_inverse(scales.astype(jnp.float32))[..., None, :]
    if mins is None:
        return jnp.clip(jnp.round(g * inv) + 8, 0, 15)
    return jnp.clip(jnp.round((g - mins.astype(jnp.float32)[..., None, :]) * inv), 0, 15)


def _int4_from_params(w, scales, mins, group_size) -> QuantizedWeight:
    """Round w to the nearest code under the given (stored-precision) parameters and pack."""
    k, n = w.shape[-2:]
    q = jnp.nan_to_num(_int4_codes(_grouped(w, group_size), scales, mins)).astype(jnp.uint8)
    return QuantizedWeight(pack_int4(_ungrouped(q, k)), scales, mins, 4, group_size, (k, n))


def gptq_int4(w, hessian, group_size: int = 32, symmetric: bool = False,
              scale_dtype=jnp.float16, *, damp: float = 0.01) -> QuantizedWeight:
    """GPTQ (Frantar et al., 2022) int4 of one [K, N] matrix, in the group-wise storage above.

    hessian: [K, K] = E[x x^T] over the layer's inputs x (what `x @ w` sees); damp * its mean
    diagonal is added. Rows of K are quantized in order; each row's rounding error, scaled by
    the inverse Hessian's Cholesky factor, is subtracted from the rows not yet quantized, so the
    output error E||x (W - Q)||^2 is what is minimised rather than the weights' own error. Each
    group's (scale, min) comes from `search_int4_params` on the group's updated rows, weighted
    by the Hessian's diagonal (E[x_k^2]). Host-side setup (the inverse and Cholesky factor, in
    float64, K x K), then one jitted scan over the groups.
    """
    k, n = _check_weight(w)
    if jnp.ndim(w) != 2:
        raise ValueError(f"{jnp.shape(w)=} must be 2-D [K, N]")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{group_size=} must be one of {INT4_GROUP_SIZES}")
    h = np.array(hessian, np.float64)
    if h.shape != (k, k):
        raise ValueError(f"{h.shape=} must be ({k}, {k})")
    mean_diag = float(np.mean(np.diag(h)))
    h += damp * (mean_diag if mean_diag > 0 else 1.0) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper, U^T U = H^-1
    num_groups = math.ceil(k / group_size)
    padded = num_groups * group_size
    u_pad = np.eye(padded)
    u_pad[:k, :k] = u
    diag = np.ones(padded)
    diag[:k] = np.diag(h)
    w = jnp.asarray(w, jnp.float32)
    if padded != k:  # NaN rows: ignored by the search, no error fed forward
        w = jnp.pad(w, ((0, padded - k), (0, 0)), constant_values=jnp.nan)
    codes, scales, mins = _gptq_int4(w, jnp.asarray(u_pad, jnp.float32),
                                     jnp.asarray(diag, jnp.float32), group_size, bool(symmetric),
                                     jnp.dtype(scale_dtype))
    return QuantizedWeight(pack_int4(codes[:k]), scales, mins, 4, group_size, (k, n))


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _gptq_int4(w, u, diag, group_size, symmetric, scale_dtype):
    # w: f32[Kp, N] (NaN padding rows); u: f32[Kp, Kp] upper Cholesky of H^-1; diag: f32[Kp]
    padded, n = w.shape
    gs = group_size
    in_group = jnp.arange(gs)

    def one_group(wk, g):
        start = g * gs
        block = jax.lax.dynamic_slice_in_dim(wk, start, gs, 0)  # f32[gs, N], updated rows
        u_rows = jax.lax.dynamic_slice_in_dim(u, start, gs, 0)  # f32[gs, Kp]
        u_block = jax.lax.dynamic_slice_in_dim(u_rows, start, gs, 1)  # f32[gs, gs]
        importance = jax.lax.dynamic_slice_in_dim(diag, start, gs, 0)  # f32[gs]
        scale, minimum = search_int4_params(block.T, jnp.broadcast_to(importance, (n, gs)),
                                            symmetric)
        scale = scale.astype(scale_dtype)  # [N], as stored
        minimum = jnp.zeros_like(scale) if minimum is None else minimum.astype(scale_dtype)
        scale32, min32 = scale.astype(jnp.float32), minimum.astype(jnp.float32)
        inv = _safe_inverse(scale32)

        def one_row(i, carry):
            block, codes, errors = carry
            row = block[i]  # f32[N]
            if symmetric:
                q = jnp.clip(jnp.round(row * inv) + 8, 0, 15)
                deq = (q - 8) * scale32
            else:
                q = jnp.clip(jnp.round((row - min32) * inv), 0, 15)
                deq = q * scale32 + min32
            err = jnp.where(jnp.isnan(row), 0.0, (row - deq) / u_block[i, i])  # f32[N]
            block = block - jnp.where((in_group > i)[:, None], u_block[i][:, None] * err, 0.0)
            return block, codes.at[i].set(q), errors.at[i].set(err)

        zeros = jnp.zeros((gs, n), jnp.float32)
        _, codes, errors = jax.lax.fori_loop(0, gs, one_row, (block, zeros, zeros))
        later = (jnp.arange(padded) >= start + gs)[None, :]  # rows after this group
        wk = wk - jnp.dot(jnp.where(later, u_rows, 0.0).T, errors,
                          precision=jax.lax.Precision.HIGHEST)
        return wk, (jnp.nan_to_num(codes).astype(jnp.uint8), scale, minimum)

    _, (codes, scales, mins) = jax.lax.scan(one_group, w, jnp.arange(padded // gs))
    return codes.reshape(padded, n), scales, None if symmetric else mins


def _row_params(a: jax.Array, group_size: int, start: int, stop: int, dtype) -> jax.Array:
    """Per-group [..., G, N] -> per-row [..., stop - start, N] for rows start..stop-1 of K."""
    *lead, num_groups, n = a.shape
    rows = jnp.broadcast_to(a.astype(dtype)[..., None, :], (*lead, num_groups, group_size, n))
    return rows.reshape(*lead, num_groups * group_size, n)[..., start:stop, :]  # fuses (no gather)


def _dequantize_rows(qw: QuantizedWeight, q: jax.Array, start: int, stop: int, dtype) -> jax.Array:
    """Integer rows start..stop-1 of K ([..., stop-start, N]) -> float rows of the weight."""
    gs = qw.group_size
    scale = _row_params(qw.scales, gs, start, stop, dtype)
    if qw.bits == 8:
        return q.astype(dtype) * scale
    if qw.mins is None:
        return (q.astype(jnp.int8) - 8).astype(dtype) * scale
    return q.astype(dtype) * scale + _row_params(qw.mins, gs, start, stop, dtype)


def dequantize(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """QuantizedWeight -> dtype[..., K, N]. In float32 this equals gguf.quants.dequantize
    bit-exactly for weights imported from Q8_0 / Q4_0 / Q4_1."""
    return _dequantize(qw, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(qw: QuantizedWeight, dtype) -> jax.Array:
    k, _ = qw.shape
    q = qw.values if qw.bits == 8 else _unpacked_int4(qw.values, k)
    return _dequantize_rows(qw, q, 0, k, dtype)


# A matrix larger than _CHUNKED_ABOVE weights (the LM head: 576 x 49152) is multiplied in column
# chunks of about _CHUNK_WEIGHTS, so the dequantised temp is a few MB that stays in cache rather
# than a 113 MB buffer written and read back every step (measured on XLA CPU: 116 ms -> 7 ms for
# the SmolLM2 head at batch 1).
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
        return x @ _dequantize_rows(qw, qw.values, 0, k, dtype)
    return x @ _dequantize_rows(qw, _unpacked_int4(qw.values, k), 0, k, dtype)


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


def quantize(w, method: str, group_size: int = 32, symmetric: bool = True) -> QuantizedWeight:
    """method: "int8" (per channel) | "int4" (group-wise, packed)."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, group_size, symmetric)
    raise ValueError(f"{method=} must be int8 or int4")


# ---------------------------------------------------------------------------------------------
# GGUF import: Q8_0 / Q4_0 / Q4_1 blocks -> QuantizedWeight, integer ops only (no float round trip)

GGUF_QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
_GGUF_BLOCK = 32


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Raw GGUF bytes of a 2-D tensor -> the `[K, N]` (transposed) QuantizedWeight.

    data: u8[N, K / 32 * bytes_per_block] as `gguf.GGUFReader` gives it (rows = output channels);
    type_name: "Q8_0" | "Q4_0" | "Q4_1"; shape: (N, K), the numpy shape of the float tensor
    (GGUF's `tensor.shape` reversed). Scales and minimums keep their f16 storage.
    """
    if type_name not in GGUF_QUANT_TYPES:
        raise ValueError(f"{type_name=} must be one of {GGUF_QUANT_TYPES}")
    n, k = (int(s) for s in shape)
    if k % _GGUF_BLOCK:
        raise ValueError(f"{shape=}: K must be a multiple of {_GGUF_BLOCK}")
    num_groups = k // _GGUF_BLOCK
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, num_groups, -1)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]  # f16[N, G]
    if type_name == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)  # i8[N, K]
        return QuantizedWeight(jnp.asarray(q.T), jnp.asarray(scales.T), None, 8, _GGUF_BLOCK, (k, n))
    mins = None
    qs = blocks[..., 2:]
    if type_name == "Q4_1":
        mins = jnp.asarray(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].T)
        qs = blocks[..., 4:]
    # a GGUF block holds elements j (low nibble) and j + 16 (high nibble) in byte j
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)  # u8[N, K] nibbles
    values = pack_int4(jnp.asarray(q.T))
    return QuantizedWeight(values, jnp.asarray(scales.T), mins, 4, _GGUF_BLOCK, (k, n))


def from_gguf_tensor(tensor) -> QuantizedWeight:
    """A `gguf.GGUFReader` tensor (ReaderTensor) of type Q8_0 / Q4_0 / Q4_1 -> QuantizedWeight."""
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    if len(shape) != 2:
        raise ValueError(f"{tensor.name}: {shape=} must be 2-D")
    return from_gguf(tensor.data, tensor.tensor_type.name, shape)


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


# ---------------------------------------------------------------------------------------------
# Quantizing a model: every layers.Linear of the decoder (and optionally the LM head)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """method: int8 (per output channel) | int4 (group-wise along K, packed).

    int4 re-quantization is asymmetric (Q4_1 style: scale and minimum per group) unless
    symmetric=True (Q4_0 style); with search (the default) each group's parameters are chosen by
    the error-minimising grid search of llama.cpp's k-quants instead of the group's min/max.
    GGUF tensors are kept as stored when their type is the requested kind (Q8_0 for int8; Q4_0 /
    Q4_1 for int4 with group 32).

    The LM head (for tied models: the shared embedding table) is quantized only when
    quantize_lm_head, as lm_head_method (None: the same as method). An int4 head is re-quantized
    with GPTQ (lm_head_gptq) against the covariance of the final hidden states of the
    (already quantized) model over `calibration_num_tokens` random token ids: the hidden states
    have a few outlier dimensions that plain rounding ignores. On SmolLM2-135M (Q4_1 body as
    stored, head from the GGUF's Q8_0): head int4 min/max +7.5% perplexity, GPTQ about +2%;
    an int8 head costs nothing measurable but 0.18x instead of 0.16x of the float32 bytes.
    """

    method: str
    group_size: int = 32
    symmetric: bool = False
    quantize_lm_head: bool = False
    lm_head_method: str | None = None
    search: bool = True
    lm_head_gptq: bool = True
    calibration_num_tokens: int = 1024
    calibration_seed: int = 0
    matmul_backend: str = "auto"  # QuantizedLinear / QuantizedEmbed: see ops.quantized_matmul

    def __post_init__(self):
        if self.method not in ("int8", "int4"):
            raise ValueError(f"method={self.method!r} must be int8 or int4")
        if self.lm_head_method not in (None, "int8", "int4"):
            raise ValueError(f"lm_head_method={self.lm_head_method!r} must be None, int8 or int4")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size} must be one of {INT4_GROUP_SIZES}")
        if self.calibration_num_tokens < 1:
            raise ValueError(f"calibration_num_tokens={self.calibration_num_tokens} must be >= 1")
        from jaxinfer.ops import BACKENDS

        if self.matmul_backend not in BACKENDS:
            raise ValueError(f"matmul_backend={self.matmul_backend!r} must be one of {BACKENDS}")

    @classmethod
    def from_engine_config(cls, ec) -> "QuantConfig | None":
        """The engine's quantization fields; the quantized matmul follows attention_backend
        (pallas kernels on the GPU, XLA elsewhere, unless forced)."""
        if ec.quantization is None:
            return None
        return cls(ec.quantization, group_size=ec.quant_group_size,
                   quantize_lm_head=ec.quantize_lm_head, matmul_backend=ec.attention_backend)

    @property
    def head_method(self) -> str:
        return self.lm_head_method or self.method

    def quantize(self, w) -> QuantizedWeight:
        if self.method == "int8":
            return quantize_int8(w)
        return quantize_int4(w, self.group_size, self.symmetric, search=self.search)

    def accepts_gguf(self, type_name: str) -> bool:
        """A GGUF tensor type loaded as it is (no float round trip) under this config."""
        if type_name == "Q8_0":
            return self.method == "int8"  # int8, group-wise (32) rather than per channel
        return type_name in ("Q4_0", "Q4_1") and self.method == "int4" and self.group_size == 32


# Decoder Linear (path under model.layers) -> the HF tensors fused along its output axis
# (mirrors models/weights.py, which builds the float params the same way).
_LAYER_LINEAR_SOURCES = {
    ("self_attn", "qkv_proj"): ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                "self_attn.v_proj.weight"),
    ("self_attn", "o_proj"): ("self_attn.o_proj.weight",),
    ("mlp", "gate_up_proj"): ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp", "down_proj"): ("mlp.down_proj.weight",),
}


def _gguf_weight(tensors, name: str, qconfig: QuantConfig) -> QuantizedWeight | None:
    """One GGUF tensor as a [K, N] QuantizedWeight, or None when it must go through float."""
    raw = tensors.raw(name)
    if raw is None or not qconfig.accepts_gguf(raw.type_name):
        return None
    qw = from_gguf(raw.data, raw.type_name, raw.shape)
    return qw if raw.row_perm is None else permute_output_channels(qw, raw.row_perm)


def _gguf_linear(tensors, names_per_layer: list[tuple[str, ...]], qconfig) -> QuantizedWeight | None:
    layers = []
    for names in names_per_layer:
        parts = [_gguf_weight(tensors, n, qconfig) for n in names]
        if any(p is None for p in parts):
            return None
        try:
            layers.append(parts[0] if len(parts) == 1 else concat_output_channels(parts))
        except ValueError:  # mixed types inside one fused projection
            return None
    if len(layers) == 1:
        return layers[0]
    try:
        return stack(layers)
    except ValueError:  # mixed types across layers
        return None


def quantize_model(model, qconfig: QuantConfig, gguf_tensors=None, *,
                   calibration_token_ids=None):
    """Replace the model's float Linear (and, if asked, the LM head / tied embedding) by quantized
    ones, in place; returns the model. Float weights are quantized on the device; with
    `gguf_tensors` (models.gguf_file.GGUFTensors) Q8_0 / Q4_0 / Q4_1 tensors that fit `qconfig`
    are taken as they are stored (bit-exact with the file), the rest are re-quantized.

    The head goes last: an int4 head re-quantized with GPTQ needs the final hidden states of the
    model whose decoder is already quantized, over `calibration_token_ids` (i32[n]; default
    `qconfig.calibration_num_tokens` random ids drawn with `qconfig.calibration_seed`)."""
    from flax import nnx

    from jaxinfer.models.layers import Embed, Linear, QuantizedEmbed, QuantizedLinear

    num_layers = model.config.num_layers
    head_config = dataclasses.replace(qconfig, method=qconfig.head_method)
    backend = qconfig.matmul_backend
    head = None  # (parent, name, module) of the head to quantize after the decoder
    for path, module in list(nnx.iter_modules(model)):
        if not path:
            continue
        parent = model
        for key in path[:-1]:
            parent = getattr(parent, key)
        is_head = path == ("lm_head",)
        tied_table = (type(module) is Embed and path == ("embed_tokens",)
                      and model.lm_head is None)
        if (is_head and type(module) is Linear) or tied_table:
            head = (parent, path[-1], module)
        elif type(module) is Linear:
            qw = None
            if gguf_tensors is not None and path[0] == "layers" and path[1:] in _LAYER_LINEAR_SOURCES:
                names = [tuple(f"model.layers.{i}.{n}" for n in _LAYER_LINEAR_SOURCES[path[1:]])
                         for i in range(num_layers)]
                qw = _gguf_linear(gguf_tensors, names, qconfig)
            if qw is None:
                qw = qconfig.quantize(module.weight[...])
            setattr(parent, path[-1], QuantizedLinear(qw, module.bias, dtype=module.dtype,
                                                      backend=backend))
    if head is None or not qconfig.quantize_lm_head:
        return model
    parent, name, module = head
    tied = type(module) is Embed
    qw = None
    if gguf_tensors is not None:
        gguf_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        qw = _gguf_linear(gguf_tensors, [(gguf_name,)], head_config)
    if qw is None:
        w = module.embedding[...].T if tied else module.weight[...]  # [hidden, vocab]
        if head_config.method == "int4" and qconfig.lm_head_gptq:
            if calibration_token_ids is None:
                calibration_token_ids = calibration_tokens(
                    model.config, qconfig.calibration_num_tokens, qconfig.calibration_seed)
            hessian = final_hidden_hessian(model, calibration_token_ids)
            qw = gptq_int4(w, hessian, qconfig.group_size, qconfig.symmetric)
        else:
            qw = head_config.quantize(w)
    if tied:
        setattr(parent, name, QuantizedEmbed(qw, dtype=module.dtype, backend=backend))
    else:
        setattr(parent, name, QuantizedLinear(qw, module.bias, dtype=module.dtype,
                                              backend=backend))
    return model


def calibration_tokens(model_config, num_tokens: int, seed: int = 0) -> np.ndarray:
    """i32[num_seqs, seq_len]: num_tokens uniformly random token ids (rounded up to whole
    sequences), in sequences as long as the model's context allows. Random ids need no tokenizer
    or data set; for the LM head's GPTQ they gave almost what model-generated text gives
    (SmolLM2-135M: head-only perplexity +1.9-2.2% over several random draws against +1.5% with
    2k tokens of the model's own sampled text)."""
    seq_len = max(1, min(int(num_tokens), model_config.max_position_embeddings))
    num_seqs = -(-int(num_tokens) // seq_len)
    rng = np.random.default_rng(seed)
    return rng.integers(0, model_config.vocab_size, (num_seqs, seq_len)).astype(np.int32)


def final_hidden_hessian(model, token_ids, *, chunk: int = 512, page_size: int = 16) -> np.ndarray:
    """f64[hidden, hidden]: E[h h^T] over the final-normed hidden states h (the LM head's
    inputs) of token_ids (i32[n]: one sequence; i32[num_seqs, n]: each row one sequence), run
    through the model in prefill chunks over a paged KV cache (XLA attention)."""
    from flax import nnx

    from jaxinfer.runtime.kv_cache import AttentionMetadata, allocate_kv_cache

    token_ids = np.asarray(token_ids, np.int32)
    if token_ids.ndim == 1:
        token_ids = token_ids[None]
    num_seqs, n = token_ids.shape
    if n < 1 or n > model.config.max_position_embeddings:
        raise ValueError(f"{token_ids.shape=}: sequences must hold 1.."
                         f"{model.config.max_position_embeddings} tokens")
    chunk = min(chunk, -(-n // page_size) * page_size)
    graphdef, state = nnx.split(model)
    num_pages = -(-n // page_size) + 1
    pages = np.arange(1, num_pages, dtype=np.int32)  # page 0 is the null page
    cache = allocate_kv_cache(model.config, num_pages, page_size, model.dtype)

    @jax.jit
    def chunk_hessian(state, cache, ids, pos, md, valid):
        hidden, cache = nnx.merge(graphdef, state)(ids, pos, cache, md, attention_backend="xla")
        h = jnp.where(valid[:, None], hidden.astype(jnp.float32), 0.0)  # f32[chunk, hidden]
        return jnp.dot(h.T, h, precision=jax.lax.Precision.HIGHEST), cache

    total = 0.0
    for seq in token_ids:  # each sequence overwrites the pages of the one before
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            q = stop - start
            ids = np.zeros(chunk, np.int32)
            ids[:q] = seq[start:stop]
            pos = np.zeros(chunk, np.int32)
            pos[:q] = np.arange(start, stop)
            slots = np.arange(chunk, dtype=np.int32) % page_size  # padding -> the null page
            slots[:q] = pages[pos[:q] // page_size] * page_size + pos[:q] % page_size
            md = AttentionMetadata(
                slot_mapping=jnp.asarray(slots), cu_q_lens=jnp.asarray([0, q], jnp.int32),
                kv_lens=jnp.asarray([stop], jnp.int32), page_indices=jnp.asarray(pages[None, :]),
                num_seqs=jnp.asarray([1], jnp.int32))
            part, cache = chunk_hessian(state, cache, jnp.asarray(ids), jnp.asarray(pos), md,
                                        jnp.arange(chunk) < q)
            total = total + np.asarray(part, np.float64)
    return total / token_ids.size
