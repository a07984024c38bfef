"""x @ W for an int8 / int4 quantized weight on the CPU: the C++ kernel (quant_matmul.cc).

The same contract as `pallas_kernels.quant_matmul` (plain arrays in the layout of
`jaxinfer.quant.QuantizedWeight`; its `quant_matmul_reference` is the reference for both). The
kernel reads the packed weight once and never writes a float copy of it, which is what a decode
step (a few rows of x, memory-bound) needs; for many rows a dense matmul after dequantizing is
faster, and `jaxinfer.ops` picks by the number of rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build

COLUMN_MULTIPLE = 32  # the kernel's register block of output columns


def available() -> bool:
    """Whether the kernel is built and registered (compiling it on first call)."""
    return build.load("quant_matmul", "JaxinferQuantMatmul") is not None


def dense_faster_above_rows() -> int | None:
    """Rows of x above which a dense f32 matmul beats the kernel on this CPU; None when it never
    does (the kernel's AVX-512 paths, which -march=native enables where the CPU has them)."""
    flags = build.cpu_flags().split()
    return None if "avx512f" in flags and "avx512bw" in flags else 16


def _validate(x, values, scales, mins, bits, group_size) -> None:
    if bits not in (4, 8):
        raise ValueError(f"{bits=} must be 4 or 8")
    if x.ndim != 2 or values.ndim != 2:
        raise ValueError(f"{x.shape=} must be [M, K] and {values.shape=} 2-D")
    k, n = x.shape[1], values.shape[1]
    rows = k if bits == 8 else (k + 1) // 2
    if values.shape[0] != rows:
        raise ValueError(f"{values.shape=} does not fit K={k} at {bits} bits")
    if values.dtype != (jnp.int8 if bits == 8 else jnp.uint8):
        raise ValueError(f"{values.dtype=} must be int8 (8 bits) or uint8 (4 bits)")
    num_groups = -(-k // group_size)
    if scales.shape != (num_groups, n) or scales.dtype not in (jnp.float16, jnp.float32):
        raise ValueError(f"{scales.shape=} {scales.dtype=} must be f16/f32[{num_groups}, {n}]")
    if mins is not None and (mins.shape != scales.shape or mins.dtype != scales.dtype):
        raise ValueError(f"{mins.shape=} {mins.dtype=} must match the scales")


def quant_matmul(
    x: jax.Array,  # [M, K] f32 | bf16
    values: jax.Array,  # i8[K, N] | u8[K/2, N]
    scales: jax.Array,  # f16 | f32 [G, N]
    mins: jax.Array | None = None,  # like scales (asymmetric int4) | None
    *,
    bits: int,
    group_size: int,
) -> jax.Array:  # [M, N] in x.dtype
    """x @ dequantize(W). Raises NotImplementedError for a layout the kernel does not take (N
    not a multiple of 32; int4 with odd K or K/2 not a multiple of the group size) or when the
    kernel is not available on this machine."""
    _validate(x, values, scales, mins, bits, group_size)
    k, n = x.shape[1], values.shape[1]
    if n % COLUMN_MULTIPLE:
        raise NotImplementedError(f"N={n} is not a multiple of {COLUMN_MULTIPLE}")
    if bits == 4 and (k % 2 or (k // 2) % group_size):
        raise NotImplementedError(f"int4 with K={k}, group_size={group_size}: K/2 must be a "
                                  "multiple of the group size")
    target = build.load("quant_matmul", "JaxinferQuantMatmul")
    if target is None:
        raise NotImplementedError("the CPU quantized matmul kernel is not available here")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    y = call(x.astype(jnp.float32), values, scales,
             mins if mins is not None else jnp.zeros((1,), scales.dtype),
             bits=np.int64(bits), group_size=np.int64(group_size),
             has_mins=np.int64(mins is not None))
    return y.astype(x.dtype)


def dequantize(values: jax.Array, scales: jax.Array, mins: jax.Array | None = None, *, bits: int,
               group_size: int, k: int) -> jax.Array:  # f32[K, N]
    """The weight as f32 (for products of many rows, which a dense matmul does faster), read
    at memory speed. NotImplementedError when the kernel is not available."""
    target = build.load("quant_matmul", "JaxinferDequantize")
    if target is None:
        raise NotImplementedError("the CPU dequantize kernel is not available here")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((k, values.shape[1]), jnp.float32))
    return call(values, scales, mins if mins is not None else jnp.zeros((1,), scales.dtype),
                bits=np.int64(bits), group_size=np.int64(group_size),
                has_mins=np.int64(mins is not None), k=np.int64(k))
