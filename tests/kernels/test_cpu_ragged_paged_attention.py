"""The CPU attention kernel (C++, XLA FFI) against the jnp reference and dense attention.
Unwritten slots are NaN: a read of the wrong page, or of a slot past the context, poisons the
output."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels.ragged_paged_attention import available, ragged_paged_attention, to_head_major
from pallas_kernels.kv_write import quantize_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.kernels.paged_batches import layout, make_paged_batch, naive_attention, rel_err

LAYER = 1
F32_TOL = 2e-5
# A mixed step: a fresh prefill (not a page multiple), a chunked prefill over earlier context,
# decodes (one of a 1-token sequence, one at a page multiple), a 1+3 verification.
MIXED = dict(q_lens=[19, 7, 1, 1, 4, 1], kv_lens=[19, 40, 1, 32, 23, 17])


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert available(), "the CPU kernel did not build (is a C++ compiler installed?)"


def kernel(b, layer, **kw):
    """The kernel on a test batch (token-major caches and scales, as the reference takes them)."""
    k, v, ks, vs = to_head_major(b.k_cache, b.v_cache, kw.pop("k_scale", None),
                                 kw.pop("v_scale", None))
    if ks is not None:
        kw.update(k_scale=ks, v_scale=vs)
    return ragged_paged_attention(b.q, k, v, layer, *layout(b), **kw)


def run(batch, layer=LAYER, **kw):
    sm_scale = 1.0 / math.sqrt(batch.q.shape[-1])
    out = jax.jit(lambda b: kernel(b, jnp.int32(layer), sm_scale=sm_scale, **kw))(batch)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any()
    assert (out[batch.num_tokens_real:] == 0).all()  # padding tokens
    return out


@pytest.mark.parametrize("page_size,head_dim,group", [
    (8, 64, 1), (16, 128, 3), (32, 64, 4), (16, 64, 8), (16, 96, 3), (4, 16, 2), (64, 64, 3),
])
def test_mixed_batch_against_dense_attention(page_size, head_dim, group):
    """Every page-size/head-dim specialisation and the generic path (D=96, page 4 and 64)."""
    batch = make_paged_batch(page_size, **MIXED, page_size=page_size, head_dim=head_dim,
                             num_kv_heads=2, group=group, num_seqs_pad=8, num_tokens_pad=40)
    out = run(batch)
    ref = naive_attention(batch, LAYER, sm_scale=1.0 / math.sqrt(head_dim))
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


def test_long_prefill_blocks_and_garbage_padding():
    """A prefill longer than one work item's token block, beside decodes; padded sequences
    beyond num_seqs carry garbage lengths, pages and tokens that must be ignored."""
    batch = make_paged_batch(3, q_lens=[75, 1, 1, 33], kv_lens=[140, 64, 3, 33], page_size=16,
                             head_dim=64, num_kv_heads=3, group=3, num_seqs_pad=8,
                             num_tokens_pad=128, garbage_padding=True)
    out = run(batch, layer=0)
    ref = naive_attention(batch, 0, sm_scale=0.125)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


@pytest.mark.parametrize("sliding_window,soft_cap", [(7, None), (13, 3.0), (None, 2.0), (1, None)])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    batch = make_paged_batch(11, **MIXED, page_size=8, head_dim=64, num_kv_heads=2, group=3,
                             num_seqs_pad=8, num_tokens_pad=40)
    out = run(batch, sliding_window=sliding_window, soft_cap=soft_cap)
    ref = naive_attention(batch, LAYER, sm_scale=0.125, sliding_window=sliding_window,
                          soft_cap=soft_cap)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 2), (64, 3), (64, 4), (64, 5), (64, 7),
                                            (64, 8), (128, 1), (128, 2), (128, 3), (128, 4),
                                            (128, 6)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (37, None), (None, 2.0),
                                                     (70, 5.0), (1, None)])
def test_decode_blocks(head_dim, group, dtype, sliding_window, soft_cap):
    """Decode rows at page size 16 (the register path, several pages per softmax update), GQA
    groups in one item up to 4 heads at head_dim 64 and 2 at 128, larger ones split into items
    of at most that many (64: 5 -> 3 + 2, 7 -> 4 + 3, 8 -> 4 + 4; 128: 3 -> 2 + 1, 6 -> 2 + 2 +
    2): contexts that end inside a page, on a page boundary, inside and past a block of pages,
    with a window that starts inside one; a 33-token prefill's last block is one token too."""
    kv_lens = [1, 15, 16, 17, 63, 64, 65, 130, 200, 333, 40]
    q_lens = [1] * 10 + [33]
    batch = make_paged_batch(12, q_lens=q_lens, kv_lens=kv_lens, page_size=16, head_dim=head_dim,
                             num_kv_heads=2, group=group, num_seqs_pad=12, num_tokens_pad=48)
    k, v = batch.k_cache.astype(dtype), batch.v_cache.astype(dtype)
    out = run(batch._replace(k_cache=k, v_cache=v), sliding_window=sliding_window,
              soft_cap=soft_cap)
    ref = ragged_paged_attention_reference(batch.q, k, v, LAYER, *layout(batch),
                                           sm_scale=1.0 / math.sqrt(head_dim),
                                           sliding_window=sliding_window, soft_cap=soft_cap)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_caches(dtype):
    """16-bit caches are widened exactly: equal to the reference on the same 16-bit pages."""
    batch = make_paged_batch(5, **MIXED, page_size=16, head_dim=64, num_kv_heads=2, group=4,
                             num_seqs_pad=8, num_tokens_pad=40)
    k, v = batch.k_cache.astype(dtype), batch.v_cache.astype(dtype)
    out = run(batch._replace(k_cache=k, v_cache=v))
    ref = ragged_paged_attention_reference(batch.q, k, v, LAYER, *layout(batch), sm_scale=0.125)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


# head_dim 64 and 128 take the decode path (every token an item of its own), 32 the general one;
# the scales of slots never written are NaN, which neither may let into a result
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_int8_pages(head_dim):
    batch = make_paged_batch(6, **MIXED, page_size=16, head_dim=head_dim, num_kv_heads=2, group=4,
                             num_seqs_pad=8, num_tokens_pad=40)
    unwritten = jnp.isnan(batch.k_cache).any(-1)  # [L, N, page_size, Hkv]
    kq, ks = quantize_kv(jnp.nan_to_num(batch.k_cache))
    vq, vs = quantize_kv(jnp.nan_to_num(batch.v_cache))
    ks, vs = jnp.where(unwritten, jnp.nan, ks), jnp.where(unwritten, jnp.nan, vs)
    out = run(batch._replace(k_cache=kq, v_cache=vq), k_scale=ks, v_scale=vs)
    assert not jnp.isnan(out[:batch.num_tokens_real]).any()
    sm_scale = 1.0 / math.sqrt(head_dim)
    ref = ragged_paged_attention_reference(batch.q, kq, vq, LAYER, *layout(batch),
                                           sm_scale=sm_scale, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL


def test_bf16_queries_come_back_bf16():
    batch = make_paged_batch(8, **MIXED, page_size=16, head_dim=64, num_kv_heads=2, group=2,
                             num_seqs_pad=8, num_tokens_pad=40, dtype=jnp.bfloat16)
    out = run(batch)
    ref = ragged_paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, LAYER,
                                           *layout(batch), sm_scale=0.125)
    assert rel_err(out, ref, batch.num_tokens_real) < 1e-2  # the output is rounded to bf16


def _small_batch():
    return make_paged_batch(0, q_lens=[3, 1], kv_lens=[5, 9], page_size=8, head_dim=64,
                            num_kv_heads=2, group=2, num_seqs_pad=2, num_tokens_pad=4)


@pytest.mark.parametrize("change,match", [
    (lambda b: b._replace(q=b.q[0]), "q.shape"),
    (lambda b: b._replace(q=b.q[:, :3]), "does not fit"),
    (lambda b: b._replace(v_cache=b.v_cache[:, :-1]), "v_cache.shape"),
    (lambda b: b._replace(k_cache=b.k_cache.astype(jnp.int32),
                          v_cache=b.v_cache.astype(jnp.int32)), "k_cache.dtype"),
    (lambda b: b._replace(md=b.md._replace(kv_lens=b.md.kv_lens.astype(jnp.float32))), "kv_lens"),
    (lambda b: b._replace(md=b.md._replace(page_indices=b.md.page_indices[0])), "page_indices"),
    (lambda b: b._replace(md=b.md._replace(cu_q_lens=b.md.cu_q_lens[:-1])), "cu_q_lens"),
])
def test_validation(change, match):
    b = change(_small_batch())
    with pytest.raises(ValueError, match=match):
        kernel(b, 0, sm_scale=0.1)


def test_token_major_caches_are_refused():
    b = _small_batch()
    with pytest.raises(ValueError, match="head-major"):
        ragged_paged_attention(b.q, b.k_cache, b.v_cache, 0, *layout(b), sm_scale=0.1)


def test_int8_needs_scales_and_large_pages_are_refused():
    b = _small_batch()
    with pytest.raises(ValueError, match="k_scale"):
        kernel(b._replace(k_cache=b.k_cache.astype(jnp.int8), v_cache=b.v_cache.astype(jnp.int8)),
               0, sm_scale=0.1)
    big = make_paged_batch(0, q_lens=[1], kv_lens=[3], page_size=128, head_dim=16,
                           num_kv_heads=1, group=1)
    with pytest.raises(NotImplementedError, match="page_size"):
        kernel(big, 0, sm_scale=0.1)


def test_binary_cache_key_follows_the_source(tmp_path, monkeypatch):
    """Another source text or compiler output gives another binary (no stale kernel is loaded)."""
    compiler = build._compiler()
    assert compiler is not None
    key = build._binary_key(b"int x;", compiler)
    assert key == build._binary_key(b"int x;", compiler)
    assert key != build._binary_key(b"int y;", compiler)
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    assert build.cache_dir() == tmp_path / "cpu_kernels"


def test_all_padding_batch_returns_zeros():
    """num_seqs = 0 (the engine's warm-up step): no work at all, zeros out, and no wait on
    work that was never scheduled."""
    b = make_paged_batch(1, q_lens=[2, 1], kv_lens=[5, 9], page_size=8, head_dim=64,
                         num_kv_heads=2, group=2, num_seqs_pad=4, num_tokens_pad=8)
    b = b._replace(md=b.md._replace(num_seqs=jnp.zeros((1,), jnp.int32)), num_tokens_real=0)
    out = run(b)
    assert (out == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (64, 7), (128, 3)])
def test_a_tokens_row_is_the_same_bit_for_bit_in_any_chunk_or_step(dtype, head_dim, group):
    """A sequence's 1 + 4 new tokens (a speculative verification) and a 20-token prefill chunk
    beside a decode: each row is exactly the row a step of that token alone gives, so neither
    speculation nor chunking can change greedy output (a last-bit difference would, under int8
    activations). A group of 7 (Qwen2's) takes the same path in two items per KV head, a group
    of 3 at head_dim 128 in two as well."""
    batch = make_paged_batch(21, q_lens=[5, 1, 20], kv_lens=[70, 33, 20], page_size=16,
                             head_dim=head_dim, num_kv_heads=3, group=group, num_seqs_pad=4,
                             num_tokens_pad=32)
    batch = batch._replace(k_cache=batch.k_cache.astype(dtype), v_cache=batch.v_cache.astype(dtype))
    out = run(batch)
    ref = ragged_paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, LAYER,
                                           *layout(batch), sm_scale=1.0 / math.sqrt(head_dim))
    assert rel_err(out, ref, batch.num_tokens_real) < F32_TOL
    md = batch.md
    # (sequence, its context up to the token, the token's row in the step)
    for seq, kv_len, row in [(0, 66 + i, i) for i in range(5)] + [(2, 1, 6), (2, 8, 13),
                                                                  (2, 20, 25)]:
        alone = md._replace(cu_q_lens=jnp.asarray([0, 1, 1, 1, 1], jnp.int32),
                            kv_lens=md.kv_lens.at[0].set(kv_len),
                            page_indices=md.page_indices.at[0].set(md.page_indices[seq]),
                            num_seqs=jnp.asarray([1], jnp.int32))
        one = run(batch._replace(q=batch.q.at[0].set(batch.q[row]), md=alone, q_lens=[1],
                                 kv_lens=[kv_len], num_tokens_real=1))
        np.testing.assert_array_equal(one[0], out[row])
