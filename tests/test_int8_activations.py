"""int8 activations (EngineConfig.int8_activations): a quantized layer multiplies through the
int8-activation kernel, the loader turns it on for every quantized weight and refuses it where it
cannot apply, and speculative decoding keeps greedy output identical under it (a row's result
does not depend on how many rows a step has)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_kernels.quant_matmul import quant_matmul_q8_reference
from jaxinfer import LLM, SamplingParams, ops, quant
from jaxinfer.config import EngineConfig
from jaxinfer.models.loader import load_model
from jaxinfer.models.layers import QuantizedEmbed, QuantizedLinear, set_quantized_matmul_backend
from pallas_kernels.quant_matmul import quant_matmul_reference

# dims that are multiples of 64, so every weight takes the kernel (hidden 128, q/k/v 256, gate/up
# 512, vocabulary 384), and head_dim 64 with 16-token pages, so decode rows take the attention
# kernel's decode path, which verification rows must agree with bit for bit
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
KW = dict(quantization="int4", num_pages=32, page_size=16, max_num_seqs=2,
          max_num_batched_tokens=16, max_model_len=96, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("wide") / "llama", seed=1, **WIDE)


def test_a_quantized_layer_multiplies_through_the_int8_activation_kernel():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((128, 192)) * 0.05, jnp.float32)
    qw = quant.quantize_int4(w, 32, symmetric=False)
    layer = QuantizedLinear(qw, backend="cpu")
    assert layer.int8_activations is False  # off unless asked
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 128)), jnp.float32)
    float_y = np.asarray(layer.matmul(x))
    layer.int8_activations = True
    y = np.asarray(layer.matmul(x))
    args = (x, qw.values, qw.scales, qw.mins)
    np.testing.assert_allclose(y, quant_matmul_q8_reference(*args, bits=4, group_size=32),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float_y, quant_matmul_reference(*args, bits=4, group_size=32),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(y - float_y).max() > 1e-4  # x was rounded: the two differ


def test_turning_them_on_drops_a_float_copy_kept_beside_the_codes():
    """A layer keeps its float weight for many-row products where the float kernel is slower
    than a dense matmul; with int8 activations every row count takes the codes, so the copy
    would only take memory."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((128, 192)) * 0.05, jnp.float32)
    qw = quant.quantize_int4(w, 32, symmetric=False)
    kept = set_quantized_matmul_backend(QuantizedLinear(qw, backend="cpu", dense=w), "cpu")
    assert kept.dense is not None
    layer = set_quantized_matmul_backend(QuantizedLinear(qw, backend="cpu", dense=w), "cpu",
                                         int8_activations=True)
    assert layer.dense is None and layer.int8_activations
    x = jnp.asarray(np.random.default_rng(1).standard_normal((40, 128)), jnp.float32)
    np.testing.assert_allclose(np.asarray(layer.matmul(x)), quant_matmul_q8_reference(
        x, qw.values, qw.scales, qw.mins, bits=4, group_size=32), rtol=1e-5, atol=1e-5)


def test_the_loader_turns_them_on_for_every_quantized_weight(wide_llama_dir):
    _, model = load_model(wide_llama_dir, EngineConfig(**KW, int8_activations=True))
    modules = [m for _, m in nnx.iter_modules(model)  # q/k/v, o, gate/up, down (layers stacked)
               if isinstance(m, (QuantizedLinear, QuantizedEmbed))]
    assert len(modules) == 4 and all(m.int8_activations for m in modules)


def test_ngram_speculation_is_greedy_identical_under_int8_activations(wide_llama_dir):
    llm = LLM(wide_llama_dir, **KW, int8_activations=True, speculative_method="ngram",
              ngram_min=1, ngram_max=3, num_speculative_tokens=2, spec_max_batched_tokens=6)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, size=8).tolist() * 3 for _ in range(2)]
    base = dict(max_tokens=16, temperature=0, ignore_eos=True)
    off = llm.generate(prompts, SamplingParams(**base, spec_decode=False), use_tqdm=False)
    before = llm.engine.metrics.num_draft_tokens_total
    on = llm.generate(prompts, SamplingParams(**base), use_tqdm=False)
    assert llm.engine.metrics.num_draft_tokens_total > before
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_int8_activations_are_refused_where_they_cannot_apply(wide_llama_dir):
    with pytest.raises(ValueError, match="needs quantized weights"):
        LLM(wide_llama_dir, **{**KW, "quantization": "none"}, int8_activations=True)
    with pytest.raises(ValueError, match="CPU kernels only"):
        LLM(wide_llama_dir, **KW, int8_activations=True, attention_backend="xla")


def test_auto_turns_them_on_where_they_apply_and_leaves_a_float_model_float(wide_llama_dir,
                                                                             monkeypatch):
    def int8_flags(**kw):
        _, model = load_model(wide_llama_dir, EngineConfig(**{**KW, **kw}, int8_activations="auto"))
        return [m.int8_activations for _, m in nnx.iter_modules(model)
                if isinstance(m, (QuantizedLinear, QuantizedEmbed))]

    monkeypatch.setattr(ops, "cpu_int8_activations_fast", lambda: True)
    assert int8_flags() == [True] * 4
    assert int8_flags(quantization="none") == []  # no quantized weights: float, and no error
    assert int8_flags(attention_backend="xla") == [False] * 4  # not the CPU kernels: off
    monkeypatch.setattr(ops, "cpu_int8_activations_fast", lambda: False)
    assert int8_flags() == [False] * 4  # no integer dot products on this CPU: off


def test_the_cpu_checks_its_flags_for_integer_dot_products(monkeypatch):
    from cpu_kernels import build, quant_matmul

    monkeypatch.setattr(build, "cpu_flags", lambda: "fpu avx2 avx512f avx512bw avx512_vnni")
    assert quant_matmul.int8_activations_fast()
    monkeypatch.setattr(build, "cpu_flags", lambda: "fpu avx2 avx512f avx512bw avx_vnni")
    assert not quant_matmul.int8_activations_fast()  # AVX-512 without its VNNI: not measured
    monkeypatch.setattr(build, "cpu_flags", lambda: "fpu fma avx2")  # vpmaddubsw
    assert quant_matmul.int8_activations_fast()
    monkeypatch.setattr(build, "cpu_flags", lambda: "fpu sse4_2 avx")
    assert not quant_matmul.int8_activations_fast()


def test_the_setting_takes_true_and_false_for_on_and_off_and_nothing_else():
    assert EngineConfig(int8_activations=True).int8_activations == "on"
    assert EngineConfig(int8_activations=False).int8_activations == "off"
    assert EngineConfig().int8_activations == "off"
    with pytest.raises(ValueError, match="int8_activations='yes' must be one of"):
        EngineConfig(int8_activations="yes")


def test_the_cpu_preset_uses_them_where_they_apply():
    import tomllib
    from pathlib import Path

    preset = tomllib.loads((Path(__file__).parents[1] / "configs" / "cpu.toml").read_text())
    assert EngineConfig(**preset["engine"]).int8_activations == "auto"


def test_a_norm_row_is_the_same_bit_for_bit_at_any_row_count():
    """A row's norm does not depend on how many rows the step has, also where XLA fuses the norm
    with what feeds it (here a quantized embedding lookup: with a plain `mean` XLA:CPU summed the
    row another way from 8 rows up, and 13 of these 40 rows came out different alone), so a
    verification's rows equal a decode step's (int8 activations amplify last bits)."""
    import jax

    from jaxinfer.models.layers import RMSNorm

    rng = np.random.default_rng(1)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight[...] = jnp.asarray(rng.standard_normal(576), jnp.float32)
    table = jnp.asarray(rng.standard_normal((576, 4000)) * 0.05, jnp.float32)  # [H, vocab]
    embed = QuantizedEmbed(quant.quantize_int8(table, 32), backend="cpu")
    ids = jnp.asarray(rng.integers(0, 4000, 40), jnp.int32)
    f = jax.jit(lambda ids: norm(embed(ids)))
    whole = np.asarray(f(ids))  # [40, 576]
    for t in range(40):
        np.testing.assert_array_equal(np.asarray(f(ids[t:t + 1]))[0], whole[t])
    for t in (2, 5, 7, 8, 9, 16, 33):
        np.testing.assert_array_equal(np.asarray(f(ids[:t])), whole[:t])
    x = np.asarray(embed(ids))
    np.testing.assert_allclose(  # and it is the norm
        whole, x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-5)
        * np.asarray(norm.weight[...]), rtol=1e-5, atol=1e-5)


def test_a_fixed_order_row_sum_is_a_sum():
    from jaxinfer.models.layers import row_sum_fixed_order

    for width in (1, 2, 7, 9, 576, 4097):
        x = np.random.default_rng(width).standard_normal((3, width)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(row_sum_fixed_order(jnp.asarray(x))),
                                   x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-4)
