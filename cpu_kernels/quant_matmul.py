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
Q8_COLUMN_MULTIPLE = 64  # the int8-activation kernel's block of output columns


def available() -> bool:
    """Whether the kernel is built and registered (compiling it on first call)."""
    return build.load("quant_matmul", "JaxinferQuantMatmul") is not None


def dense_faster_above_rows() -> int | None:
    """Rows of x above which a dense f32 matmul beats the kernel on this CPU; None when it never
    does (the kernel's AVX-512 paths, which -march=native enables where the CPU has them). With
    AVX2 and no AVX-512 the kernel's panels win to ~128 rows (benchmarks/cpu_matmul.py on a Zen 3
    EPYC: 96.7 against 116.2 ms at 64 rows, 207 against 211 at 128, 453 against 399 at 256);
    with neither, its plain loops to 16."""
    flags = build.cpu_flags().split()
    if "avx512f" in flags and "avx512bw" in flags:
        return None
    return 96 if "avx2" in flags and "fma" in flags else 16


def int8_activations_fast() -> bool:
    """Whether the int8-activation kernel multiplies faster than the float one on this CPU: with
    AVX-512 VNNI (vpdpbusd), or with AVX2 and no AVX-512 (vpmaddubsw; -march=native enables
    either where the CPU has it). Elsewhere it is a plain loop, slower than the float kernel, or
    (AVX-512 without VNNI) unmeasured against the float kernel's AVX-512 paths; the numbers are
    the same everywhere."""
    flags = build.cpu_flags().split()
    if all(f in flags for f in ("avx512f", "avx512bw", "avx512_vnni")):
        return True
    return "avx2" in flags and "fma" in flags and "avx512f" not in flags


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


def padded_stride(n: int) -> int:
    """The row stride (in columns) at which a weight of N columns of 1-byte codes is best kept
    for the int8-activation kernel: N where N / 64 is odd, else N + 64. It walks each block of
    columns down the code rows, one cache line a row; where a row is an even number of lines
    long, those lines fall in a fraction of the caches' sets (all in one set of L1 where it is
    a multiple of 4 KiB) and evict each other before they are used. An odd number of lines
    spreads them over every set: SmolLM2's LM head (N = 49,152) at 9 rows of x and a 4096-wide
    int4 matrix run 6-18% faster (docs/performance.md, item 25). Other N (not a multiple of 64
    columns) are left as they are."""
    return n if n % 64 or (n // 64) % 2 else n + 64


def takes_layout(k: int, bits: int, group_size: int) -> bool:
    """Whether the kernels take a weight of K rows at `bits` (int4: K even and K/2 a multiple
    of the group size, since a packed row holds rows i and K/2 + i); N is checked apart."""
    return bits == 8 or (k % 2 == 0 and (k // 2) % group_size == 0)


def _columns(values: jax.Array, columns: int | None) -> int:
    n = values.shape[1] if columns is None else columns
    if not 0 < n <= values.shape[1]:
        raise ValueError(f"{columns=} must be in [1, {values.shape[1]}] (the values' columns)")
    return n


def quant_matmul(
    x: jax.Array,  # [M, K] f32 | bf16
    values: jax.Array,  # i8[K, N] | u8[K/2, N]
    scales: jax.Array,  # f16 | f32 [G, N]
    mins: jax.Array | None = None,  # like scales (asymmetric int4) | None
    *,
    bits: int,
    group_size: int,
    int8_activations: bool = False,
    num_rows: jax.Array | None = None,  # i32[] (traced): x's real rows, the first ones
    columns: int | None = None,  # N, where the arrays' rows are longer (a padded stride)
) -> jax.Array:  # [M, N] in x.dtype
    """x @ dequantize(W). `int8_activations`: x rounded to int8 per group of the weight and the
    products taken in integers (quant_matmul_q8.cc; `quant_matmul_q8_reference` says exactly
    what it computes). `num_rows`: only x's first num_rows rows (clamped to [0, M]) are
    multiplied and the rest of the result is zero, so a step padded to its token bucket pays for
    its real rows only (None: all M); with int8 activations a row's result does not depend on
    it. `columns`: the weight's N where values, scales and mins have more columns than that, a
    row stride padded so that consecutive rows do not share cache sets (`padded_stride`; the
    columns past N are never read). Raises NotImplementedError for a layout the kernel does not
    take (N not a multiple of 32, or of 64 with int8 activations; int4 with odd K or K/2 not a
    multiple of the group size) or when the kernel is not available on this machine."""
    _validate(x, values, scales, mins, bits, group_size)
    k, n = x.shape[1], _columns(values, columns)
    if n % COLUMN_MULTIPLE:
        raise NotImplementedError(f"N={n} is not a multiple of {COLUMN_MULTIPLE}")
    if not takes_layout(k, bits, group_size):
        raise NotImplementedError(f"int4 with K={k}, group_size={group_size}: K/2 must be a "
                                  "multiple of the group size")
    if int8_activations:
        if n % Q8_COLUMN_MULTIPLE or k % 4 or group_size % 4 or (bits == 4 and group_size > 128):
            raise NotImplementedError(
                f"int8 activations with N={n}, K={k}, group_size={group_size}: N must be a "
                f"multiple of {Q8_COLUMN_MULTIPLE}, K and the group size of 4 (int4: groups of "
                "at most 128)")
        target = build.load("quant_matmul_q8", "JaxinferQuantMatmulQ8")
    else:
        target = build.load("quant_matmul", "JaxinferQuantMatmul")
    if target is None:
        raise NotImplementedError("the CPU quantized matmul kernel is not available here")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    real = jnp.full((1,), x.shape[0], jnp.int32) if num_rows is None else \
        jnp.reshape(num_rows, (1,)).astype(jnp.int32)  # i32[1]
    y = call(x.astype(jnp.float32), values, scales,
             mins if mins is not None else jnp.zeros((1,), scales.dtype), real,
             bits=np.int64(bits), group_size=np.int64(group_size),
             has_mins=np.int64(mins is not None))
    return y.astype(x.dtype)


def dequantize(values: jax.Array, scales: jax.Array, mins: jax.Array | None = None, *, bits: int,
               group_size: int, k: int, columns: int | None = None) -> jax.Array:  # f32[K, N]
    """The weight as f32 (for products of many rows, which a dense matmul does faster), read
    at memory speed; `columns` as quant_matmul's. NotImplementedError when the kernel is not
    available."""
    target = build.load("quant_matmul", "JaxinferDequantize")
    if target is None:
        raise NotImplementedError("the CPU dequantize kernel is not available here")
    n = _columns(values, columns)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((k, n), jnp.float32))
    return call(values, scales, mins if mins is not None else jnp.zeros((1,), scales.dtype),
                bits=np.int64(bits), group_size=np.int64(group_size),
                has_mins=np.int64(mins is not None), k=np.int64(k))


def quantize_activations_reference(x: jax.Array, group_size: int):
    """x f32[M, K] rounded to int8 per group of K as the int8-activation kernel rounds it:
    (int8[M, K] codes, f32[M, G] steps d = max |x| / 127 of each group, f32[M, G] exact sums)."""
    m, k = x.shape
    g = -(-k // group_size)
    xg = jnp.pad(x, ((0, 0), (0, g * group_size - k))).reshape(m, g, group_size)
    d = jnp.max(jnp.abs(xg), axis=-1) / 127.0  # [M, G]
    inv = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    q = jnp.round(xg * inv[..., None]).astype(jnp.int8).reshape(m, g * group_size)[:, :k]
    return q, d, jnp.sum(xg, axis=-1)


def quant_matmul_q8_reference(x, values, scales, mins=None, *, bits: int,
                              group_size: int) -> jax.Array:
    """Plain jnp: what `quant_matmul(..., int8_activations=True)` computes. Each group's dot
    product of the int8 x and the weight's integer codes is exact (int32); it is scaled by the
    weight's scale and x's step, plus min x the exact sum of x's group (int4; symmetric codes
    are offset by 8 through min = -8 scale)."""
    x = x.astype(jnp.float32)
    m, k = x.shape
    n = values.shape[1]
    g = -(-k // group_size)
    xq, d, sums = quantize_activations_reference(x, group_size)  # [M, K], [M, G], [M, G]
    if bits == 8:
        codes = values.astype(jnp.int32)  # [K, N]
    else:
        codes = jnp.concatenate([values & 15, values >> 4], axis=0)[:k].astype(jnp.int32)
    xg = jnp.pad(xq.astype(jnp.int32), ((0, 0), (0, g * group_size - k))).reshape(m, g, group_size)
    cg = jnp.pad(codes, ((0, g * group_size - k), (0, 0))).reshape(g, group_size, n)
    dots = jnp.einsum("mgk,gkn->mgn", xg, cg, preferred_element_type=jnp.int32)  # [M, G, N] exact
    scales = scales.astype(jnp.float32)
    y = jnp.einsum("mgn,gn->mn", dots.astype(jnp.float32) * d[..., None], scales,
                   precision=jax.lax.Precision.HIGHEST)
    if bits == 4:
        offset = mins.astype(jnp.float32) if mins is not None else -8.0 * scales  # [G, N]
        y = y + jnp.einsum("mg,gn->mn", sums, offset, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
