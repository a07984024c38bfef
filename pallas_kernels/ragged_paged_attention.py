"""Ragged paged attention: one Pallas kernel over the flat ragged batch of a step.

The step's new tokens are a flat list `q[T, Hq, D]`; sequence s owns tokens
`cu_q_lens[s] : cu_q_lens[s+1]` and has `kv_lens[s]` context tokens (including its new ones) in
the pages `page_indices[s]` of the stacked cache `[L, N, page_size, Hkv, D]`. Token i of sequence
s sits at position `kv_lens[s] - q_len[s] + i` and attends to positions `0 .. that position`
(causal within the new tokens), optionally only to the last `sliding_window` of them.

How the kernel is laid out
--------------------------
The wrapper (plain jnp, O(T + S) work) cuts every sequence's new tokens into q tiles of
`tile_tokens` tokens. A program of the grid `(num_tiles, Hkv, num_kv_splits)` takes one q tile
and one KV head: its rows are `tile_tokens x group` query rows (all query heads of that KV head,
GQA), and it walks the sequence's pages `pages_per_chunk` at a time, gathering them through the
page table, with an online softmax. q tiles are gathered into a padded `[num_tiles, Hkv, rows, D]`
array and the output comes back the same way, so the kernel never reads or writes out of bounds
and needs no masked loads or stores: every program owns its output block.

Decode (`max_q_len=1`, or a decode-like bucket T <= 2 S): one token per tile, and the context is
split across `num_kv_splits` programs (flash-decoding); each writes a normalised partial output
with its max and sum, merged in jnp.

Portable subset only (`pl.pallas_call`, `BlockSpec`, ref indexing with scalars, `pl.ds` and an
index vector, `jnp`, `lax.fori_loop`), so the same kernel runs with `interpret=True` on the CPU
and lowers through Triton (`lowering="triton"`). Every in-kernel array has a power-of-two size and
every dot has M, N, K >= 16 (Triton's limits): query rows are padded to at least 16, the head
group to a power of two, a chunk holds at least 16 keys.

Checked without a GPU: interpret mode against the reference (tests/kernels), lowering to Triton
IR for CUDA on the CPU (tests), and that IR compiled to sm_90 cubin (benchmarks/triton_ttir.py);
on a GPU, benchmarks/gpu_check.sh. Mosaic GPU:
`pl.pallas_call` without Triton params stages every whole-array input in shared memory, so the
paged cache cannot be passed that way; `lowering="mosaic"` raises NotImplementedError (ops falls
back) until a Mosaic-specific kernel (GMEM refs, plgpu copies, layouts) exists.

int8 KV: pass `k_scale`/`v_scale` f32[L, N, page_size, Hkv] with int8 caches (per token and head
scales, see `quantize_kv`); K is dequantised by scaling the logits, V by scaling the probabilities.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_DOT_SIZE = 16  # Triton's tl.dot needs M, N, K >= 16
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
LOWERINGS = ("triton", "mosaic")


class RaggedBatch(NamedTuple):
    """The batch layout arrays, gathered for the wrapper's helpers (built from the arguments)."""

    kv_lens: jax.Array  # i32[S] context length of each sequence, this step's tokens included
    page_indices: jax.Array  # i32[S, P] its pages in the cache
    cu_q_lens: jax.Array  # i32[S+1] cumulative new-token counts
    num_seqs: jax.Array  # i32[1] real sequences (the rest is padding)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


class KernelConfig(NamedTuple):
    """Static tiling of one call (all sizes powers of two)."""

    tile_tokens: int  # new tokens of one sequence per program
    group_pad: int  # query heads per KV head, padded to a power of two
    rows: int  # query rows per program: max(16, tile_tokens * group_pad)
    pages_per_chunk: int  # pages gathered per inner-loop step
    num_tiles: int  # static bound on q tiles over the whole batch
    num_kv_splits: int  # programs sharing one sequence's context (decode only)


def choose_config(
    *, num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, page_size: int,
    pages_per_seq: int, max_q_len: int | None, q_rows: int, kv_chunk_size: int | None,
    num_kv_splits: int | None, target_programs: int = 528,
) -> KernelConfig:
    """Pick the tiling. `target_programs` ~ 4 programs per SM of an H100/H200 (132 SMs).

    Any tile size is correct (the tile count bound follows it); one-token tiles are chosen for
    decode (`max_q_len=1`) and for decode-like buckets (T <= 2 S), and only then is the context
    split over programs (flash-decoding): a tile's partials are merged per row, so splitting would
    be right for any tile, it just pays only when there are few programs.
    """
    group_pad = _next_pow2(group)
    tile_tokens = max(1, q_rows // group_pad)
    if max_q_len is not None:
        tile_tokens = min(tile_tokens, _next_pow2(max_q_len))
    elif num_tokens <= 2 * num_seqs:  # decode-like bucket: one token per tile wastes nothing
        tile_tokens = 1
    decode = tile_tokens == 1
    rows = max(MIN_DOT_SIZE, tile_tokens * group_pad)
    # Every tile holds >= 1 token; sum_s cdiv(q_s, B) <= (T + nonempty * (B - 1)) / B.
    num_tiles = min(num_tokens, (num_tokens + min(num_seqs, num_tokens) * (tile_tokens - 1)) // tile_tokens)
    if max_q_len is not None:
        num_tiles = min(num_tiles, num_seqs * -(-max_q_len // tile_tokens))
    num_tiles = max(num_tiles, 1)
    if kv_chunk_size is None:
        kv_chunk_size = 128 if decode else 64
    chunk = max(kv_chunk_size, page_size, MIN_DOT_SIZE)
    pages_per_chunk = _next_pow2(-(-chunk // page_size))
    max_chunks = -(-pages_per_seq // pages_per_chunk)
    if not decode:
        splits = 1
    elif num_kv_splits is not None:
        splits = num_kv_splits
    else:
        splits = _next_pow2(-(-target_programs // (num_tiles * num_kv_heads)))
        splits = max(1, min(splits, _next_pow2(max_chunks), 32))
    return KernelConfig(tile_tokens, group_pad, rows, pages_per_chunk, num_tiles, splits)


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


def _cdiv(a, b: int):
    """Ceil division of a non-negative traced int (lax.div truncates; exact for a >= 0)."""
    return lax.div(a + (b - 1), b)


def _attention_kernel(
    layer_ref,  # i32[1]
    tile_seq_ref,  # i32[num_tiles] sequence of each q tile
    tile_first_pos_ref,  # i32[num_tiles] position of the tile's first token
    tile_last_pos_ref,  # i32[num_tiles] position of its last real token; -1 for empty tiles
    page_indices_ref,  # i32[S, P_pad]
    q_ref,  # [rows, D] (block of [num_tiles, Hkv, rows, D])
    k_ref,  # [L, N, page_size, Hkv, D] (whole cache, f32/bf16/f16 or int8)
    v_ref,  # [L, N, page_size, Hkv, D]
    *rest,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    group_pad: int,
    pages_per_chunk: int,
    num_kv_splits: int,
    quantized: bool,
):
    if quantized:
        k_scale_ref, v_scale_ref, *out_refs = rest  # f32[L, N, page_size, Hkv] each
    else:
        k_scale_ref = v_scale_ref = None
        out_refs = rest
    tile, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[2]
    chunk = pages_per_chunk * page_size

    layer = layer_ref[0]
    seq = tile_seq_ref[tile]
    first_pos = tile_first_pos_ref[tile]
    kv_end = tile_last_pos_ref[tile] + 1  # keys [kv_start, kv_end) can be seen by some row
    kv_start = 0 if sliding_window is None else jnp.maximum(first_pos - (sliding_window - 1), 0)
    chunk_lo = lax.div(kv_start, chunk)
    chunk_hi = _cdiv(kv_end, chunk)
    if num_kv_splits > 1:
        per_split = _cdiv(jnp.maximum(chunk_hi - chunk_lo, 0), num_kv_splits)
        chunk_lo = chunk_lo + split * per_split
        chunk_hi = jnp.minimum(chunk_lo + per_split, chunk_hi)

    q = q_ref[...]  # [rows, D]
    compute_dtype = q.dtype
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    row_pos = first_pos + lax.div(lax.broadcasted_iota(jnp.int32, (rows,), 0), group_pad)  # i32[rows]

    def body(c, carry):
        m_prev, l_prev, acc_prev = carry  # f32[rows], f32[rows], f32[rows, D]
        page_ids = page_indices_ref[seq, pl.ds(c * pages_per_chunk, pages_per_chunk)]  # i32[ppc]
        k = k_ref[layer, page_ids, :, head, :].reshape(chunk, head_dim)
        v = v_ref[layer, page_ids, :, head, :].reshape(chunk, head_dim)
        key_pos = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)  # i32[chunk]
        key_real = key_pos < kv_end  # beyond: unwritten slots (may hold NaN)
        s = lax.dot_general(
            q, k.astype(compute_dtype), (((1,), (1,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )  # f32[rows, chunk]
        if quantized:
            k_scale = k_scale_ref[layer, page_ids, :, head].reshape(chunk)
            s = s * k_scale[None, :]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = (key_pos[None, :] <= row_pos[:, None]) & key_real[None, :]
        if sliding_window is not None:
            mask = mask & (key_pos[None, :] > row_pos[:, None] - sliding_window)
        s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)  # f32[rows, chunk]
        l_next = alpha * l_prev + p.sum(axis=-1)
        if quantized:
            v_scale = v_scale_ref[layer, page_ids, :, head].reshape(chunk)
            p = p * v_scale[None, :]
        v = jnp.where(key_real[:, None], v.astype(compute_dtype), 0)
        pv = lax.dot_general(
            p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )  # f32[rows, D]
        return m_next, l_next, alpha[:, None] * acc_prev + pv

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(chunk_lo, chunk_hi, body, init)
    l_safe = jnp.where(l == 0.0, 1.0, l)
    out = acc / l_safe[:, None]
    if num_kv_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = out.astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = out
        m_ref[...] = m
        l_ref[...] = l


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------


def _validate(q, k_cache, v_cache, layer, md: RaggedBatch, sm_scale, sliding_window, soft_cap, k_scale, v_scale):
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [num_tokens, num_q_heads, head_dim]")
    if k_cache.ndim != 5:
        raise ValueError(f"{k_cache.shape=} must be [num_layers, num_pages, page_size, num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{v_cache.shape=} {v_cache.dtype=} must equal {k_cache.shape=} {k_cache.dtype=}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, _, num_kv_heads, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"{k_cache.shape=} head_dim must equal {q.shape=} head_dim")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if jnp.dtype(q.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"{q.dtype=} must be float32, bfloat16 or float16")
    quantized = k_scale is not None or v_scale is not None
    if quantized:
        if k_scale is None or v_scale is None:
            raise ValueError(f"{k_scale is None=} and {v_scale is None=} must be given together")
        if k_cache.dtype != jnp.int8:
            raise ValueError(f"{k_cache.dtype=} must be int8 when scales are given")
        if k_scale.shape != k_cache.shape[:4] or v_scale.shape != k_cache.shape[:4]:
            raise ValueError(f"{k_scale.shape=} {v_scale.shape=} must be {k_cache.shape[:4]=}")
        if k_scale.dtype != jnp.float32 or v_scale.dtype != jnp.float32:
            raise ValueError(f"{k_scale.dtype=} {v_scale.dtype=} must be float32")
    elif jnp.dtype(k_cache.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"{k_cache.dtype=} must be float32, bfloat16, float16 (or int8 with scales)")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"{layer=} must be an integer scalar")
    num_seqs = md.kv_lens.shape[0] if md.kv_lens.ndim == 1 else -1
    expected = {
        "cu_q_lens": (num_seqs + 1,),
        "kv_lens": (num_seqs,),
        "num_seqs": (1,),
    }
    for name, shape in expected.items():
        arr = getattr(md, name)
        if arr.shape != shape or arr.dtype != jnp.int32:
            raise ValueError(f"{name} {arr.shape=} {arr.dtype=} must be int32{list(shape)}")
    if md.page_indices.ndim != 2 or md.page_indices.shape[0] != num_seqs or md.page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices {md.page_indices.shape=} {md.page_indices.dtype=} must be int32[{num_seqs}, P]")
    if num_tokens < 1:
        raise ValueError(f"{num_tokens=} must be >= 1")
    if not isinstance(sm_scale, (int, float)):
        raise ValueError(f"{sm_scale=} must be a Python float")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{sliding_window=} must be None or a positive int")
    if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or soft_cap <= 0):
        raise ValueError(f"{soft_cap=} must be None or a positive float")
    return quantized


class _Tiles(NamedTuple):
    tile_seq: jax.Array  # i32[num_tiles]
    tile_first_pos: jax.Array  # i32[num_tiles]
    tile_last_pos: jax.Array  # i32[num_tiles]; -1 for empty tiles
    tile_token_ids: jax.Array  # i32[num_tiles, tile_tokens] flat token of each tile row (clamped)
    token_rows: jax.Array  # i32[T] flat tile row (tile * tile_tokens + i) of each token
    token_real: jax.Array  # bool[T] token belongs to a real sequence


def _make_tiles(md: RaggedBatch, num_tokens: int, cfg: KernelConfig, max_kv_len: int) -> _Tiles:
    """Cut each sequence's new tokens into q tiles (O(T + S) jnp)."""
    num_seqs = md.kv_lens.shape[0]
    bq = cfg.tile_tokens
    seq_real = jnp.arange(num_seqs, dtype=jnp.int32) < md.num_seqs[0]  # bool[S]
    cu = md.cu_q_lens
    q_lens = jnp.where(seq_real, cu[1:] - cu[:-1], 0)  # i32[S]
    kv_lens = jnp.where(seq_real, md.kv_lens, 0)  # i32[S]
    tiles_per_seq = (q_lens + bq - 1) // bq  # i32[S]
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_per_seq, dtype=jnp.int32)])
    tile = jnp.arange(cfg.num_tiles, dtype=jnp.int32)
    tile_real = tile < cu_tiles[-1]
    tile_seq = jnp.clip(jnp.searchsorted(cu_tiles, tile, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
    tile_tok0 = (tile - cu_tiles[tile_seq]) * bq  # offset of the tile within its sequence's new tokens
    tile_len = jnp.minimum(bq, q_lens[tile_seq] - tile_tok0)
    first_pos = kv_lens[tile_seq] - q_lens[tile_seq] + tile_tok0
    last_pos = jnp.minimum(first_pos + tile_len - 1, max_kv_len - 1)  # clamp: never read past the table
    tile_first_pos = jnp.where(tile_real, first_pos, 0)
    tile_last_pos = jnp.where(tile_real, last_pos, -1)
    token_ids = cu[tile_seq][:, None] + tile_tok0[:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :]
    tile_token_ids = jnp.clip(token_ids, 0, num_tokens - 1)

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    token_real = t < cu[md.num_seqs[0]]
    token_seq = jnp.clip(jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
    i = t - cu[token_seq]
    token_rows = (cu_tiles[token_seq] + i // bq) * bq + i % bq
    token_rows = jnp.clip(jnp.where(token_real, token_rows, 0), 0, cfg.num_tiles * bq - 1)
    return _Tiles(tile_seq, tile_first_pos, tile_last_pos, tile_token_ids, token_rows, token_real)


def whole_array_spec(shape) -> pl.BlockSpec:
    """The whole array as one block, every program (the kernel indexes it itself)."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def _compiler_params(lowering: str, num_warps: int | None, num_stages: int | None):
    if lowering == "triton":
        from jax.experimental.pallas import triton as pl_triton

        return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return None  # Mosaic GPU: pallas_call's default on GPU


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "interpret", "lowering", "max_q_len",
        "num_kv_splits", "q_rows", "kv_chunk_size", "num_warps", "num_stages",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, N, page_size, Hkv, D]
    v_cache: jax.Array,  # [L, N, page_size, Hkv, D]
    layer: jax.Array,  # i32[] layer to read (traced)
    kv_lens: jax.Array,  # i32[S] context length of each sequence, this step's tokens included
    page_indices: jax.Array,  # i32[S, P] physical page ids (unused entries: any valid page)
    cu_q_lens: jax.Array,  # i32[S+1] cumulative new-token counts
    num_seqs: jax.Array,  # i32[1] real sequences; the rest is padding
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | None = None,
    lowering: str = "triton",
    max_q_len: int | None = None,
    num_kv_splits: int | None = None,
    q_rows: int = 64,
    kv_chunk_size: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: jax.Array | None = None,  # f32[L, N, page_size, Hkv] with int8 caches
    v_scale: jax.Array | None = None,  # f32[L, N, page_size, Hkv]
) -> jax.Array:  # [T, Hq, D]
    """Attention of the step's new tokens over their paged context; returns [T, Hq, D].

    `max_q_len` (static, optional) is an upper bound on any sequence's new tokens in this batch;
    it must be right (a larger q_len is silently cut). `max_q_len=1`, or a bucket with T <= 2 S,
    selects one-token tiles and the decode kernel that splits the context over `num_kv_splits`
    programs (auto when None). Tokens of no real sequence
    (padding beyond `cu_q_lens[num_seqs]`) get zeros. `interpret=None` interprets unless the
    default backend is a GPU. Raises NotImplementedError for what the compiled kernel can't do.
    """
    md = RaggedBatch(kv_lens, page_indices, cu_q_lens, num_seqs)
    quantized = _validate(q, k_cache, v_cache, layer, md, sm_scale, sliding_window, soft_cap, k_scale, v_scale)
    if lowering not in LOWERINGS:
        raise ValueError(f"{lowering=} must be one of {LOWERINGS}")
    if max_q_len is not None and max_q_len < 1:
        raise ValueError(f"{max_q_len=} must be None or >= 1")
    if not _is_pow2(q_rows):
        raise ValueError(f"{q_rows=} must be a power of two")
    if kv_chunk_size is not None and not _is_pow2(kv_chunk_size):
        raise ValueError(f"{kv_chunk_size=} must be a power of two")
    if interpret is None:
        interpret = not _on_gpu()
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_pages, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs, pages_per_seq = md.page_indices.shape
    group = num_q_heads // num_kv_heads
    if not interpret:
        if lowering == "mosaic":
            raise NotImplementedError(
                "lowering='mosaic': Mosaic GPU stages whole-array pallas_call inputs in shared memory "
                "(the cache does not fit) and GMEM refs need plgpu layouts and async copies, outside "
                "the portable subset; use lowering='triton'")
        if not _is_pow2(page_size) or not _is_pow2(head_dim):
            raise NotImplementedError(f"{page_size=} and {head_dim=} must be powers of two for Triton")
        if head_dim < MIN_DOT_SIZE:
            raise NotImplementedError(f"{head_dim=} must be >= {MIN_DOT_SIZE} for Triton dots")

    cfg = choose_config(
        num_tokens=num_tokens, num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=group,
        page_size=page_size, pages_per_seq=pages_per_seq, max_q_len=max_q_len, q_rows=q_rows,
        kv_chunk_size=kv_chunk_size, num_kv_splits=num_kv_splits,
    )
    tiles = _make_tiles(md, num_tokens, cfg, pages_per_seq * page_size)
    bq, gp, rows, nt, splits = cfg.tile_tokens, cfg.group_pad, cfg.rows, cfg.num_tiles, cfg.num_kv_splits

    # q tiles: [nt, Hkv, rows, D], row r = token (r // gp) of the tile, query head (r % gp);
    # in the cache's dtype when it is a float one (the dots run in that dtype).
    q_t = q if quantized else q.astype(k_cache.dtype)
    q_t = q_t[tiles.tile_token_ids].reshape(nt, bq, num_kv_heads, group, head_dim)
    q_t = jnp.pad(q_t, ((0, 0), (0, 0), (0, 0), (0, gp - group), (0, 0)))
    q_t = q_t.transpose(0, 2, 1, 3, 4).reshape(nt, num_kv_heads, bq * gp, head_dim)
    q_t = jnp.pad(q_t, ((0, 0), (0, 0), (0, rows - bq * gp), (0, 0)))
    # Pad the page table to whole chunks (null page 0; those keys are masked).
    ppc = cfg.pages_per_chunk
    pages_pad = -(-pages_per_seq // ppc) * ppc
    page_indices = jnp.pad(md.page_indices, ((0, 0), (0, pages_pad - pages_per_seq)))

    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(
        _attention_kernel, sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap), sliding_window=sliding_window,
        group_pad=gp, pages_per_chunk=ppc, num_kv_splits=splits, quantized=quantized,
    )
    operands = [layer_arr, tiles.tile_seq, tiles.tile_first_pos, tiles.tile_last_pos, page_indices,
                q_t, k_cache, v_cache] + ([k_scale, v_scale] if quantized else [])
    in_specs = [whole_array_spec(x.shape) for x in operands]
    in_specs[5] = pl.BlockSpec((None, None, rows, head_dim), lambda t, h, k: (t, h, 0, 0))
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((nt, num_kv_heads, rows, head_dim), q_t.dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda t, h, k: (t, h, 0, 0))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((nt, num_kv_heads, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((nt, num_kv_heads, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((nt, num_kv_heads, splits, rows), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, None, None, rows, head_dim), lambda t, h, k: (t, h, k, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda t, h, k: (t, h, k, 0)),
            pl.BlockSpec((None, None, None, rows), lambda t, h, k: (t, h, k, 0)),
        )
    out = pl.pallas_call(
        kernel,
        grid=(nt, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(lowering, num_warps, num_stages),
        name="ragged_paged_attention",
    )(*operands)
    if splits > 1:
        out = merge_kv_splits(*out).astype(q.dtype)  # [nt, Hkv, rows, D]

    # Back to tokens: [nt, Hkv, rows, D] -> [nt * bq, Hq, D] -> [T, Hq, D].
    out = out[:, :, : bq * gp].reshape(nt, num_kv_heads, bq, gp, head_dim)[:, :, :, :group]
    out = out.transpose(0, 2, 1, 3, 4).reshape(nt * bq, num_q_heads, head_dim)
    out = out[tiles.token_rows]
    return jnp.where(tiles.token_real[:, None, None], out, 0).astype(q.dtype)


def merge_kv_splits(o, m, l):
    """Merge flash-decoding partials: o f32[..., K, R, D] normalised, m/l f32[..., K, R]."""
    m_max = m.max(axis=-2, keepdims=True)
    w = l * jnp.exp(m - m_max)  # [..., K, R]; 0 for empty splits
    w_sum = w.sum(axis=-2)  # [..., R]
    out = (o * w[..., None]).sum(axis=-3)
    return out / jnp.where(w_sum == 0.0, 1.0, w_sum)[..., None]


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, N, page_size, Hkv, D]
    v_cache: jax.Array,  # [L, N, page_size, Hkv, D]
    layer: jax.Array,  # i32[]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[L, N, page_size, Hkv] with int8 caches
    v_scale: jax.Array | None = None,
) -> jax.Array:  # [T, Hq, D]
    """Plain jnp, f32 math: gathers every sequence's whole page table (memory-hungry)."""
    md = RaggedBatch(kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, pages_per_seq = md.page_indices.shape
    page_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = num_q_heads // num_kv_heads
    max_len = pages_per_seq * page_size

    def gather(cache, scale):  # -> f32[S, max_len, Hkv, D]
        x = cache[layer][md.page_indices].astype(jnp.float32)  # [S, P, ps, Hkv, D]
        if scale is not None:
            x = x * scale[layer][md.page_indices][..., None]
        return x.reshape(num_seqs, max_len, num_kv_heads, head_dim)

    seq_real = jnp.arange(num_seqs) < md.num_seqs[0]
    kv_lens = jnp.where(seq_real, md.kv_lens, 0)
    key_pos = jnp.arange(max_len)
    written = key_pos[None, :] < kv_lens[:, None]  # [S, max_len]; beyond: garbage, maybe NaN
    k = jnp.where(written[:, :, None, None], gather(k_cache, k_scale), 0.0)
    v = jnp.where(written[:, :, None, None], gather(v_cache, v_scale), 0.0)

    t = jnp.arange(num_tokens)
    cu = md.cu_q_lens
    token_seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, num_seqs - 1)
    token_real = t < cu[md.num_seqs[0]]
    q_len = cu[token_seq + 1] - cu[token_seq]
    pos = kv_lens[token_seq] - q_len + (t - cu[token_seq])  # [T]

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    s = jnp.einsum("tkgd,tskd->tkgs", qg, k[token_seq], precision="highest") * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = key_pos[None, :] <= pos[:, None]  # [T, max_len]
    if sliding_window is not None:
        mask &= key_pos[None, :] > pos[:, None] - sliding_window
    mask &= token_real[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(mask[:, None, None, :], p, 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    o = jnp.einsum("tkgs,tskd->tkgd", p, v[token_seq], precision="highest")
    return o.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
