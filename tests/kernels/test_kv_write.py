"""write_kv (Pallas, aliased outputs) against write_kv_reference (XLA scatter); both in place
under donation; int8 quantisation round trip."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import dequantize_kv, quantize_kv, write_kv, write_kv_reference
from tests.kernels.paged_batches import INTERPRET

L, N, HKV = 2, 12, 3


def _inputs(seed, *, page_size, head_dim, num_tokens, num_real, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    k_cache = jnp.asarray(rng.standard_normal((L, N, page_size, HKV, head_dim)), dtype)
    v_cache = jnp.asarray(rng.standard_normal((L, N, page_size, HKV, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((num_tokens, HKV, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, HKV, head_dim)), dtype)
    slots = np.zeros(num_tokens, np.int32)  # padding tokens -> the null page
    slots[:num_real] = rng.permutation(np.arange(page_size, N * page_size))[:num_real]
    return k_cache, v_cache, k, v, jnp.asarray(slots)


def _real_pages(x):
    return np.asarray(x[:, 1:].astype(jnp.float32))  # page 0 is the null page: padding lands there


@pytest.mark.parametrize("page_size,head_dim,num_tokens,num_real,dtype", [
    (8, 64, 13, 13, jnp.float32),
    (16, 128, 32, 20, jnp.bfloat16),
    (32, 64, 5, 3, jnp.float32),
])
def test_write_kv_matches_scatter(page_size, head_dim, num_tokens, num_real, dtype):
    args = _inputs(0, page_size=page_size, head_dim=head_dim, num_tokens=num_tokens,
                   num_real=num_real, dtype=dtype)
    out = write_kv(*args[:2], jnp.int32(1), *args[2:], interpret=INTERPRET)
    ref = write_kv_reference(*args[:2], 1, *args[2:])
    for o, r, before in zip(out, ref, args[:2]):
        np.testing.assert_array_equal(_real_pages(o), _real_pages(r))
        np.testing.assert_array_equal(np.asarray(o[0]), np.asarray(before[0]))  # other layer untouched
    # The written rows are there.
    slots = np.asarray(args[4][:num_real])
    np.testing.assert_array_equal(np.asarray(out[0][1, slots // page_size, slots % page_size]),
                                  np.asarray(args[2][:num_real]))


def test_write_kv_int8_matches_scatter_and_round_trips():
    k_cache, v_cache, k, v, slots = _inputs(1, page_size=16, head_dim=64, num_tokens=16, num_real=11)
    kq = jnp.zeros(k_cache.shape, jnp.int8)
    scale = jnp.zeros(k_cache.shape[:4], jnp.float32)
    out = write_kv(kq, kq, jnp.int32(0), k, v, slots, scale, scale, interpret=INTERPRET)
    ref = write_kv_reference(kq, kq, 0, k, v, slots, scale, scale)
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(_real_pages(o), _real_pages(r))
    s = np.asarray(slots[:11])
    back = dequantize_kv(out[0][0, s // 16, s % 16], out[2][0, s // 16, s % 16])
    err = np.abs(np.asarray(back) - np.asarray(k[:11])).max() / np.abs(np.asarray(k[:11])).max()
    assert err < 1 / 127  # half a quantisation step of the largest value, at most


def test_quantize_kv_zero_rows():
    q, s = quantize_kv(jnp.zeros((2, 3, 8)))
    assert not np.isnan(np.asarray(dequantize_kv(q, s))).any()


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_write_is_in_place_under_donation(impl):
    """The donated cache buffer is the returned buffer: nothing is copied."""
    if impl == "pallas":
        fn = functools.partial(write_kv, interpret=INTERPRET)
    else:
        fn = write_kv_reference
    step = jax.jit(fn, donate_argnums=(0, 1))
    k_cache, v_cache, k, v, slots = _inputs(2, page_size=8, head_dim=64, num_tokens=8, num_real=8)
    pointers = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    k_out, v_out = step(k_cache, v_cache, jnp.int32(1), k, v, slots)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    assert k_cache.is_deleted()


def test_write_kv_validation():
    k_cache, v_cache, k, v, slots = _inputs(3, page_size=8, head_dim=64, num_tokens=4, num_real=4)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k_cache, v_cache, 0, k, v, slots[:3])
    with pytest.raises(ValueError, match="k.dtype"):
        write_kv(k_cache, v_cache, 0, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), slots)
    with pytest.raises(ValueError, match="k.shape"):
        write_kv(k_cache, v_cache, 0, k[:, :2], v[:, :2], slots)


def test_write_kv_lowers_to_triton():
    sds = jax.ShapeDtypeStruct
    fn = functools.partial(write_kv, interpret=False)
    lowered = jax.jit(fn).trace(
        sds((2, 16, 16, 3, 64), jnp.bfloat16), sds((2, 16, 16, 3, 64), jnp.bfloat16), sds((), jnp.int32),
        sds((24, 3, 64), jnp.bfloat16), sds((24, 3, 64), jnp.bfloat16), sds((24,), jnp.int32),
    ).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
