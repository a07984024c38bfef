"""The Pallas weight-only quantized matmul (interpret mode) against its plain-jnp reference, and
its dispatch through ops.quantized_matmul (QuantizedLinear, the engine)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer import ops, quant
from pallas_kernels.quant_matmul import dequantize_reference, quant_matmul, quant_matmul_reference

CASES = [  # (bits, group_size, symmetric)
    (8, None, True),  # per output channel
    (8, 32, True),  # GGUF Q8_0 layout
    (4, 32, True),
    (4, 64, False),
    (4, 128, True),
]


def _weight(bits, group_size, symmetric, k, n, seed=0):
    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * 0.05
    if bits == 8:
        return quant.quantize_int8(w, group_size)
    return quant.quantize_int4(w, group_size, symmetric)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("bits,group_size,symmetric", CASES)
@pytest.mark.parametrize("m", [1, 19])  # 19: two row tiles of 16, the second padded
def test_matches_reference(bits, group_size, symmetric, m):
    k, n = 256, 128
    qw = _weight(bits, group_size, symmetric, k, n)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    got = quant_matmul(x, qw.values, qw.scales, qw.mins, bits=bits, group_size=qw.group_size,
                       block_m=16, interpret=True)
    want = quant_matmul_reference(x, qw.values, qw.scales, qw.mins, bits=bits,
                                  group_size=qw.group_size)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert _rel_err(got, want) < 1e-5


@pytest.mark.parametrize("bits,group_size,symmetric", CASES)
def test_reference_weight_is_the_dequantized_weight(bits, group_size, symmetric):
    k, n = 256, 64
    qw = _weight(bits, group_size, symmetric, k, n, seed=3)
    ref = dequantize_reference(qw.values, qw.scales, qw.mins, bits=bits,
                               group_size=qw.group_size, k=k)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(quant.dequantize(qw)))


def test_bfloat16_activations():
    k, n, m = 128, 64, 8
    qw = _weight(4, 32, False, k, n)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    got = quant_matmul(x, qw.values, qw.scales, qw.mins, bits=4, group_size=32, interpret=True)
    want = quant_matmul_reference(x, qw.values, qw.scales, qw.mins, bits=4, group_size=32)
    assert got.dtype == jnp.bfloat16
    assert _rel_err(got, want) < 2e-2


def test_several_column_tiles():
    k, n, m = 128, 256, 3
    qw = _weight(4, 32, True, k, n)
    x = jax.random.normal(jax.random.key(2), (m, k), jnp.float32)
    got = quant_matmul(x, qw.values, qw.scales, qw.mins, bits=4, group_size=32, block_n=64,
                       interpret=True)
    want = quant_matmul_reference(x, qw.values, qw.scales, qw.mins, bits=4, group_size=32)
    assert _rel_err(got, want) < 1e-5


def test_unsupported_layouts_raise_not_implemented():
    qw = _weight(4, 128, True, 576, 64)  # K/2 = 288 is not a multiple of 128
    x = jnp.ones((2, 576), jnp.float32)
    with pytest.raises(NotImplementedError):
        quant_matmul(x, qw.values, qw.scales, qw.mins, bits=4, group_size=128, interpret=True)


def test_bad_shapes_raise_value_error():
    qw = _weight(8, None, True, 64, 64)
    with pytest.raises(ValueError, match="values.shape"):
        quant_matmul(jnp.ones((2, 128)), qw.values, qw.scales, bits=8, group_size=64)
    with pytest.raises(ValueError, match="scales.shape"):
        quant_matmul(jnp.ones((2, 64)), qw.values, qw.scales[:, :32], bits=8, group_size=64)


# --- the ops.py seam: QuantizedLinear -> ops.quantized_matmul -> this kernel ----------------------


@pytest.mark.parametrize("bits,group_size,symmetric", [(8, None, True), (4, 32, False),
                                                       (4, 64, True)])
def test_ops_dispatch_pallas_equals_xla(bits, group_size, symmetric):
    from jaxinfer.models.layers import QuantizedLinear

    k, n = 128, 192
    qw = _weight(bits, group_size, symmetric, k, n, seed=5)
    x = jax.random.normal(jax.random.key(4), (3, 5, k), jnp.float32)  # leading dims kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a silent fallback to XLA would make this vacuous
        got = jax.jit(lambda x: QuantizedLinear(qw, backend="pallas")(x))(x)
    want = QuantizedLinear(qw, backend="xla")(x)
    assert got.shape == (3, 5, n)
    assert _rel_err(got, want) < 1e-5
    assert _rel_err(ops.quantized_matmul(x, qw, backend="auto"), want) < 1e-5  # CPU: xla


def test_ops_falls_back_to_xla_with_a_warning():
    qw = _weight(4, 128, True, 576, 64)  # K/2 = 288 is not a multiple of 128: NotImplementedError
    x = jnp.ones((2, 576), jnp.float32)
    with pytest.warns(UserWarning, match="quant_matmul unavailable"):
        got = ops.quantized_matmul(x, qw, backend="pallas")
    np.testing.assert_array_equal(got, quant.quantized_matmul(x, qw))
    with pytest.raises(ValueError, match="backend"):
        ops.quantized_matmul(x, qw, backend="triton")


def test_int8_engine_pallas_matmul_same_greedy_tokens_as_xla(tiny_llama_dir):
    """attention_backend="pallas" also routes every quantized projection and the LM head through
    the kernel (interpret mode here); greedy tokens equal the XLA engine's."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.layers import QuantizedLinear
    from jaxinfer.models.loader import load_model

    kwargs = dict(quantization="int8", quantize_lm_head=True)
    _, model = load_model(tiny_llama_dir, EngineConfig(attention_backend="pallas", **kwargs))
    linears = [m for _, m in nnx.iter_modules(model) if isinstance(m, QuantizedLinear)]
    assert len(linears) == 5 and all(m.backend == "pallas" for m in linears)

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in (5, 11)]
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "pallas"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            llm = LLM(tiny_llama_dir, attention_backend=backend, num_pages=16, page_size=8,
                      max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, **kwargs)
            tokens[backend] = [o.outputs[0].token_ids
                               for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert tokens["pallas"] == tokens["xla"]
