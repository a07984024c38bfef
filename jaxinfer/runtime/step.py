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
from jaxinfer.runtime.sampler import GREEDY_EPS, SamplerOutput, SamplingMetadata, sample
from jaxinfer.sched.step_input import PackedLayout, unpack

_OPTIONAL_SAMPLING = ("prompt_token_ids", "output_token_ids", "bias_token_ids", "bias_values",
                      "allowed_token_bitmask")


MAX_TOP_LOGPROBS = 20  # OpenAI's maximum


class StepFlags(NamedTuple):
    """Static parts of a step besides the shapes (hashable)."""

    attention_backend: str


def sample_any(logits: jax.Array, md: SamplingMetadata, want_top_logprobs: jax.Array) -> SamplerOutput:
    """`sample` with its fast paths chosen on the device (`lax.switch`), not by recompiling:
    all greedy -> argmax only; sampled rows without top-k/top-p -> no cut-off search; else the full
    path; top logprobs (MAX_TOP_LOGPROBS of them) only when `want_top_logprobs` (bool[]). One
    executable serves every mix of requests, so warm-up covers all traffic; a row's token is the
    same whichever branch runs (the flags only skip work no row needs)."""
    sampled = md.temperature >= GREEDY_EPS  # bool[R]
    needs_sort = jnp.any(sampled & ((md.top_k > 0) | (md.top_p < 1.0)))
    branch = jnp.where(needs_sort, 2, jnp.where(jnp.any(sampled), 1, 0))
    branches = [
        lambda l, m: sample(l, m, all_greedy=True)[:2],
        lambda l, m: sample(l, m, needs_sort=False)[:2],
        lambda l, m: sample(l, m, needs_sort=True)[:2],
    ]
    token_ids, logprobs = jax.lax.switch(branch, branches, logits, md)
    num_rows = logits.shape[0]

    def top(l):
        vals, ids = jax.lax.top_k(jax.nn.log_softmax(l.astype(jnp.float32), axis=-1), MAX_TOP_LOGPROBS)
        return ids.astype(jnp.int32), vals

    def no_top(l):
        return (jnp.zeros((num_rows, MAX_TOP_LOGPROBS), jnp.int32),
                jnp.zeros((num_rows, MAX_TOP_LOGPROBS), jnp.float32))

    top_ids, top_lps = jax.lax.cond(want_top_logprobs, top, no_top, logits)
    return SamplerOutput(token_ids, logprobs, top_ids, top_lps)


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
    want_top_logprobs: jax.Array,  # bool[] some row asked for top logprobs
    layout: PackedLayout,
    flags: StepFlags,
) -> tuple[SamplerOutput, KVCache]:
    model = nnx.merge(graphdef, state)
    input_ids, positions, md, logits_indices, sampling = unpack_step(buf, layout)
    hidden, kv_cache = model(input_ids, positions, kv_cache, md,
                             attention_backend=flags.attention_backend)  # hidden: [T, H]
    logits = model.compute_logits(hidden[logits_indices])  # f32[R, V]
    return sample_any(logits, sampling, want_top_logprobs), kv_cache


def make_jitted_step(graphdef: nnx.GraphDef):
    """jit with the KV cache donated (argument 1): it is updated in place, never copied."""

    def fn(state, kv_cache, buf, want_top_logprobs, layout, flags):
        return step_fn(graphdef, state, kv_cache, buf, want_top_logprobs, layout, flags)

    return jax.jit(fn, donate_argnums=(1,), static_argnums=(4, 5))
