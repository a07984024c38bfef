"""ops.write_kv and the XLA ragged paged attention against a plain numpy reference."""


import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import ops
from jaxinfer.ops import xla_attention
from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache

PAGE_SIZE = 4
NUM_PAGES = 24
NUM_LAYERS = 2


def attention_reference(q, k_cache, v_cache, layer, md, sm_scale, sliding_window=None,
                        soft_cap=None):
    """Per sequence, per token, in float64: gather the context and softmax over it."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    cu, kv_lens, pages = (np.asarray(x) for x in (md.cu_q_lens, md.kv_lens, md.page_indices))
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[3]
    out = np.zeros_like(q)
    for s in range(len(kv_lens)):
        q_len, kv_len = cu[s + 1] - cu[s], kv_lens[s]
        if q_len == 0:
            continue
        ctx = np.arange(kv_len)
        k = k_cache[layer, pages[s, ctx // PAGE_SIZE], ctx % PAGE_SIZE]  # [kv_len, Hkv, D]
        v = v_cache[layer, pages[s, ctx // PAGE_SIZE], ctx % PAGE_SIZE]
        k = np.repeat(k, num_heads // num_kv_heads, axis=1)
        v = np.repeat(v, num_heads // num_kv_heads, axis=1)
        for i in range(q_len):
            pos = kv_len - q_len + i
            seen = ctx <= pos
            if sliding_window is not None:
                seen &= ctx > pos - sliding_window
            scores = np.einsum("hd,khd->hk", q[cu[s] + i], k[seen]) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[cu[s] + i] = np.einsum("hk,khd->hd", p, v[seen])
    return out


def make_case(rng, q_lens, kv_lens, *, num_tokens, num_seqs, pages_per_seq, num_heads=4,
              num_kv_heads=2, head_dim=8):
    """Random q and cache; every slot not holding a sequence's context is NaN (incl. page 0)."""
    k_cache = np.full((NUM_LAYERS, NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim), np.nan, np.float32)
    v_cache = k_cache.copy()
    free_pages = list(rng.permutation(np.arange(1, NUM_PAGES)))
    page_indices = np.zeros((num_seqs, pages_per_seq), np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    kv = np.zeros(num_seqs, np.int32)
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        n = -(-kv_len // PAGE_SIZE)
        page_indices[s, :n] = [free_pages.pop() for _ in range(n)]
        for pos in range(kv_len):
            page, off = page_indices[s, pos // PAGE_SIZE], pos % PAGE_SIZE
            k_cache[:, page, off] = rng.standard_normal((NUM_LAYERS, num_kv_heads, head_dim))
            v_cache[:, page, off] = rng.standard_normal((NUM_LAYERS, num_kv_heads, head_dim))
        cu[s + 1] = cu[s] + q_len
        kv[s] = kv_len
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    md = AttentionMetadata(slot_mapping=jnp.zeros(num_tokens, jnp.int32),
                           cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv),
                           page_indices=jnp.asarray(page_indices),
                           num_seqs=jnp.asarray([len(q_lens)], jnp.int32))
    return jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), md


def attention(q, k_cache, v_cache, layer, md, **kwargs):
    """ops.ragged_paged_attention under jit (eager dispatch of its many small ops is slow)."""
    return jax.jit(lambda q, k, v, layer, md: ops.ragged_paged_attention(q, k, v, layer, md, **kwargs))(
        q, k_cache, v_cache, jnp.int32(layer), md)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


CASES = {  # name: (q_lens, kv_lens, T, S, P)
    "decode": ([1, 1, 1], [5, 13, 1], 4, 4, 4),  # T <= 2S: one token per tile
    "prefill_chunks": ([9, 5, 1], [9, 14, 7], 32, 4, 4),  # q_tile 4, tiles split sequences
    "one_long_prefill": ([30], [37], 32, 1, 10),  # q_tile 16
    "mixed": ([6, 1, 2, 7], [6, 11, 3, 20], 16, 8, 6),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
def test_matches_reference(name, heads):
    q_lens, kv_lens, t, s, p = CASES[name]
    rng = np.random.default_rng(zlib.crc32(repr((name, heads)).encode()))
    q, k_cache, v_cache, md = make_case(rng, q_lens, kv_lens, num_tokens=t, num_seqs=s,
                                        pages_per_seq=p, num_heads=heads[0], num_kv_heads=heads[1])
    out = attention(q, k_cache, v_cache, 1, md, sm_scale=0.3, backend="xla")
    ref = attention_reference(q, k_cache, v_cache, 1, md, 0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, ref) < 1e-5
    assert not np.asarray(out)[sum(q_lens):].any()  # padding rows are zero


@pytest.mark.parametrize("name", ["decode", "prefill_chunks", "one_long_prefill"])
@pytest.mark.parametrize("window,soft_cap", [(5, None), (None, 2.0), (3, 1.5)])
def test_sliding_window_and_soft_cap_with_chunk_loop(monkeypatch, name, window, soft_cap):
    """A tiny element budget forces one page per online-softmax step (the while-loop path)."""
    monkeypatch.setattr(xla_attention, "_ELEMENT_BUDGET", 1)
    q_lens, kv_lens, t, s, p = CASES[name]
    rng = np.random.default_rng(7)
    q, k_cache, v_cache, md = make_case(rng, q_lens, kv_lens, num_tokens=t, num_seqs=s,
                                        pages_per_seq=p)
    out = attention(q, k_cache, v_cache, 0, md, sm_scale=0.5, sliding_window=window,
                    soft_cap=soft_cap, backend="xla")
    ref = attention_reference(q, k_cache, v_cache, 0, md, 0.5, window, soft_cap)
    assert rel_err(out, ref) < 1e-5


def test_chunk_and_tile_sizes_bound_memory():
    # 8B decode at batch 256 with 2k context: chunks stay under the element budget
    tiles, pages = 256, xla_attention.kv_chunk_pages(256, 1, 32, 8, 128, 16, 128)
    assert tiles * pages * 16 * 8 * 128 <= xla_attention._ELEMENT_BUDGET
    assert xla_attention.query_tile_size(256, 256) == 1
    assert xla_attention.query_tile_size(512, 8) == 32
    assert xla_attention.query_tile_size(64, 8) == 4
    assert xla_attention.query_tile_size(4096, 8) == 64


def test_bfloat16_inputs():
    rng = np.random.default_rng(3)
    q, k_cache, v_cache, md = make_case(rng, [3, 1], [8, 6], num_tokens=8, num_seqs=2,
                                        pages_per_seq=3)
    k_cache, v_cache = jnp.nan_to_num(k_cache), jnp.nan_to_num(v_cache)
    out = attention(q.astype(jnp.bfloat16), k_cache.astype(jnp.bfloat16),
                    v_cache.astype(jnp.bfloat16), 0, md, sm_scale=0.35, backend="xla")
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, attention_reference(q, k_cache, v_cache, 0, md, 0.35)) < 3e-2


def test_pallas_backend_falls_back_to_xla(monkeypatch):
    def cannot(*args, **kwargs):
        raise NotImplementedError("a case the kernel does not handle")

    monkeypatch.setattr(ops, "ragged_paged_attention_pallas", cannot)
    rng = np.random.default_rng(4)
    q, k_cache, v_cache, md = make_case(rng, [2, 1], [5, 3], num_tokens=4, num_seqs=2,
                                        pages_per_seq=2)
    with pytest.warns(UserWarning, match="XLA path"):
        out = attention(q, k_cache, v_cache, 0, md, sm_scale=0.3, backend="pallas")
    ref = attention(q, k_cache, v_cache, 0, md, sm_scale=0.3, backend="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    with pytest.raises(ValueError, match="backend"):
        ops.ragged_paged_attention(q, k_cache, v_cache, 0, md, sm_scale=0.3, backend="cuda")


def test_write_kv_writes_only_its_slots():
    shape = (NUM_LAYERS, 6, PAGE_SIZE, 2, 3)
    cache = KVCache(k=jnp.zeros(shape), v=jnp.zeros(shape))
    rng = np.random.default_rng(5)
    k = rng.standard_normal((3, 2, 3)).astype(np.float32)
    v = rng.standard_normal((3, 2, 3)).astype(np.float32)
    slots = np.array([5 * PAGE_SIZE + 3, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1], np.int32)
    new = jax.jit(functools.partial(ops.write_kv, backend="xla"))(
        cache, jnp.int32(1), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    expect_k, expect_v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for i, slot in enumerate(slots):
        expect_k[1, slot // PAGE_SIZE, slot % PAGE_SIZE] = k[i]
        expect_v[1, slot // PAGE_SIZE, slot % PAGE_SIZE] = v[i]
    np.testing.assert_array_equal(np.asarray(new.k), expect_k)
    np.testing.assert_array_equal(np.asarray(new.v), expect_v)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_head_major_write_is_the_token_major_write_transposed(dtype):
    """The "cpu" backend writes a head-major cache (KVCache); every value, and every scale of an
    int8 cache, lands where the token-major write puts it, transposed, in place."""
    from cpu_kernels.ragged_paged_attention import to_head_major
    from jaxinfer.ops.kv_cache import allocate_kv_cache
    from tests.test_kv_int8 import tiny_config

    config = tiny_config()
    rng = np.random.default_rng(7)
    k = jnp.asarray(rng.standard_normal((3, config.num_kv_heads, config.head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, config.num_kv_heads, config.head_dim)), jnp.float32)
    slots = jnp.asarray([5 * PAGE_SIZE + 3, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1], jnp.int32)
    token_major = jax.jit(functools.partial(ops.write_kv, backend="xla"))(
        allocate_kv_cache(config, 6, PAGE_SIZE, dtype), jnp.int32(1), k, v, slots)
    cache = allocate_kv_cache(config, 6, PAGE_SIZE, dtype, head_major=True)
    pointers = [x.unsafe_buffer_pointer() for x in cache if x is not None]
    head_major = jax.jit(functools.partial(ops.write_kv, backend="cpu"), donate_argnums=0)(
        cache, jnp.int32(1), k, v, slots)
    assert [x.unsafe_buffer_pointer() for x in head_major if x is not None] == pointers
    want = to_head_major(*token_major)
    for got, expected in zip(head_major, want):
        if expected is not None:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
