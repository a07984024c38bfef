"""One sequence through a model in prefill chunks over a small paged KV cache of its own.

What perplexity and calibration need: every token sees its whole left context, as in the engine,
without a scheduler. The sequence takes pages 1..n of a fresh pool (page 0 is the null page, where
padding tokens write); each chunk is one call of a jitted function of the caller's.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache, allocate_kv_cache


class Chunk(NamedTuple):
    start: int  # position of the chunk's first token
    num_tokens: int  # real tokens (the rest of the `chunk` rows is padding)
    input_ids: jnp.ndarray  # i32[chunk]
    positions: jnp.ndarray  # i32[chunk]
    md: AttentionMetadata
    valid: jnp.ndarray  # bool[chunk] real rows


def sequence_cache(model, num_tokens: int, page_size: int, dtype=None) -> KVCache:
    """A zeroed KV cache with room for one sequence of `num_tokens` (+ the null page)."""
    num_pages = -(-num_tokens // page_size) + 1
    return allocate_kv_cache(model.config, num_pages, page_size, dtype or model.dtype)


def chunks(token_ids: np.ndarray, chunk: int, page_size: int) -> Iterator[Chunk]:
    """The prefill chunks of one sequence (i32[n]), each padded to `chunk` tokens."""
    n = len(token_ids)
    pages = np.arange(1, -(-n // page_size) + 1, dtype=np.int32)  # i32[P] the sequence's pages
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        q = stop - start
        ids = np.zeros(chunk, np.int32)
        ids[:q] = token_ids[start:stop]
        pos = np.zeros(chunk, np.int32)
        pos[:q] = np.arange(start, stop)
        slots = np.arange(chunk, dtype=np.int32) % page_size  # padding -> the null page
        slots[:q] = pages[pos[:q] // page_size] * page_size + pos[:q] % page_size
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots), cu_q_lens=jnp.asarray([0, q], jnp.int32),
            kv_lens=jnp.asarray([stop], jnp.int32), page_indices=jnp.asarray(pages[None, :]),
            num_seqs=jnp.asarray([1], jnp.int32))
        yield Chunk(start, q, jnp.asarray(ids), jnp.asarray(pos), md, jnp.arange(chunk) < q)
