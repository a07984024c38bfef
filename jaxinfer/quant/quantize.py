"""Quantizers: float weights -> `QuantizedWeight` (int8 symmetric; int4 min/max or searched)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.quant.format import (INT4_GROUP_SIZES, QuantizedWeight, check_weight, grouped,
                                   pack_int4, safe_inverse, ungrouped)
from jaxinfer.quant.search import quantize_int4_searched


def quantize_int8(w, group_size: int | None = None, scale_dtype=jnp.float32) -> QuantizedWeight:
    """Symmetric int8: per output channel (group_size None) or group-wise along K.

    w: f32[..., K, N]; w ~= q * scale, q in -127..127, |error| <= scale / 2.
    """
    k, n = check_weight(w)
    group_size = k if group_size is None else int(group_size)
    if group_size <= 0:
        raise ValueError(f"{group_size=} must be positive")
    return _quantize_int8(jnp.asarray(w, jnp.float32), group_size, jnp.dtype(scale_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_int8(w, group_size, scale_dtype):
    k, n = w.shape[-2:]
    g = grouped(w, group_size)  # [..., G, gs, N]
    absmax = jnp.nanmax(jnp.abs(g), axis=-2)  # [..., G, N]
    scales = (absmax / 127.0).astype(scale_dtype)
    inv = safe_inverse(scales.astype(jnp.float32))
    q = jnp.clip(jnp.round(g * inv[..., None, :]), -127, 127)
    q = jnp.nan_to_num(q).astype(jnp.int8)
    return QuantizedWeight(ungrouped(q, k), scales, None, 8, group_size, (k, n))



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
    k, n = check_weight(w)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{group_size=} must be one of {INT4_GROUP_SIZES}")
    w = jnp.asarray(w, jnp.float32)
    if not search:
        if importance is not None:
            raise ValueError("importance is used only with search=True")
        return _quantize_int4(w, group_size, bool(symmetric), jnp.dtype(scale_dtype))
    if importance is None:
        return quantize_int4_searched(w, None, group_size, bool(symmetric), jnp.dtype(scale_dtype))
    importance = jnp.asarray(importance, jnp.float32)
    if importance.shape[-1:] == (k,) and importance.ndim < w.ndim:  # per input row
        importance = importance[..., None]
    try:
        fits = jnp.broadcast_shapes(importance.shape, w.shape) == w.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{importance.shape=} must broadcast to {w.shape=} (or be [..., K])")
    return quantize_int4_searched(w, importance, group_size, bool(symmetric),
                                 jnp.dtype(scale_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_int4(w, group_size, symmetric, scale_dtype):
    k, n = w.shape[-2:]
    g = grouped(w, group_size)  # [..., G, gs, N]
    filled = jnp.nan_to_num(g, nan=0.0)
    if symmetric:
        idx = jnp.argmax(jnp.abs(filled), axis=-2, keepdims=True)
        extreme = jnp.take_along_axis(filled, idx, axis=-2)[..., 0, :]  # [..., G, N]
        scales = (extreme / -8.0).astype(scale_dtype)
        inv = safe_inverse(scales.astype(jnp.float32))
        q = jnp.clip(jnp.round(g * inv[..., None, :]) + 8, 0, 15)
        mins = None
    else:
        lo = jnp.nanmin(g, axis=-2)
        hi = jnp.nanmax(g, axis=-2)
        mins = lo.astype(scale_dtype)
        scales = ((hi - mins.astype(jnp.float32)) / 15.0).astype(scale_dtype)
        inv = safe_inverse(scales.astype(jnp.float32))
        q = jnp.clip(jnp.round((g - mins.astype(jnp.float32)[..., None, :]) * inv[..., None, :]), 0, 15)
    q = jnp.nan_to_num(q).astype(jnp.uint8)
    return QuantizedWeight(pack_int4(ungrouped(q, k)), scales, mins, 4, group_size, (k, n))



def quantize(w, method: str, group_size: int = 32, symmetric: bool = True) -> QuantizedWeight:
    """method: "int8" (per channel) | "int4" (group-wise, packed)."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, group_size, symmetric)
    raise ValueError(f"{method=} must be int8 or int4")

