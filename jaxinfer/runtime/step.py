"""The pure jitted step: model forward + KV write + on-device sampling, in one compiled call."""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

from jaxinfer.runtime.kv_cache import AttentionMetadata, KVCache
from jaxinfer.runtime.sampler import SamplerOutput, SamplingMetadata, sample


class StepBatch(NamedTuple):
    """Device-side inputs of one step (shapes padded to buckets)."""

    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    md: AttentionMetadata
    logits_indices: jax.Array  # i32[R] row of `hidden` each sampled row reads
    sampling: SamplingMetadata


def step_fn(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    attention_backend: str,
    num_top_logprobs: int,
) -> tuple[SamplerOutput, KVCache]:
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model(
        batch.input_ids, batch.positions, kv_cache, batch.md, attention_backend=attention_backend
    )  # hidden: [T, H]
    logits = model.compute_logits(hidden[batch.logits_indices])  # f32[R, V]
    return sample(logits, batch.sampling, num_top_logprobs=num_top_logprobs), kv_cache


def make_jitted_step(graphdef: nnx.GraphDef):
    """jit with the KV cache donated (argument 1): it is updated in place, never copied."""

    def fn(state, kv_cache, batch, *, attention_backend, num_top_logprobs):
        return step_fn(
            graphdef, state, kv_cache, batch,
            attention_backend=attention_backend, num_top_logprobs=num_top_logprobs,
        )

    return jax.jit(fn, donate_argnums=(1,), static_argnames=("attention_backend", "num_top_logprobs"))
