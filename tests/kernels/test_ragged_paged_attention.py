"""ragged_paged_attention (interpret mode on the CPU) against its jnp reference, and the
reference against dense per-sequence attention. Unwritten slots are NaN: a wrong-page read
poisons the output."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import quantize_kv
from pallas_kernels.ragged_paged_attention import (
    choose_config,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from tests.kernels.paged_batches import INTERPRET, layout, make_paged_batch, naive_attention, rel_err

LAYER = 1
F32_TOL = 2e-5
BF16_TOL = 3e-2

# A mixed step: a fresh prefill (not a page multiple), a chunked prefill over earlier context,
# decodes (one of a 1-token sequence, one at a page multiple), a 1+3 verification.
MIXED = dict(q_lens=[19, 7, 1, 1, 4, 1], kv_lens=[19, 40, 1, 32, 23, 17])


def run(batch, **kw):
    sm_scale = 1.0 / math.sqrt(batch.q.shape[-1])
    out = ragged_paged_attention(batch.q, batch.k_cache, batch.v_cache, jnp.int32(LAYER), *layout(batch),
                                 sm_scale=sm_scale, interpret=INTERPRET, **kw)
    ref_kw = {k: kw[k] for k in ("sliding_window", "soft_cap", "k_scale", "v_scale") if k in kw}
    ref = ragged_paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, LAYER, *layout(batch),
                                           sm_scale=sm_scale, **ref_kw)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out).any()
    assert (out[batch.num_tokens_real:] == 0).all()  # padding tokens
    return out, ref


@pytest.mark.parametrize("page_size,head_dim,group,dtype", [
    (8, 64, 1, jnp.float32),
    (16, 128, 3, jnp.float32),
    (32, 64, 4, jnp.float32),
    (16, 64, 8, jnp.float32),
    (8, 128, 3, jnp.bfloat16),
    (32, 64, 8, jnp.bfloat16),
])
def test_mixed_batch(page_size, head_dim, group, dtype):
    batch = make_paged_batch(page_size, **MIXED, page_size=page_size, head_dim=head_dim,
                             num_kv_heads=2, group=group, dtype=dtype, num_seqs_pad=8,
                             num_tokens_pad=40)
    out, ref = run(batch)
    assert rel_err(out, ref, batch.num_tokens_real) < (F32_TOL if dtype == jnp.float32 else BF16_TOL)


@pytest.mark.parametrize("page_size,group,num_kv_splits", [(8, 3, None), (16, 1, 1), (32, 8, 4), (16, 4, 3)])
def test_decode_split_kv(page_size, group, num_kv_splits):
    kv_lens = [1, page_size, 2 * page_size + 3, 50, 97]
    batch = make_paged_batch(7, q_lens=[1] * 5, kv_lens=kv_lens, page_size=page_size, head_dim=64,
                             num_kv_heads=2, group=group, num_seqs_pad=8, num_tokens_pad=8)
    out, ref = run(batch, max_q_len=1, num_kv_splits=num_kv_splits, kv_chunk_size=16)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


def test_decode_like_bucket_with_a_prefill():
    """T <= 2 S without max_q_len: one-token tiles and split context, also for a 9-token prefill."""
    batch = make_paged_batch(4, q_lens=[9, 1, 1, 1, 1, 1], kv_lens=[9, 70, 1, 16, 33, 2], page_size=16,
                             head_dim=64, num_kv_heads=2, group=4, num_seqs_pad=8, num_tokens_pad=16)
    out, ref = run(batch)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


def test_f32_queries_over_a_bf16_cache():
    """q in f32 over a bf16 cache: the dots run in bf16, the output comes back in f32."""
    batch = make_paged_batch(9, **MIXED, page_size=16, head_dim=64, num_kv_heads=2, group=2,
                             dtype=jnp.bfloat16, num_seqs_pad=8, num_tokens_pad=40)
    batch = batch._replace(q=batch.q.astype(jnp.float32))
    out, ref = run(batch)
    assert rel_err(out, ref, batch.num_tokens_real) < BF16_TOL


def test_verification_tiles():
    """1 + k speculative verification: max_q_len=4 gives 4-token tiles."""
    batch = make_paged_batch(3, q_lens=[4, 4, 1, 3], kv_lens=[4, 30, 9, 64], page_size=16,
                             head_dim=64, num_kv_heads=2, group=3, num_seqs_pad=8, num_tokens_pad=16)
    out, ref = run(batch, max_q_len=4)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


@pytest.mark.parametrize("sliding_window,soft_cap,max_q_len", [
    (7, None, None), (13, 3.0, None), (20, 2.0, 1),
])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap, max_q_len):
    lens = MIXED if max_q_len is None else dict(q_lens=[1, 1, 1], kv_lens=[5, 33, 70])
    batch = make_paged_batch(11, **lens, page_size=8, head_dim=64, num_kv_heads=2, group=3,
                             num_seqs_pad=8, num_tokens_pad=40 if max_q_len is None else 8)
    out, ref = run(batch, sliding_window=sliding_window, soft_cap=soft_cap, max_q_len=max_q_len,
                   num_kv_splits=None if max_q_len is None else 2)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


def test_padding_sequences_are_ignored_and_one_executable_serves_the_bucket():
    """Padded sequences beyond num_seqs carry garbage lengths, pages and tokens; other batches
    of the same bucket (different num_seqs, lengths) reuse the compiled call."""
    kw = dict(page_size=16, head_dim=64, num_kv_heads=2, group=3, num_seqs_pad=8,
              num_tokens_pad=40, pages_per_seq=4, num_pages=40)
    sizes_before = ragged_paged_attention._cache_size()
    for seed, lens in enumerate([MIXED | dict(kv_lens=[19, 40, 1, 32, 23, 17]),
                                 dict(q_lens=[30, 2], kv_lens=[30, 64]),
                                 dict(q_lens=[1, 1, 1, 1, 1, 1, 1], kv_lens=[3, 9, 64, 17, 16, 1, 50])]):
        batch = make_paged_batch(seed, **lens, garbage_padding=True, **kw)
        out, ref = run(batch)
        assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL
    assert ragged_paged_attention._cache_size() - sizes_before == 1


def test_int8_kv_pages():
    """int8 pages with per-token, per-head scales: exact against the reference on the same
    quantised pages, and close to the unquantised attention."""
    batch = make_paged_batch(5, **MIXED, page_size=16, head_dim=128, num_kv_heads=2, group=4,
                             num_seqs_pad=8, num_tokens_pad=40)
    kq, ks = quantize_kv(jnp.nan_to_num(batch.k_cache))
    vq, vs = quantize_kv(jnp.nan_to_num(batch.v_cache))
    qbatch = batch._replace(k_cache=kq, v_cache=vq)
    out, ref_q = run(qbatch, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref_q, batch.num_tokens_real) < F32_TOL
    ref = ragged_paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, LAYER, *layout(batch),
                                           sm_scale=1.0 / math.sqrt(128))
    assert rel_err(out, ref, batch.num_tokens_real) < 2e-2  # measured 9e-3 (a bf16 cache: 4e-3)


@pytest.mark.parametrize("page_size,group,sliding_window,soft_cap", [
    (8, 1, None, None), (16, 3, 5, None), (32, 4, None, 2.5), (8, 8, 9, 4.0),
])
def test_reference_matches_dense_attention(page_size, group, sliding_window, soft_cap):
    batch = make_paged_batch(2, **MIXED, page_size=page_size, head_dim=64, num_kv_heads=2,
                             group=group, num_seqs_pad=8, num_tokens_pad=40)
    kw = dict(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    ref = ragged_paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, LAYER, *layout(batch), **kw)
    assert not np.isnan(np.asarray(ref)).any()
    assert (np.asarray(ref)[batch.num_tokens_real:] == 0).all()
    assert rel_err(ref, naive_attention(batch, LAYER, **kw), batch.num_tokens_real) < 1e-5


def test_choose_config_bounds():
    cfg = choose_config(num_tokens=64, num_seqs=8, num_kv_heads=2, group=3, page_size=16,
                        pages_per_seq=8, max_q_len=None, q_rows=64, kv_chunk_size=None, num_kv_splits=None)
    assert (cfg.group_pad, cfg.tile_tokens, cfg.rows, cfg.num_kv_splits) == (4, 16, 64, 1)
    assert cfg.num_tiles * cfg.tile_tokens >= 64 and cfg.num_tiles >= 8  # any split of 64 tokens fits
    dec = choose_config(num_tokens=8, num_seqs=8, num_kv_heads=2, group=1, page_size=8,
                        pages_per_seq=64, max_q_len=1, q_rows=64, kv_chunk_size=None, num_kv_splits=None)
    assert (dec.tile_tokens, dec.rows, dec.num_tiles, dec.pages_per_chunk) == (1, 16, 8, 16)
    assert dec.num_kv_splits == 4  # capped by the 4 chunks of a full page table
    like = choose_config(num_tokens=16, num_seqs=8, num_kv_heads=8, group=4, page_size=16,
                         pages_per_seq=512, max_q_len=None, q_rows=64, kv_chunk_size=None, num_kv_splits=None)
    assert (like.tile_tokens, like.num_tiles, like.num_kv_splits) == (1, 16, 8)  # 16 * 8 * 8 >= 528 programs


def _small_batch(dtype=jnp.float32):
    return make_paged_batch(0, q_lens=[3, 1], kv_lens=[5, 9], page_size=8, head_dim=64,
                            num_kv_heads=2, group=2, dtype=dtype, num_seqs_pad=2, num_tokens_pad=4)


@pytest.mark.parametrize("change,match", [
    (lambda b: b._replace(q=b.q[0]), "q.shape"),
    (lambda b: b._replace(q=b.q[:, :3]), "num_q_heads"),
    (lambda b: b._replace(k_cache=b.k_cache.astype(jnp.int8), v_cache=b.v_cache.astype(jnp.int8)), "k_cache.dtype"),
    (lambda b: b._replace(v_cache=b.v_cache[:, :-1]), "v_cache.shape"),
    (lambda b: b._replace(md=b.md._replace(kv_lens=b.md.kv_lens.astype(jnp.float32))), "kv_lens"),
    (lambda b: b._replace(md=b.md._replace(page_indices=b.md.page_indices[0])), "page_indices"),
    (lambda b: b._replace(md=b.md._replace(cu_q_lens=b.md.cu_q_lens[:-1])), "cu_q_lens"),
])
def test_validation(change, match):
    b = change(_small_batch())
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(b.q, b.k_cache, b.v_cache, 0, *layout(b), sm_scale=0.1)


def test_validation_of_options():
    b = _small_batch()
    call = functools.partial(ragged_paged_attention, b.q, b.k_cache, b.v_cache, 0, *layout(b), sm_scale=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        call(sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        call(soft_cap=-1.0)
    with pytest.raises(ValueError, match="lowering"):
        call(lowering="cuda")
    with pytest.raises(ValueError, match="k_scale"):
        call(k_scale=jnp.ones(b.k_cache.shape[:4]))


def test_not_implemented_when_compiled():
    """What the compiled kernel can't do raises NotImplementedError at trace time (ops falls back)."""
    b = _small_batch()
    call = functools.partial(ragged_paged_attention, b.q, b.k_cache, b.v_cache, 0, *layout(b), sm_scale=0.1,
                             interpret=False)
    with pytest.raises(NotImplementedError, match="mosaic"):
        call(lowering="mosaic")
    odd = make_paged_batch(0, q_lens=[3], kv_lens=[5], page_size=6, head_dim=64, num_kv_heads=1, group=1)
    with pytest.raises(NotImplementedError, match="page_size"):
        ragged_paged_attention(odd.q, odd.k_cache, odd.v_cache, 0, *layout(odd), sm_scale=0.1, interpret=False)


@pytest.mark.parametrize("dtype,max_q_len,extra", [
    (jnp.bfloat16, None, {}),
    (jnp.bfloat16, 1, dict(sliding_window=64, soft_cap=30.0)),
    (jnp.float32, 4, {}),
    ("int8", 1, {}),
])
def test_lowers_to_triton(dtype, max_q_len, extra):
    """Cross-platform lowering for CUDA on the CPU: every op of the kernel has a Triton lowering
    and every in-kernel array has a power-of-two size. (Triton's own compile is not run here.)"""
    num_tokens, num_seqs = 64, 16
    q_dtype = jnp.bfloat16 if dtype == "int8" else dtype
    kv_dtype = jnp.int8 if dtype == "int8" else dtype
    q = jax.ShapeDtypeStruct((num_tokens, 12, 64), q_dtype)
    kv = jax.ShapeDtypeStruct((2, 64, 16, 3, 64), kv_dtype)
    scales = {}
    if dtype == "int8":
        scales = dict(k_scale=jax.ShapeDtypeStruct((2, 64, 16, 3), jnp.float32),
                      v_scale=jax.ShapeDtypeStruct((2, 64, 16, 3), jnp.float32))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = (i32(num_seqs), i32(num_seqs, 8), i32(num_seqs + 1), i32(1))  # kv_lens .. num_seqs
    fn = functools.partial(ragged_paged_attention, sm_scale=0.125, interpret=False, max_q_len=max_q_len,
                           **extra)
    lowered = jax.jit(fn).trace(q, kv, kv, i32(), *md, **scales).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text() or "triton_kernel_call" in lowered.as_text()
