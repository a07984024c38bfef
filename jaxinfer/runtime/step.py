"""The pure jitted step: model forward + KV write + on-device sampling, in one compiled call.

Inputs arrive as one packed int32 buffer (one host->device copy per step, see
`sched/step_input.py`); its layout and the sampler's flags are static, so each combination of
shape bucket and flags is one executable.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.runtime.kv_cache import AttentionMetadata, KVCache
from jaxinfer.runtime.sampler import SamplerOutput, SamplingMetadata, sample
from jaxinfer.sched.step_input import PackedLayout, unpack

_OPTIONAL_SAMPLING = ("prompt_token_ids", "output_token_ids", "bias_token_ids", "bias_values",
                      "allowed_token_bitmask")


class StepFlags(NamedTuple):
    """Static parts of a step besides the shapes (hashable)."""

    attention_backend: str
    num_top_logprobs: int
    needs_sort: bool
    all_greedy: bool


def _bitcast(x: jax.Array, dtype: str) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))


def unpack_step(buf: jax.Array, layout: PackedLayout):
    """i32[n] packed buffer -> (input_ids, positions, AttentionMetadata, logits_indices, sampling)."""
    f = unpack(buf, layout, _bitcast)
    md = AttentionMetadata(
        slot_mapping=f["slot_mapping"], cu_q_lens=f["cu_q_lens"], kv_lens=f["kv_lens"],
        page_indices=f["page_indices"], num_seqs=f["num_seqs"],
    )
    sampling = SamplingMetadata(
        temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"], min_p=f["min_p"],
        seeds=f["seeds"], positions=f["sample_positions"],
        presence_penalty=f["presence_penalty"], frequency_penalty=f["frequency_penalty"],
        repetition_penalty=f["repetition_penalty"],
        **{k: f.get(k) for k in _OPTIONAL_SAMPLING},
    )
    return f["input_ids"], f["positions"], md, f["logits_indices"], sampling


def step_fn(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    buf: jax.Array,  # i32[n] packed step inputs
    layout: PackedLayout,
    flags: StepFlags,
) -> tuple[SamplerOutput, KVCache]:
    model = nnx.merge(graphdef, state)
    input_ids, positions, md, logits_indices, sampling = unpack_step(buf, layout)
    hidden, kv_cache = model(input_ids, positions, kv_cache, md,
                             attention_backend=flags.attention_backend)  # hidden: [T, H]
    logits = model.compute_logits(hidden[logits_indices])  # f32[R, V]
    out = sample(logits, sampling, num_top_logprobs=flags.num_top_logprobs,
                 needs_sort=flags.needs_sort, all_greedy=flags.all_greedy)
    return out, kv_cache


def make_jitted_step(graphdef: nnx.GraphDef):
    """jit with the KV cache donated (argument 1): it is updated in place, never copied."""

    def fn(state, kv_cache, buf, layout, flags):
        return step_fn(graphdef, state, kv_cache, buf, layout, flags)

    return jax.jit(fn, donate_argnums=(1,), static_argnums=(3, 4))
