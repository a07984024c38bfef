"""The paged KV cache and the per-step attention metadata (both pytrees)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


class KVCache(NamedTuple):
    """Stacked over layers; donated into the step and returned (updated in place)."""

    k: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


class AttentionMetadata(NamedTuple):
    slot_mapping: jax.Array  # i32[T] flat slot (page_id * page_size + offset) of each new token
    cu_q_lens: jax.Array  # i32[S+1] cumulative new-token counts; padded seqs repeat the last value
    kv_lens: jax.Array  # i32[S] context length including this step's tokens; 0 for padding
    page_indices: jax.Array  # i32[S, P] physical page ids; unused entries 0 (the null page)
    num_seqs: jax.Array  # i32[1] real number of sequences


def kv_cache_bytes_per_page(config: ModelConfig, page_size: int, dtype) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * itemsize


def allocate_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype) -> KVCache:
    """Zero-filled (never jnp.empty: NaN in a masked page still poisons a sum)."""
    if num_pages < 2:
        raise ValueError(f"{num_pages=} must be at least 2 (page 0 is the null page)")
    shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
