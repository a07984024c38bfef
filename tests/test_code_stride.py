"""Quantized weights kept at a padded row stride on the CPU (`QuantizedWeight.padded`;
`models.layers.pad_code_strides`, which the runner and a draft model apply to the weights
multiplied with int8 activations): every path multiplies them as it multiplies the unpadded
weight, bit for bit, and an engine's output does not change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer import LLM, SamplingParams, ops, quant
from jaxinfer.config import EngineConfig
from jaxinfer.models.layers import QuantizedEmbed, QuantizedLinear, pad_code_strides
from jaxinfer.models.loader import load_model
from jaxinfer.runtime import runner as runner_module
from tests.test_int8_activations import KW, wide_llama_dir  # noqa: F401 (a fixture)


def _weight(k=128, n=192, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((k, n)) * 0.05, jnp.float32)


@pytest.mark.parametrize("make", [lambda w: quant.quantize_int4(w, 32, symmetric=False),
                                  lambda w: quant.quantize_int4(w, 32, symmetric=True),
                                  lambda w: quant.quantize_int8(w, 32)])
def test_padding_and_unpadding_keep_the_weight(make):
    qw = make(_weight())
    padded = qw.padded(256)
    assert padded.shape == qw.shape == (128, 192) and padded.stride == 256 and qw.stride == 192
    for a, b in ((padded.values, qw.values), (padded.scales, qw.scales), (padded.mins, qw.mins)):
        if b is None:
            assert a is None
            continue
        assert a.shape == b.shape[:-1] + (256,)
        np.testing.assert_array_equal(np.asarray(a[..., :192]), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a[..., 192:]), 0)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(padded.unpadded())),
                                  np.asarray(quant.dequantize(qw)))
    assert qw.unpadded() is qw
    assert padded.padded(320).stride == 320 and padded.padded(192).stride == 192
    with pytest.raises(ValueError, match="at least N"):
        qw.padded(128)


@pytest.mark.parametrize("backend,int8_activations", [("cpu", False), ("cpu", True),
                                                      ("xla", False)])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_every_backend_multiplies_a_padded_weight_as_the_unpadded_one(backend, int8_activations, m):
    qw = quant.quantize_int4(_weight(n=128), 32, symmetric=False)
    padded = qw.padded(ops.cpu_code_stride(qw))
    assert padded.stride == 192  # rows of 2 cache lines of codes: 3
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 128)), jnp.float32)
    mul = lambda w: ops.quantized_matmul(x, w, backend=backend, int8_activations=int8_activations)
    np.testing.assert_array_equal(np.asarray(mul(padded)), np.asarray(mul(qw)))


def test_a_model_pads_only_the_weights_the_int8_activation_kernel_reads(wide_llama_dir):
    _, model = load_model(wide_llama_dir, EngineConfig(**KW, int8_activations=True))
    model.unroll_layers()  # the CPU runner's layout: 2-D weights, one per layer
    modules = [m for _, m in nnx.iter_modules(model)
               if isinstance(m, (QuantizedLinear, QuantizedEmbed))]
    strides = [(m.qweight.shape[1], m.qweight.stride) for m in modules]
    padded = pad_code_strides(model)
    assert padded == sum(ops.cpu_code_stride(m.qweight) != n for m, (n, _) in zip(modules, strides))
    assert padded > 0
    for m, (n, stride) in zip(modules, strides):
        assert m.qweight.shape[1] == n and stride == n
        assert m.qweight.stride == ops.cpu_code_stride(m.qweight)
    assert pad_code_strides(model) == 0  # already padded: nothing more
    _, float_x = load_model(wide_llama_dir, EngineConfig(**KW))
    float_x.unroll_layers()
    assert pad_code_strides(float_x) == 0  # the float kernel reads rows as 4 KiB runs
    _, other = load_model(wide_llama_dir, EngineConfig(**KW, int8_activations=True))
    other.unroll_layers()
    for _, m in nnx.iter_modules(other):
        if isinstance(m, (QuantizedLinear, QuantizedEmbed)):
            m.backend = "xla"
    assert pad_code_strides(other) == 0  # the XLA path reads whole rows: left as it is


def test_an_engine_gives_the_same_tokens_and_logprobs_with_and_without_the_padding(
        wide_llama_dir, monkeypatch):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 99, 140, 7, 7, 33], list(range(40, 75))]

    def run():
        llm = LLM(wide_llama_dir, **KW, int8_activations=True)
        strides = [a.shape[-1] for a in jax.tree.leaves(llm.engine.runner.state)
                   if a.dtype in (jnp.uint8, jnp.int8)]  # the codes' rows
        outs = llm.generate(prompts, params, use_tqdm=False)
        return strides, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    padded_strides, padded = run()
    monkeypatch.setattr(runner_module, "pad_code_strides", lambda model: 0)
    plain_strides, plain = run()
    assert padded_strides != plain_strides  # the runner did pad
    assert padded == plain


def test_a_layout_the_cpu_kernels_do_not_take_keeps_its_rows():
    takes = quant.quantize_int4(_weight(k=128, n=128), 32, symmetric=False)  # K/2 = 64: 2 groups
    refused = quant.quantize_int4(_weight(k=128, n=128), 128, symmetric=False)  # K/2 = 64 < 128
    assert ops.cpu_code_stride(takes) == 192 and ops.cpu_code_stride(refused) == 128


def test_a_draft_model_is_padded_as_the_target_and_its_tokens_do_not_change(
        wide_llama_dir, monkeypatch):
    from jaxinfer.runtime import draft_model as draft_module

    # the draft takes int8 activations under "auto", which depends on this CPU's flags
    monkeypatch.setattr(ops, "cpu_int8_activations_fast", lambda: True)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 99, 140, 7, 5, 17, 99], list(range(40, 60))]

    def run():
        llm = LLM(wide_llama_dir, **KW, int8_activations=True, speculative_method="draft",
                  draft_model=wide_llama_dir, draft_quantization="int4", num_speculative_tokens=2)
        strides = [a.shape[-1] for a in jax.tree.leaves(llm.engine.runner.draft.state)
                   if a.dtype in (jnp.uint8, jnp.int8)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        drafted = llm.engine.metrics.num_draft_tokens_total
        return strides, drafted, [o.outputs[0].token_ids for o in outs]

    padded_strides, padded_drafts, padded = run()
    for module in (runner_module, draft_module):
        monkeypatch.setattr(module, "pad_code_strides", lambda model: 0)
    plain_strides, plain_drafts, plain = run()
    assert padded_strides != plain_strides  # the draft's codes were padded
    assert padded_drafts == plain_drafts > 0  # the same drafts were proposed and verified
    assert padded == plain
