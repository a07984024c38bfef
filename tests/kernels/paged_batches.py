"""Random ragged paged batches for kernel tests: permuted pages, NaN everywhere unwritten."""

from __future__ import annotations

import os
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.kv_cache import AttentionMetadata

# JAXINFER_KERNEL_INTERPRET=0 runs the kernel tests compiled (on a GPU machine).
INTERPRET = os.environ.get("JAXINFER_KERNEL_INTERPRET", "1") != "0"


class PagedBatch(NamedTuple):
    q: jnp.ndarray  # [T, Hq, D]
    k_cache: jnp.ndarray  # [L, N, page_size, Hkv, D]; NaN in every unwritten slot
    v_cache: jnp.ndarray
    md: AttentionMetadata
    q_lens: list[int]
    kv_lens: list[int]
    num_tokens_real: int


def make_paged_batch(
    seed: int, *, q_lens, kv_lens, page_size: int, head_dim: int, num_kv_heads: int, group: int,
    num_layers: int = 2, dtype=jnp.float32, num_seqs_pad: int | None = None,
    num_tokens_pad: int | None = None, pages_per_seq: int | None = None, spare_pages: int = 3,
    garbage_padding: bool = False, num_pages: int | None = None,
) -> PagedBatch:
    """Sequences get random, permuted pages (page 0 is the null page); unused pages are NaN.

    garbage_padding: padded sequences (beyond num_seqs) get nonzero kv_lens, random pages and
    the padding tokens, which the kernel must ignore because of num_seqs alone.
    """
    assert len(q_lens) == len(kv_lens) and all(0 < q <= kv for q, kv in zip(q_lens, kv_lens))
    rng = np.random.default_rng(seed)
    num_real = len(q_lens)
    num_seqs = num_seqs_pad or num_real
    num_tokens_real = sum(q_lens)
    num_tokens = num_tokens_pad or num_tokens_real
    pages_needed = [-(-kv // page_size) for kv in kv_lens]
    width = pages_per_seq or max(pages_needed)
    num_pages = num_pages or 1 + sum(pages_needed) + spare_pages
    assert num_pages > sum(pages_needed)
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    page_ids = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((num_seqs, width), np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    kv_arr = np.zeros(num_seqs, np.int32)
    used = 0
    for s, (ql, kvl) in enumerate(zip(q_lens, kv_lens)):
        pages = page_ids[used:used + pages_needed[s]]
        used += pages_needed[s]
        page_indices[s, :len(pages)] = pages
        for pos in range(kvl):
            page, off = pages[pos // page_size], pos % page_size
            k[:, page, off] = rng.standard_normal((num_layers, num_kv_heads, head_dim))
            v[:, page, off] = rng.standard_normal((num_layers, num_kv_heads, head_dim))
        cu[s + 1] = cu[s] + ql
        kv_arr[s] = kvl
        for i in range(ql):
            pos = kvl - ql + i
            slot_mapping[cu[s] + i] = pages[pos // page_size] * page_size + pos % page_size
    cu[num_real + 1:] = cu[num_real]
    if garbage_padding and num_seqs > num_real:
        extra = num_tokens - num_tokens_real
        for s in range(num_real, num_seqs):
            take = extra if s == num_seqs - 1 else 0
            cu[s + 1] = cu[s] + take
            kv_arr[s] = rng.integers(1, width * page_size + 1)
            page_indices[s] = rng.integers(0, num_pages, width)
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slot_mapping), cu_q_lens=jnp.asarray(cu),
        kv_lens=jnp.asarray(kv_arr), page_indices=jnp.asarray(page_indices),
        num_seqs=jnp.asarray([num_real], jnp.int32),
    )
    return PagedBatch(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), md,
                      list(q_lens), list(kv_lens), num_tokens_real)


def layout(batch: PagedBatch) -> tuple:
    """The kernels' batch-layout arguments: (kv_lens, page_indices, cu_q_lens, num_seqs)."""
    md = batch.md
    return md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs


def naive_attention(batch: PagedBatch, layer: int, *, sm_scale: float, sliding_window=None,
                    soft_cap=None) -> np.ndarray:
    """Dense numpy attention, one sequence and one token at a time (f64)."""
    q = np.asarray(batch.q, np.float64)
    k_cache = np.asarray(batch.k_cache, np.float64)[layer]
    v_cache = np.asarray(batch.v_cache, np.float64)[layer]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    pages = np.asarray(batch.md.page_indices)
    out = np.zeros_like(q)
    t = 0
    for s, (ql, kvl) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        pos_ids = np.arange(kvl)
        k = k_cache[pages[s, pos_ids // page_size], pos_ids % page_size]  # [kvl, Hkv, D]
        v = v_cache[pages[s, pos_ids // page_size], pos_ids % page_size]
        for i in range(ql):
            pos = kvl - ql + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                logits = k[lo:pos + 1, h // group] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                p = np.exp(logits - logits.max())
                out[t, h] = (p / p.sum()) @ v[lo:pos + 1, h // group]
            t += 1
    return out


def rel_err(out, ref, num_tokens_real: int) -> float:
    """max |out - ref| / max |ref| over the real tokens (never a comparison on zeros)."""
    out = np.asarray(out, np.float64)[:num_tokens_real]
    ref = np.asarray(ref, np.float64)[:num_tokens_real]
    scale = np.abs(ref).max()
    assert scale > 0
    return float(np.abs(out - ref).max() / scale)
