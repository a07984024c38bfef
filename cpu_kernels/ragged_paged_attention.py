"""Ragged paged attention on the CPU: the C++ kernel (ragged_paged_attention.cc) behind JAX.

The same contract as `pallas_kernels.ragged_paged_attention` (plain arrays in; its
`ragged_paged_attention_reference` is the reference for both), over a head-major cache: K
[L, N, Hkv, D, page_size] and V [L, N, Hkv, page_size, D] (int8 scales [L, N, Hkv, page_size]),
so that a KV head's part of a page is one contiguous block that the kernel reads in place.
`to_head_major` converts the token-major layout [L, N, page_size, Hkv, D] of the other kernels.
A step costs what its sequences' own contexts cost: no gathered copy of the context, no padding
of short sequences to the longest one, and a decode row beside a long prefill chunk is still a
decode row. See the .cc file for the algorithm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build

MAX_PAGE_SIZE = 64  # the kernel's score block holds one page
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def available() -> bool:
    """Whether the kernel is built and registered (compiling it on first call)."""
    return build.load("ragged_paged_attention", "JaxinferRaggedPagedAttention") is not None


def to_head_major(k_cache, v_cache, k_scale=None, v_scale=None):
    """Token-major [L, N, ps, Hkv, D] caches (and [L, N, ps, Hkv] scales) -> this kernel's
    head-major K [L, N, Hkv, D, ps], V [L, N, Hkv, ps, D] (scales [L, N, Hkv, ps])."""
    k = jnp.transpose(k_cache, (0, 1, 3, 4, 2))
    v = jnp.transpose(v_cache, (0, 1, 3, 2, 4))
    if k_scale is None:
        return k, v, None, None
    return k, v, jnp.transpose(k_scale, (0, 1, 3, 2)), jnp.transpose(v_scale, (0, 1, 3, 2))


def _validate(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale):
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [num_tokens, num_q_heads, head_dim]")
    if k_cache.ndim != 5 or v_cache.ndim != 5 or v_cache.dtype != k_cache.dtype or \
            v_cache.shape != k_cache.shape[:3] + (k_cache.shape[4], k_cache.shape[3]):
        raise ValueError(f"{k_cache.shape=} {v_cache.shape=} must be head-major K [num_layers, "
                         "num_pages, num_kv_heads, head_dim, page_size] and V [..., page_size, "
                         "head_dim] of one dtype")
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape=} does not fit {k_cache.shape=} (head_dim, GQA group)")
    quantized = k_cache.dtype == jnp.int8
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"{k_cache.dtype=}: k_scale and v_scale must be given exactly for int8 "
                         "caches")
    if not quantized and jnp.dtype(k_cache.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"{k_cache.dtype=} must be float32, bfloat16, float16 or int8")
    scale_shape = k_cache.shape[:3] + (k_cache.shape[4],)
    if quantized and (k_scale.shape != scale_shape or v_scale.shape != scale_shape):
        raise ValueError(f"{k_scale.shape=} {v_scale.shape=} must be {scale_shape}")
    num_seqs_pad = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    for name, arr, shape in (("kv_lens", kv_lens, (num_seqs_pad,)),
                             ("cu_q_lens", cu_q_lens, (num_seqs_pad + 1,)),
                             ("num_seqs", num_seqs, (1,))):
        if arr.shape != shape or arr.dtype != jnp.int32:
            raise ValueError(f"{name} {arr.shape=} {arr.dtype=} must be int32{list(shape)}")
    if page_indices.ndim != 2 or page_indices.shape[0] != num_seqs_pad or \
            page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices {page_indices.shape=} {page_indices.dtype=} must be "
                         f"int32[{num_seqs_pad}, P]")


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, N, Hkv, D, page_size] float32 | bfloat16 | float16 | int8
    v_cache: jax.Array,  # [L, N, Hkv, page_size, D]
    layer: jax.Array,  # i32[] the layer to read (may be traced)
    kv_lens: jax.Array,  # i32[S] context length of each sequence, this step's tokens included
    page_indices: jax.Array,  # i32[S, P] its pages
    cu_q_lens: jax.Array,  # i32[S+1] cumulative new-token counts
    num_seqs: jax.Array,  # i32[1] real sequences; the rest is padding
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[L, N, Hkv, page_size] with int8 caches
    v_scale: jax.Array | None = None,
) -> jax.Array:  # [T, Hq, D] in q.dtype; zero for padding tokens
    """Attention of the step's new tokens over their paged context (the CPU kernel). Raises
    NotImplementedError when the kernel is not available on this machine."""
    _validate(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be None or >= 1")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"{soft_cap=} must be None or > 0")
    if k_cache.shape[4] > MAX_PAGE_SIZE:
        raise NotImplementedError(f"page_size={k_cache.shape[4]} > {MAX_PAGE_SIZE}")
    target = build.load("ragged_paged_attention", "JaxinferRaggedPagedAttention")
    if target is None:
        raise NotImplementedError("the CPU attention kernel is not available on this machine")
    dummy = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache,
               dummy if k_scale is None else k_scale, dummy if v_scale is None else v_scale,
               jnp.asarray(layer, jnp.int32).reshape(1), kv_lens, page_indices, cu_q_lens,
               num_seqs, sm_scale=np.float32(sm_scale),
               sliding_window=np.int64(sliding_window or 0),
               soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)
