"""Error-minimising int4: llama.cpp's k-quant grid search of each group's (scale, min), and GPTQ.

Plain min/max rounding wastes range on outliers; the search picks each group's parameters by the
weighted squared error they cause, and GPTQ (for the LM head) weights the error by the layer's
input statistics and feeds each row's rounding error forward. Why these choices, with
measurements: docs/quantization.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.format import (INT4_GROUP_SIZES, QuantizedWeight, check_weight, grouped,
                                   int4_from_params, pack_int4, safe_inverse)


SEARCH_STEPS = 20  # candidate ranges per group: (15 - 1 + 0.1 s) / (max - min), s = 0..20


def group_rows(a: jax.Array, group_size: int) -> jax.Array:
    """[..., K, N] -> [..., G, N, group_size] (NaN-padded partial last group): rows of one group
    contiguous, so the search's reductions run along the last axis."""
    return jnp.swapaxes(grouped(a, group_size), -1, -2)


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
        scale, err = fit(codes(safe_inverse(best_scale)))  # re-round with the best, refit
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
    _, scale, minimum = keep_better(carry, *fit(quantized(safe_inverse(scale), minimum)))
    return scale, minimum


def value_weights(x: jax.Array) -> jax.Array:
    """f32[M, gs] -> sqrt(sigma^2 + x^2), sigma^2 the row's mean square (NaN padding ignored):
    llama.cpp's per-value weighting of the error inside a group (quantize_row_q4_0_impl), which
    favours the large weights. The search's default for symmetric int4 when no activation
    statistics are given; asymmetric int4 uses the plain squared error (docs/quantization.md)."""
    return jnp.sqrt(jnp.nanmean(x * x, axis=-1, keepdims=True) + x * x)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def quantize_int4_searched(w, importance, group_size, symmetric, scale_dtype):
    k, n = w.shape[-2:]
    x = group_rows(w, group_size)  # [..., G, N, gs]
    lead = x.shape[:-1]
    x = x.reshape(-1, group_size)
    if importance is None:  # see value_weights for the measurements behind this choice
        wt = value_weights(x) if symmetric else jnp.ones_like(x)
    else:
        wt = jnp.nan_to_num(group_rows(jnp.broadcast_to(importance, w.shape), group_size))
        wt = wt.reshape(-1, group_size)
    scale, minimum = search_int4_params(x, wt, symmetric)
    scales = scale.reshape(lead).astype(scale_dtype)  # [..., G, N]
    mins = None if minimum is None else minimum.reshape(lead).astype(scale_dtype)
    return int4_from_params(w, scales, mins, group_size)



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
    k, n = check_weight(w)
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
        inv = safe_inverse(scale32)

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

