"""Ragged paged attention in plain jnp: the XLA path, and the production path on the CPU.

"Query tiles x KV chunks", flash attention written in jnp (the Pallas kernel is
pallas_kernels/ragged_paged_attention.py; `jaxinfer.ops` chooses between them):

* The flat ragged batch is cut into query tiles of `q_tile` rows that never cross a sequence
  boundary (a sequence with q_len new tokens gets ceil(q_len / q_tile) tiles). The tile count is
  static, min(T, (T + S (q_tile - 1)) // q_tile), so it must allow one partial tile per (padded)
  sequence. The tile size is picked at trace time from T and S: 1 when T <= 2 S (decode, mixed
  decode + small prefill), so each token is its own tile and nothing is wasted; else the power of
  two <= T / (2 S), at most 64, for prefill chunks: the KV pages of a long prompt are gathered once
  per tile instead of once per token, and tile rows computed in vain stay under ~T / 2.
* Each tile gathers its sequence's KV pages `kv_chunk_pages` at a time from the stacked cache
  (`k_cache[layer, page_ids]`: one gather, no per-layer copy) and folds them in with an online
  softmax. The chunk size is chosen so the gathered K/V and the score block stay under
  `_ELEMENT_BUDGET` elements each, so memory is bounded whatever the context or chunk length (the
  full [T, context, Hkv, D] is never built). Only the chunks the batch needs run (a while loop from
  the first chunk inside any sliding window to the last chunk of the longest context); when the whole
  page table fits one chunk there is no loop at all, which is the common decode case.
* Masked scores are set with `where` (never multiplied), and V rows past a sequence's length are
  zeroed, so garbage (even NaN) in unused slots or the null page cannot leak into the output.
* int8 caches (`KVCache.k_scale`/`v_scale`, f32[L, N, ps, Hkv], one scale per token and head):
  the fold loop gathers the chunk's scales with its pages and dequantizes only that chunk: the int8 values are
  cast to the compute dtype exactly, and the scales multiply whichever is smaller, the logits or
  K (resp. the probabilities or V), as in the Pallas kernel. The whole cache is never dequantized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.kv_cache import AttentionMetadata

_ELEMENT_BUDGET = 1 << 25  # max elements of one gathered K (or V) chunk and of one score block
_MAX_Q_TILE = 64
_MAX_CHUNK_TOKENS = 128  # KV positions per online-softmax step: the loop then only visits the
# chunks the batch's real contexts reach, so a wide (fixed) page table costs nothing extra.


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def query_tile_size(num_tokens: int, num_seqs: int) -> int:
    """Rows per query tile (static): 1 for decode-like batches, larger for prefill chunks."""
    if num_tokens <= 2 * num_seqs:
        return 1
    return min(_MAX_Q_TILE, _pow2_floor(num_tokens // (2 * num_seqs)))


def kv_chunk_pages(num_tiles: int, q_tile: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, pages_per_seq: int) -> int:
    """Pages gathered per online-softmax step (static), keeping each block under the budget."""
    per_token = num_tiles * max(num_kv_heads * head_dim, num_heads * q_tile)
    pages = _pow2_floor(max(_ELEMENT_BUDGET // (per_token * page_size), 1))
    return max(1, min(pages, pages_per_seq, max(_MAX_CHUNK_TOKENS // page_size, 1)))


def ragged_paged_attention_xla(q, k_cache, v_cache, layer, md: AttentionMetadata, *, sm_scale,
                               sliding_window=None, soft_cap=None, k_scale=None,
                               v_scale=None) -> jax.Array:
    """The plain-jnp implementation (see the module docstring for the algorithm).

    k_scale, v_scale: f32[L, N, ps, Hkv] with int8 caches (dequantized chunk by chunk), else None.
    """
    num_tokens, num_heads, head_dim = q.shape  # T, Hq, D
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs, pages_per_seq = md.page_indices.shape  # S, P
    group = num_heads // num_kv_heads
    q_tile = query_tile_size(num_tokens, num_seqs)
    num_tiles = min(num_tokens, (num_tokens + num_seqs * (q_tile - 1)) // q_tile)

    cu_q_lens = md.cu_q_lens.astype(jnp.int32)  # i32[S+1]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[S]
    kv_lens = md.kv_lens.astype(jnp.int32)  # i32[S]

    # Query tiles: which sequence, which of its tokens, at which positions.
    tiles_per_seq = (q_lens + q_tile - 1) // q_tile  # i32[S]
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_per_seq)])  # i32[S+1]
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.minimum(jnp.searchsorted(cu_tiles[1:], tile_ids, side="right"), num_seqs - 1)
    tile_valid = tile_ids < cu_tiles[-1]  # bool[NT]
    tile_local = tile_ids - cu_tiles[tile_seq]  # i32[NT] index of the tile within its sequence
    rows = jnp.arange(q_tile, dtype=jnp.int32)
    row_local = tile_local[:, None] * q_tile + rows[None, :]  # i32[NT, q_tile]
    row_valid = tile_valid[:, None] & (row_local < q_lens[tile_seq][:, None])  # bool[NT, q_tile]
    tile_kv_len = jnp.where(tile_valid, kv_lens[tile_seq], 0)  # i32[NT]
    q_pos = (tile_kv_len - q_lens[tile_seq])[:, None] + row_local  # i32[NT, q_tile]
    if q_tile == 1:  # tile i is token i
        q_tiles = q[:, None]
    else:
        row_token = jnp.clip(cu_q_lens[tile_seq][:, None] + row_local, 0, num_tokens - 1)
        q_tiles = q[row_token]  # [NT, q_tile, Hq, D]
    # [NT, Hkv, group * q_tile, D]: one matmul per (tile, kv head) covers its whole query group
    q_tiles = q_tiles.reshape(num_tiles, q_tile, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 3, 1, 4).reshape(num_tiles, num_kv_heads, group * q_tile,
                                                      head_dim)
    q_pos_g = jnp.tile(q_pos, (1, group))  # i32[NT, group * q_tile], rows ordered (g, r)
    row_valid_g = jnp.tile(row_valid, (1, group))

    chunk_pages = kv_chunk_pages(num_tiles, q_tile, num_heads, num_kv_heads, head_dim, page_size,
                                 pages_per_seq)
    num_chunks = -(-pages_per_seq // chunk_pages)
    chunk_tokens = chunk_pages * page_size
    page_table = md.page_indices.astype(jnp.int32)[tile_seq]  # i32[NT, P]
    if num_chunks * chunk_pages != pages_per_seq:
        page_table = jnp.pad(page_table, ((0, 0), (0, num_chunks * chunk_pages - pages_per_seq)))

    num_rows = group * q_tile
    acc_shape = (num_tiles, num_kv_heads, num_rows)
    quantized = k_scale is not None
    scale_logits = num_rows <= head_dim  # int8: scale the [rows, C] logits/probs, else K/V [C, D]

    def fold_chunk(chunk, carry):
        m, l, acc = carry  # f32[NT, Hkv, rows], f32[NT, Hkv, rows], f32[NT, Hkv, rows, D]
        page_ids = jax.lax.dynamic_slice_in_dim(page_table, chunk * chunk_pages, chunk_pages, 1)
        k = k_cache[layer, page_ids].reshape(num_tiles, chunk_tokens, num_kv_heads, head_dim)
        v = v_cache[layer, page_ids].reshape(num_tiles, chunk_tokens, num_kv_heads, head_dim)
        kv_pos = chunk * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)  # i32[C]
        kv_real = kv_pos[None, :] < tile_kv_len[:, None]  # bool[NT, C]
        if quantized:  # f32[NT, C, Hkv] scales of this chunk only
            ks = k_scale[layer, page_ids].reshape(num_tiles, chunk_tokens, num_kv_heads)
            vs = v_scale[layer, page_ids].reshape(num_tiles, chunk_tokens, num_kv_heads)
            vs = jnp.where(kv_real[:, :, None], vs, 0.0)  # int8 V is finite; its scale is masked
            if not scale_logits:
                k = k.astype(jnp.float32) * ks[..., None]
                v = v.astype(jnp.float32) * vs[..., None]
            v = v.astype(q_tiles.dtype)
        else:
            v = jnp.where(kv_real[:, :, None, None], v, 0)
        s = jnp.einsum("nhrd,nchd->nhrc", q_tiles, k.astype(q_tiles.dtype),
                       preferred_element_type=jnp.float32)  # f32[NT, Hkv, rows, C]
        if quantized and scale_logits:
            s = s * ks.transpose(0, 2, 1)[:, :, None, :]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = row_valid_g[:, :, None] & (kv_pos[None, None, :] <= q_pos_g[:, :, None])
        if sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos_g[:, :, None] - sliding_window
        s = jnp.where(mask[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])  # 0 where masked
        alpha = jnp.exp(m - m_safe)  # 0 while m is -inf
        l = alpha * l + p.sum(axis=-1)
        if quantized and scale_logits:
            p = p * vs.transpose(0, 2, 1)[:, :, None, :]
        pv = jnp.einsum("nhrc,nchd->nhrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, alpha[..., None] * acc + pv

    init = (jnp.full(acc_shape, -jnp.inf, jnp.float32), jnp.zeros(acc_shape, jnp.float32),
            jnp.zeros(acc_shape + (head_dim,), jnp.float32))
    if num_chunks == 1:
        _, l, acc = fold_chunk(0, init)
    else:
        any_valid = jnp.any(tile_valid)
        last = jnp.max(tile_kv_len)
        first = 0
        if sliding_window is not None:
            first = jnp.min(jnp.where(tile_valid, q_pos[:, 0] - sliding_window + 1, last))
            first = jnp.maximum(first, 0)
        lo = jnp.where(any_valid, first // chunk_tokens, 0)
        hi = jnp.where(any_valid, (last + chunk_tokens - 1) // chunk_tokens, 0)
        _, l, acc = jax.lax.fori_loop(lo, hi, fold_chunk, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # f32[NT, Hkv, rows, D]; 0 where nothing seen

    out = out.reshape(num_tiles, num_kv_heads, group, q_tile, head_dim).transpose(0, 3, 1, 2, 4)
    out = out.reshape(num_tiles, q_tile, num_heads, head_dim)
    if q_tile == 1:
        out = out[:, 0]
    else:  # back to token order: token t is row (t - cu_q_lens[s]) % q_tile of its tile
        token_ids = jnp.arange(num_tokens, dtype=jnp.int32)
        token_seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token_ids, side="right"),
                                num_seqs - 1)
        local = token_ids - cu_q_lens[token_seq]
        tile = jnp.clip(cu_tiles[token_seq] + local // q_tile, 0, num_tiles - 1)
        out = out[tile, local % q_tile]
    token_valid = jnp.arange(num_tokens) < cu_q_lens[-1]
    return jnp.where(token_valid[:, None, None], out, 0).astype(q.dtype)
