"""The paged KV cache and the per-step attention metadata (both pytrees), and their sizes.

The cache is one stacked array per K and V, `[L, N, page_size, Hkv, D]`, donated into the step
and returned, so XLA updates it in place. int8 caches carry one f32 scale per (layer, page, slot,
KV head) beside the pages (`k_scale`/`v_scale`, None for float caches); the format (symmetric per
token and head, x ~= int8 * absmax / 127) is `pallas_kernels.kv_write.quantize_kv`, applied when a
token's K/V is written. Bytes per value are 1 + 4 / head_dim (1.0625 at D = 64): 53% of a bfloat16
cache, 27% of a float32 one. Its quality is measured in docs/quantization.md.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from pallas_kernels.kv_write import SCALE_DTYPE, dequantize_kv, quantize_kv  # noqa: F401 (the format)

KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8")


class KVCache(NamedTuple):
    """Stacked over layers; donated into the step and returned (updated in place).

    Token-major (the XLA path and the Pallas kernels): K and V [L, N, page_size, Hkv, D], scales
    [L, N, page_size, Hkv]. Head-major (the CPU kernels, which read a KV head's part of a page as
    one block): K [L, N, Hkv, D, page_size] (each page's keys transposed), V [L, N, Hkv,
    page_size, D], scales [L, N, Hkv, page_size]. The step's attention backend fixes which one a
    cache is (`allocate_kv_cache(head_major=...)`, `ops.head_major_cache`)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None  # f32, int8 caches only
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


class AttentionMetadata(NamedTuple):
    slot_mapping: jax.Array  # i32[T] flat slot (page_id * page_size + offset) of each new token
    cu_q_lens: jax.Array  # i32[S+1] cumulative new-token counts; padded seqs repeat the last value
    kv_lens: jax.Array  # i32[S] context length including this step's tokens; 0 for padding
    page_indices: jax.Array  # i32[S, P] physical page ids; unused entries 0 (the null page)
    num_seqs: jax.Array  # i32[1] real number of sequences

    @property
    def num_real_tokens(self) -> jax.Array:
        """i32[]: the step's real tokens, the first ones of T (padding sequences repeat the last
        cu_q_lens); the padding tokens after them are computed for nothing, and the CPU's
        quantized matmuls skip them (`ops.quantized_matmul`'s num_rows)."""
        return self.cu_q_lens[-1]


def _check_dtype(dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype.name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache {dtype=} must be one of {KV_CACHE_DTYPES}")
    return dtype


def kv_cache_bytes_per_page(config: ModelConfig, page_size: int, dtype) -> int:
    """Device bytes of one page over all layers, K and V, scales included (int8)."""
    dtype = _check_dtype(dtype)
    values = config.num_layers * page_size * config.num_kv_heads
    per_token_head = config.head_dim * dtype.itemsize
    if dtype == jnp.int8:
        per_token_head += jnp.dtype(SCALE_DTYPE).itemsize
    return 2 * values * per_token_head


def allocate_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype, *,
                      head_major: bool = False) -> KVCache:
    """Zero-filled (never jnp.empty: NaN in a masked page still poisons a sum), token-major or
    head-major (see KVCache). dtype int8 adds the f32 scales (zero: a never-written slot
    dequantizes to 0)."""
    if num_pages < 2:
        raise ValueError(f"{num_pages=} must be at least 2 (page 0 is the null page)")
    dtype = _check_dtype(dtype)
    lead = (config.num_layers, num_pages)
    hkv, d, ps = config.num_kv_heads, config.head_dim, page_size
    if head_major:
        k_shape, v_shape, scale_shape = lead + (hkv, d, ps), lead + (hkv, ps, d), lead + (hkv, ps)
    else:
        k_shape = v_shape = lead + (ps, hkv, d)
        scale_shape = lead + (ps, hkv)
    k, v = jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)
    if dtype != jnp.int8:
        return KVCache(k=k, v=v)
    return KVCache(k=k, v=v, k_scale=jnp.zeros(scale_shape, SCALE_DTYPE),
                   v_scale=jnp.zeros(scale_shape, SCALE_DTYPE))
