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

from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache
from jaxinfer.runtime.sampler import GREEDY_EPS, SamplerOutput, SamplingMetadata, sample
from jaxinfer.sched.step_input import PackedLayout, unpack
from jaxinfer.runtime.spec_decode import DraftInputs, SpecInputs, propose_drafts, verify_drafts

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
    return _step_parts(unpack(buf, layout, _bitcast))


def _step_parts(f: dict):
    """The unpacked fields -> (input_ids, positions, AttentionMetadata, logits_indices, sampling)."""
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


def unpack_spec(buf: jax.Array, layout: PackedLayout) -> tuple[SpecInputs | None, DraftInputs | None]:
    """The speculative-decoding parts of a packed buffer (None where the layout has none)."""
    names = {f.name for f in layout}
    if "spec_row_ids" not in names and "draft_k" not in names:
        return None, None
    f = unpack(buf, layout, _bitcast)
    spec = draft = None
    if "spec_row_ids" in names:
        spec = SpecInputs(f["spec_row_ids"], f["spec_draft_ids"], f["spec_num_draft"],
                          f["spec_seq_ids"], f["spec_store_rows"])
    if "draft_k" in names:
        draft = DraftInputs(f["draft_k"], f["seq_rows"], f["seq_store_rows"])
    return spec, draft


def _forward_and_sample(graphdef, state, kv_cache, buf, want_top_logprobs, layout, flags):
    """The target's forward over the packed batch, its logits at the sampled rows, and a sample."""
    model = nnx.merge(graphdef, state)
    fields = unpack(buf, layout, _bitcast)
    input_ids, positions, md, logits_indices, sampling = _step_parts(fields)
    hidden, kv_cache = model(input_ids, positions, kv_cache, md,
                             attention_backend=flags.attention_backend)  # hidden: [T, H]
    logits = model.compute_logits(hidden[logits_indices])  # f32[R, V]
    out = sample_any(logits, sampling, want_top_logprobs)
    targets = fields.get("target_token_ids")  # i32[R] | None
    if targets is not None:  # prompt-logprob rows: the logprob of the given next prompt token
        picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
        scored = picked - jax.nn.logsumexp(logits, axis=-1)  # f32[R]
        out = out._replace(logprobs=jnp.where(targets >= 0, scored, out.logprobs))
    return logits, sampling, md, out, kv_cache


def step_fn(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    buf: jax.Array,  # i32[n] packed step inputs
    want_top_logprobs: jax.Array,  # bool[] some row asked for top logprobs
    layout: PackedLayout,
    flags: StepFlags,
) -> tuple[SamplerOutput, KVCache]:
    logits, sampling, md, out, kv_cache = _forward_and_sample(
        graphdef, state, kv_cache, buf, want_top_logprobs, layout, flags)
    spec, _ = unpack_spec(buf, layout)
    if spec is not None:  # speculative verification (n-gram drafts: q one-hot)
        out, _ = verify_drafts(logits, sampling, out, spec)
    return out, kv_cache


def draft_step_fn(graphdef, draft_graphdef, state, kv_cache, draft_state, draft_kv, q_store, buf,
                  want_top_logprobs, layout: PackedLayout, flags: StepFlags):
    """`step_fn` plus a draft model: verify last step's drafts, run the draft over the batch and
    propose the next drafts, in one call. -> ((SamplerOutput, drafts i32[S, K]), kv_cache,
    draft_kv, q_store)."""
    logits, sampling, md, out, kv_cache = _forward_and_sample(
        graphdef, state, kv_cache, buf, want_top_logprobs, layout, flags)
    input_ids, positions = unpack_step(buf, layout)[:2]  # slices of buf: deduplicated by XLA
    spec, draft = unpack_spec(buf, layout)
    num_accepted = jnp.zeros(md.kv_lens.shape, jnp.int32)  # i32[S]
    if spec is not None:
        out, accepted = verify_drafts(logits, sampling, out, spec, q_store)
        num_accepted = num_accepted.at[spec.seq_ids].set(accepted, mode="drop")
    draft_ids, draft_kv, q_store = propose_drafts(
        nnx.merge(draft_graphdef, draft_state), draft_kv, q_store, input_ids, positions, md,
        sampling, out.token_ids, num_accepted, draft, attention_backend=flags.attention_backend)
    return (out, draft_ids), kv_cache, draft_kv, q_store


def make_jitted_step(graphdef: nnx.GraphDef):
    """jit with the KV cache donated (argument 1): it is updated in place, never copied."""

    def fn(state, kv_cache, buf, want_top_logprobs, layout, flags):
        return step_fn(graphdef, state, kv_cache, buf, want_top_logprobs, layout, flags)

    return jax.jit(fn, donate_argnums=(1,), static_argnums=(4, 5))


def make_jitted_draft_step(graphdef: nnx.GraphDef, draft_graphdef: nnx.GraphDef):
    """jit of `draft_step_fn` with both KV caches and the draft-probability store donated."""

    def fn(state, kv_cache, draft_state, draft_kv, q_store, buf, want_top_logprobs, layout, flags):
        return draft_step_fn(graphdef, draft_graphdef, state, kv_cache, draft_state, draft_kv,
                             q_store, buf, want_top_logprobs, layout, flags)

    return jax.jit(fn, donate_argnums=(1, 3, 4), static_argnums=(7, 8))
