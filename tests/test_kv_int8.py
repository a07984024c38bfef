"""int8 KV pages: quantization, the int8 write and attention paths in ops, sizing, and the tiny
engine with kv_cache_dtype="int8" against the float engine."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import ops
from jaxinfer.ops import xla_attention
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.ops.kv_cache import (
    KVCache,
    allocate_kv_cache,
    dequantize_kv,
    kv_cache_bytes_per_page,
    quantize_kv,
)
from tests.test_ops import CASES, PAGE_SIZE, attention, attention_reference, make_case, rel_err


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=6,
                num_kv_heads=2, head_dim=8)
    return ModelConfig(**{**base, **kw})


def quantize_cache(k_cache, v_cache):
    """Float caches -> int8 KVCache (NaN slots get NaN scales: masking must ignore them)."""
    (kq, ks), (vq, vs) = quantize_kv(k_cache), quantize_kv(v_cache)
    return KVCache(kq, vq, ks, vs)


def test_quantize_error_bound_and_range():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32) * rng.uniform(0.01, 50, (5, 3, 1))
    x[0, 0] = 0.0  # an all-zero row
    q, scale = quantize_kv(jnp.asarray(x))
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (5, 3)
    q = np.asarray(q)
    assert q.min() >= -127 and q.max() <= 127
    assert (np.abs(q).max(-1)[1:] == 127).all()  # the absmax maps to +-127 (non-zero rows)
    back = np.asarray(dequantize_kv(jnp.asarray(q), scale))
    amax = np.abs(x).max(-1, keepdims=True)
    assert (np.abs(back - x) <= amax / 254 * (1 + 1e-5) + 1e-30).all()  # half a step
    assert not back[0, 0].any() and np.isfinite(back).all()


def test_allocate_and_bytes_per_page():
    config = tiny_config()
    cache = allocate_kv_cache(config, 4, PAGE_SIZE, "int8")
    assert cache.quantized and cache.k.dtype == jnp.int8
    assert cache.k_scale.shape == cache.v_scale.shape == (2, 4, PAGE_SIZE, 2)
    assert cache.k_scale.dtype == jnp.float32 and not np.asarray(cache.k_scale).any()
    assert sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) == \
        4 * kv_cache_bytes_per_page(config, PAGE_SIZE, jnp.int8)
    fcache = allocate_kv_cache(config, 4, PAGE_SIZE, jnp.bfloat16)
    assert not fcache.quantized and fcache.k_scale is None
    assert sum(x.nbytes for x in jax.tree_util.tree_leaves(fcache)) == \
        4 * kv_cache_bytes_per_page(config, PAGE_SIZE, "bfloat16")
    # SmolLM2 shapes (head_dim 64): 1 + 4/64 bytes per value
    smol = tiny_config(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    int8, bf16, f32 = (kv_cache_bytes_per_page(smol, 16, d) for d in ("int8", "bfloat16", "float32"))
    assert int8 / bf16 == pytest.approx(1.0625 / 2) and int8 / f32 == pytest.approx(1.0625 / 4)
    with pytest.raises(ValueError, match="dtype"):
        allocate_kv_cache(config, 4, PAGE_SIZE, jnp.int32)


@pytest.mark.parametrize("bad", ["int4", "fp8", "float64"])
def test_engine_config_validates_kv_cache_dtype(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=bad)
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"


def test_write_kv_int8_round_trip_at_exact_slots():
    cache = allocate_kv_cache(tiny_config(), 6, PAGE_SIZE, "int8")
    rng = np.random.default_rng(1)
    k = rng.standard_normal((3, 2, 8)).astype(np.float32) * 4
    v = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = np.array([5 * PAGE_SIZE + 3, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1], np.int32)
    write = jax.jit(functools.partial(ops.write_kv, backend="xla"), donate_argnums=0)
    pointers = [x.unsafe_buffer_pointer() for x in cache]
    new = write(cache, jnp.int32(1), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    assert [x.unsafe_buffer_pointer() for x in new] == pointers  # in place, scales included
    written = np.zeros(new.k_scale.shape, bool)
    for i, slot in enumerate(slots):
        at = (1, slot // PAGE_SIZE, slot % PAGE_SIZE)
        written[at] = True
        for cache_q, cache_s, x in ((new.k, new.k_scale, k[i]), (new.v, new.v_scale, v[i])):
            want_q, want_s = quantize_kv(jnp.asarray(x))
            np.testing.assert_array_equal(np.asarray(cache_q[at]), np.asarray(want_q))
            np.testing.assert_array_equal(np.asarray(cache_s[at]), np.asarray(want_s))
            back = np.asarray(dequantize_kv(cache_q[at], cache_s[at]))
            assert np.abs(back - x).max() <= np.abs(x).max() / 254 * (1 + 1e-5)
    for arr in new:  # nothing else touched
        assert not np.asarray(arr)[~written].any()


@pytest.mark.parametrize("name", ["decode", "prefill_chunks", "mixed"])
@pytest.mark.parametrize("chunk_loop", [False, True])
def test_xla_int8_attention_matches_dequantized_reference(monkeypatch, name, chunk_loop):
    """decode (rows <= D) scales logits/probs, prefill tiles (rows > D) dequantize K/V chunks."""
    if chunk_loop:
        monkeypatch.setattr(xla_attention, "_ELEMENT_BUDGET", 1)  # one page per online-softmax step
    q_lens, kv_lens, t, s, p = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k_cache, v_cache, md = make_case(rng, q_lens, kv_lens, num_tokens=t, num_seqs=s,
                                        pages_per_seq=p, num_heads=6, num_kv_heads=2)
    cache = quantize_cache(k_cache, v_cache)
    out = attention(q, cache.k, cache.v, 1, md, sm_scale=0.3, backend="xla",
                    k_scale=cache.k_scale, v_scale=cache.v_scale)
    assert out.dtype == q.dtype and np.isfinite(np.asarray(out)).all()
    ref = attention_reference(q, dequantize_kv(cache.k, cache.k_scale),
                              dequantize_kv(cache.v, cache.v_scale), 1, md, 0.3)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, attention_reference(q, k_cache, v_cache, 1, md, 0.3)) < 3e-2
    assert not np.asarray(out)[sum(q_lens):].any()


def test_xla_int8_attention_bfloat16_queries():
    rng = np.random.default_rng(3)
    q, k_cache, v_cache, md = make_case(rng, [3, 1], [8, 6], num_tokens=8, num_seqs=2,
                                        pages_per_seq=3)
    cache = quantize_cache(k_cache, v_cache)
    out = attention(q.astype(jnp.bfloat16), cache.k, cache.v, 0, md, sm_scale=0.35, backend="xla",
                    k_scale=cache.k_scale, v_scale=cache.v_scale)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, attention_reference(q, k_cache, v_cache, 0, md, 0.35)) < 5e-2


def test_int8_cache_without_scales_is_value_error():
    rng = np.random.default_rng(4)
    q, k_cache, v_cache, md = make_case(rng, [1], [3], num_tokens=2, num_seqs=1, pages_per_seq=1)
    cache = quantize_cache(k_cache, v_cache)
    with pytest.raises(ValueError, match="int8"):
        ops.ragged_paged_attention(q, cache.k, cache.v, 0, md, sm_scale=0.3, backend="xla")
    with pytest.raises(ValueError, match="int8"):
        ops.ragged_paged_attention(q, k_cache, v_cache, 0, md, sm_scale=0.3, backend="xla",
                                   k_scale=cache.k_scale, v_scale=cache.v_scale)


@pytest.mark.filterwarnings("error:pallas:UserWarning")  # a fallback to XLA would prove nothing
def test_pallas_interpret_int8_equals_xla_int8():
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, md = make_case(rng, [3, 1], [7, 5], num_tokens=4, num_seqs=2,
                                        pages_per_seq=2, num_heads=4, num_kv_heads=2, head_dim=16)
    cache = quantize_cache(k_cache, v_cache)
    kw = dict(sm_scale=0.25, k_scale=cache.k_scale, v_scale=cache.v_scale)
    xla = attention(q, cache.k, cache.v, 1, md, backend="xla", **kw)
    pallas = attention(q, cache.k, cache.v, 1, md, backend="pallas", **kw)
    assert np.isfinite(np.asarray(pallas)).all()
    assert rel_err(pallas, xla) < 1e-5


# -- the engine --------------------------------------------------------------------------------

PROMPTS_SEED = 11


@pytest.fixture(scope="module")
def int8_llm(tiny_llama_dir):
    from jaxinfer import LLM

    return LLM(tiny_llama_dir, num_pages=96, page_size=8, max_num_seqs=16,
               max_num_batched_tokens=64, max_model_len=256, kv_cache_dtype="int8")


def test_engine_int8_greedy_matches_float(int8_llm, tiny_llm):
    from jaxinfer import SamplingParams

    rng = np.random.default_rng(PROMPTS_SEED)
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in rng.integers(4, 40, size=8)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert int8_llm.engine.runner.kv_cache.quantized
    got = [o.outputs[0].token_ids for o in int8_llm.generate(prompts, sp, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(g) == 12 for g in got)
    same = np.mean([a == b for g, w in zip(got, want) for a, b in zip(g, w)])
    assert same >= 0.9, (same, got, want)  # measured 95 of 96
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 7  # first tokens: prefill only
    pool = int8_llm.engine.scheduler.pool
    assert pool.num_free_pages == int8_llm.engine.num_pages - 1


def test_engine_int8_with_draft_model(tiny_llama_dir):
    """The draft model's own KV cache is int8 too; greedy speculation gives the tokens of plain
    decoding, and a self-draft is (nearly) always accepted."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, kv_cache_dtype="int8", speculative_method="draft",
              draft_model=tiny_llama_dir, num_speculative_tokens=3)
    assert llm.engine.runner.draft.kv_cache.quantized
    rng = np.random.default_rng(PROMPTS_SEED + 1)
    prompts = [rng.integers(3, 300, size=8).tolist() * 3 for _ in range(2)]
    off = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, spec_decode=False)
    on = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, off, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, on, use_tqdm=False)]
    assert got == expected
    m = llm.engine.metrics
    assert m.num_draft_tokens_total >= 8 and m.spec_acceptance_rate > 0.9, m
    assert llm.engine.scheduler.pool.num_free_pages == llm.engine.num_pages - 1
