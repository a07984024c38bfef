"""Weight-only quantized matmul: x @ dequantize(w), dequantising in registers, one group at a time.

Weight layout (the same as `jaxinfer.quant.QuantizedWeight`, passed here as plain arrays so the
kernels package does not depend on jaxinfer):
- bits=8: values i8[K, N]; w = values * scale; one scale row per group of `group_size` rows of K
  (group_size == K: per output channel).
- bits=4: values u8[K/2, N]; the low nibble of row i is row i of w, the high nibble row K/2 + i.
  Symmetric (mins None): w = (q - 8) * scale; asymmetric: w = q * scale + min.
- scales, mins: [G, N], G = K / group_size.

Portable Pallas subset (pallas_call, BlockSpec, ref slicing, lax.fori_loop): a grid over
(row tiles, column tiles); each program keeps its x rows [block_m, K] and weight columns
[K or K/2, block_n] and loops over groups, accumulating in f32. Runs with interpret=True on the
CPU (tests). On the GPU it lowers through Triton (its CompilerParams are the default: the Mosaic
GPU lowering stages whole blocks with async copies of at most 256 elements a dimension, which
these [block_m, K] blocks exceed); `benchmarks/triton_ttir.py` compiles it for sm_90 without a GPU,
and `benchmarks/gpu_check.sh` runs it on one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def _dequant_rows(q, scale, minimum, bits, symmetric, dtype):
    """q: [rows, bn] integer tile; scale/minimum: [1, bn] -> dtype[rows, bn]."""
    scale = scale.astype(jnp.float32)
    if bits == 8:
        w = q.astype(jnp.float32) * scale
    elif symmetric:
        w = (q.astype(jnp.int32) - 8).astype(jnp.float32) * scale
    else:
        w = q.astype(jnp.float32) * scale + minimum.astype(jnp.float32)
    return w.astype(dtype)


def _kernel(*refs, bits, group_size, symmetric, per_channel):
    if symmetric:
        x_ref, v_ref, s_ref, o_ref = refs
        m_ref = None
    else:
        x_ref, v_ref, s_ref, m_ref, o_ref = refs
    block_m, block_n = o_ref.shape
    k = x_ref.shape[1]
    dtype = x_ref.dtype
    gs = group_size

    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    def scale_row(g):
        return s_ref[pl.ds(g, 1), :]

    def min_row(g):
        return None if m_ref is None else m_ref[pl.ds(g, 1), :]

    if per_channel:  # int8, one scale per column, applied once after the loop
        def body(i, acc):
            q = v_ref[pl.ds(i * gs, gs), :].astype(dtype)
            return acc + dot(x_ref[:, pl.ds(i * gs, gs)], q)
        acc = lax.fori_loop(0, k // gs, body, jnp.zeros((block_m, block_n), jnp.float32))
        o_ref[...] = (acc * s_ref[0:1, :].astype(jnp.float32)).astype(o_ref.dtype)
        return

    if bits == 8:
        def body(g, acc):
            w = _dequant_rows(v_ref[pl.ds(g * gs, gs), :], scale_row(g), None, 8, True, dtype)
            return acc + dot(x_ref[:, pl.ds(g * gs, gs)], w)
        num_steps = k // gs
    else:
        half = k // 2
        half_groups = half // gs

        def body(g, acc):
            packed = v_ref[pl.ds(g * gs, gs), :]  # u8[gs, bn]
            w_lo = _dequant_rows(packed & 15, scale_row(g), min_row(g), 4, symmetric, dtype)
            g_hi = half_groups + g
            w_hi = _dequant_rows(packed >> 4, scale_row(g_hi), min_row(g_hi), 4, symmetric, dtype)
            acc = acc + dot(x_ref[:, pl.ds(g * gs, gs)], w_lo)
            return acc + dot(x_ref[:, pl.ds(half + g * gs, gs)], w_hi)
        num_steps = half_groups
    acc = lax.fori_loop(0, num_steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _validate(x, values, scales, mins, bits, group_size):
    if x.ndim != 2:
        raise ValueError(f"{x.shape=} must be [M, K]")
    m, k = x.shape
    if bits not in (4, 8):
        raise ValueError(f"{bits=} must be 4 or 8")
    rows = k if bits == 8 else (k + 1) // 2
    if values.ndim != 2 or values.shape[0] != rows:
        raise ValueError(f"{values.shape=} must be [{rows}, N] for {bits=} and K={k}")
    n = values.shape[1]
    num_groups = -(-k // group_size)
    if scales.shape != (num_groups, n):
        raise ValueError(f"{scales.shape=} must be ({num_groups}, {n})")
    if mins is not None and mins.shape != scales.shape:
        raise ValueError(f"{mins.shape=} must equal {scales.shape=}")
    if mins is not None and bits == 8:
        raise ValueError("int8 weights are symmetric: mins must be None")
    return m, k, n


def quant_matmul(
    x: jax.Array,  # [M, K] f32 | bf16
    values: jax.Array,  # i8[K, N] | u8[K/2, N]
    scales: jax.Array,  # [G, N]
    mins: jax.Array | None = None,  # [G, N] | None
    *,
    bits: int,
    group_size: int,
    block_m: int | None = None,
    block_n: int = 64,
    interpret: bool | None = None,
    compiler_params=None,  # default: Triton's, num_warps=4, num_stages=2
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [M, N] in x.dtype
    m, k, n = _validate(x, values, scales, mins, bits, group_size)
    per_channel = bits == 8 and group_size >= k
    step = 32 if per_channel else group_size  # rows of K per loop step
    if per_channel and k % step:
        raise NotImplementedError(f"per-channel int8 needs K % 32 == 0, got K={k}")
    if not per_channel and k % group_size:
        raise NotImplementedError(f"K={k} must be a multiple of {group_size=} (no partial group)")
    if bits == 4 and (k % 2 or (k // 2) % group_size):
        raise NotImplementedError(f"int4 needs (K/2) % group_size == 0, got K={k}, {group_size=}")
    block_n = min(block_n, n)
    if n % block_n:
        raise NotImplementedError(f"N={n} must be a multiple of {block_n=}")
    if block_m is None:
        block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    padded_m = -(-m // block_m) * block_m
    if padded_m != m:
        x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    symmetric = mins is None
    kernel = functools.partial(_kernel, bits=bits, group_size=step, symmetric=symmetric,
                               per_channel=per_channel)
    num_groups = scales.shape[0]
    in_specs = [
        pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
        pl.BlockSpec((values.shape[0], block_n), lambda i, j: (0, j)),
        pl.BlockSpec((num_groups, block_n), lambda i, j: (0, j)),
    ]
    args = [x, values, scales]
    if not symmetric:
        in_specs.append(pl.BlockSpec((num_groups, block_n), lambda i, j: (0, j)))
        args.append(mins)
    if compiler_params is None and not interpret:
        from jax.experimental.pallas import triton as pl_triton

        compiler_params = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    extra = {} if compiler_params is None else {"compiler_params": compiler_params}
    out = pl.pallas_call(
        kernel,
        grid=(padded_m // block_m, n // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded_m, n), x.dtype),
        interpret=interpret,
        **extra,
    )(*args)
    return out[:m]


def dequantize_reference(values, scales, mins, *, bits: int, group_size: int, k: int) -> jax.Array:
    """Plain jnp: the f32[K, N] weight."""
    if bits == 8:
        q = values.astype(jnp.float32)
    else:
        q = jnp.concatenate([values & 15, values >> 4], axis=0)[:k].astype(jnp.float32)
        if mins is None:
            q = q - 8
    rep = lambda a: jnp.repeat(a.astype(jnp.float32), group_size, axis=0)[:k]  # noqa: E731
    w = q * rep(scales)
    return w if mins is None else w + rep(mins)


def quant_matmul_reference(x, values, scales, mins=None, *, bits: int, group_size: int) -> jax.Array:
    """Plain jnp: x @ dequantize(w), f32 accumulation, result in x.dtype."""
    k = x.shape[1]
    w = dequantize_reference(values, scales, mins, bits=bits, group_size=group_size, k=k)
    y = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)
