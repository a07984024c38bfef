"""The pure jitted step: model forward + KV write + on-device sampling, in one compiled call.

Inputs arrive as one packed int32 buffer (one host->device copy per step; its format is
sched/step_buffer.py's, built by sched/step_input.py). The step unpacks it once, into `StepParts`,
and everything after reads those. The buffer's layout and `StepFlags` are static, so each
combination of shape bucket and flags is one executable. The KV caches are donated: updated in
place, never copied. The weights come as a flat tuple of arrays and the sample leaves as one
array (`flat_state`, `pack_output`): on a small CPU a call's per-argument and per-output
bookkeeping is a measurable part of a one-row step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache
from jaxinfer.runtime.draft_model import DraftInputs, propose_drafts
from jaxinfer.runtime.sampler import SamplerOutput, SamplingMetadata, sample_any
from jaxinfer.runtime.spec_verify import SpecInputs, verify_drafts
from jaxinfer.sched.step_buffer import PackedLayout, unpack

_OPTIONAL_SAMPLING = ("prompt_token_ids", "output_token_ids", "bias_token_ids", "bias_values",
                      "allowed_token_bitmask")


class StepFlags(NamedTuple):
    """Static parts of a step besides the shapes (hashable)."""

    attention_backend: str
    # the tensor-parallel mesh the state is placed on: the attention kernels run per device on
    # it (ops/sharded.py); None on one device
    mesh: Mesh | None = None


class StepParts(NamedTuple):
    """The packed step buffer, unpacked into what the step reads (slices of the buffer)."""

    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attention: AttentionMetadata
    logits_indices: jax.Array  # i32[R] the token of each sampled row
    sampling: SamplingMetadata  # per row
    target_token_ids: jax.Array | None  # i32[R] prompt-logprob rows' next prompt token, else -1
    spec: SpecInputs | None  # drafts to verify (None: the layout verifies nothing)
    draft: DraftInputs | None  # a draft model's work in this step (None: no draft model)


def _bitcast(x: jax.Array, dtype: str) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))


def unpack_step(buf: jax.Array, layout: PackedLayout) -> StepParts:
    """i32[n] packed buffer -> its named parts (optional ones None where the layout has none)."""
    f = unpack(buf, layout, _bitcast)
    attention = AttentionMetadata(
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
    spec = draft = None
    if "spec_row_ids" in f:
        spec = SpecInputs(f["spec_row_ids"], f["spec_draft_ids"], f["spec_num_draft"],
                          f["spec_seq_ids"], f["spec_store_rows"])
    if "draft_k" in f:
        draft = DraftInputs(f["draft_k"], f["seq_rows"], f["seq_store_rows"])
    return StepParts(f["input_ids"], f["positions"], attention, f["logits_indices"], sampling,
                     f.get("target_token_ids"), spec, draft)


def _forward_and_sample(graphdef, state, kv_cache, parts: StepParts, logprob_level,
                        flags: StepFlags) -> tuple[jax.Array, SamplerOutput, KVCache]:
    """The target's forward over the batch, its logits at the sampled rows, and a sample.
    -> (logits f32[R, V], SamplerOutput, kv_cache)."""
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model(parts.input_ids, parts.positions, kv_cache, parts.attention,
                             attention_backend=flags.attention_backend,
                             mesh=flags.mesh)  # hidden: [T, H]
    # the real rows come first and each reads its own real token, so there are at most as many
    # as real tokens: the LM head's kernel skips the padding rows beyond
    logits = model.compute_logits(hidden[parts.logits_indices],
                                  parts.attention.num_real_tokens)  # f32[R, V]
    out = sample_any(logits, parts.sampling, logprob_level)
    targets = parts.target_token_ids  # i32[R] | None
    if targets is not None:  # prompt-logprob rows: the logprob of the given next prompt token
        picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
        scored = picked - jax.nn.logsumexp(logits, axis=-1)  # f32[R]
        out = out._replace(logprobs=jnp.where(targets >= 0, scored, out.logprobs))
    return logits, out, kv_cache


def step_fn(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_cache: KVCache,
    buf: jax.Array,  # i32[n] packed step inputs
    logprob_level: jax.Array,  # i32[] what the sampler computes (sampler.NO_LOGPROBS ..)
    layout: PackedLayout,
    flags: StepFlags,
) -> tuple[SamplerOutput, KVCache]:
    parts = unpack_step(buf, layout)
    logits, out, kv_cache = _forward_and_sample(graphdef, state, kv_cache, parts,
                                                logprob_level, flags)
    if parts.spec is not None:  # speculative verification (n-gram drafts: q one-hot)
        out, _ = verify_drafts(logits, parts.sampling, out, parts.spec)
    return out, kv_cache


def draft_step_fn(graphdef, draft_graphdef, state, kv_cache, draft_state, draft_kv, q_store, buf,
                  logprob_level, layout: PackedLayout, flags: StepFlags):
    """`step_fn` plus a draft model: verify last step's drafts, run the draft over the batch and
    propose the next drafts, in one call. -> ((SamplerOutput, drafts i32[S, K]), kv_cache,
    draft_kv, q_store)."""
    parts = unpack_step(buf, layout)
    logits, out, kv_cache = _forward_and_sample(graphdef, state, kv_cache, parts,
                                                logprob_level, flags)
    num_accepted = jnp.zeros(parts.attention.kv_lens.shape, jnp.int32)  # i32[S]
    if parts.spec is not None:
        out, accepted = verify_drafts(logits, parts.sampling, out, parts.spec, q_store)
        num_accepted = num_accepted.at[parts.spec.seq_ids].set(accepted, mode="drop")
    draft_ids, draft_kv, q_store = propose_drafts(
        nnx.merge(draft_graphdef, draft_state), draft_kv, q_store, parts.input_ids, parts.positions,
        parts.attention, parts.sampling, out.token_ids, num_accepted, parts.draft,
        attention_backend=flags.attention_backend)
    return (out, draft_ids), kv_cache, draft_kv, q_store


# The weights enter a step as the flat tuple of the state's leaves (`flat_state`), rebuilt into
# the nnx.State by the treedef at trace time: a call flattens its arguments, and flattening an
# nnx.State of a few hundred arrays node by node in Python is a measurable part of a one-row
# step on a small CPU (docs/performance.md, item 13); a tuple of arrays costs microseconds.


def flat_state(state: nnx.State) -> tuple[tuple[jax.Array, ...], jax.tree_util.PyTreeDef]:
    """(the state's leaves, its treedef): what the jitted steps take for a state."""
    leaves, treedef = jax.tree.flatten(state)
    return tuple(leaves), treedef


def pack_output(out: SamplerOutput) -> jax.Array:
    """SamplerOutput -> i32[R, 2 + 2K]: each row's token id, its logprob, its K top token ids and
    their logprobs, the floats as their bits. The host fetches this one array a step: each array
    fetched waits for the device on its own."""
    def bits(x):
        return jax.lax.bitcast_convert_type(x, jnp.int32)

    return jnp.concatenate([out.token_ids[:, None], bits(out.logprobs)[:, None],
                            out.top_token_ids, bits(out.top_logprobs)], axis=1)


def unpack_output(packed: np.ndarray) -> SamplerOutput:
    """`pack_output`'s array, fetched to the host -> a SamplerOutput of numpy views of it."""
    k = (packed.shape[1] - 2) // 2
    floats = packed.view(np.float32)
    return SamplerOutput(packed[:, 0], floats[:, 1], packed[:, 2:2 + k], floats[:, 2 + k:])


def make_jitted_step(graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef):
    """jit with the KV cache donated (argument 1): it is updated in place, never copied. The
    state comes as its leaves (`flat_state`), in `treedef`'s order; the sample as
    `pack_output`'s one array."""

    def fn(leaves, kv_cache, buf, logprob_level, layout, flags):
        state = jax.tree.unflatten(treedef, leaves)
        out, kv_cache = step_fn(graphdef, state, kv_cache, buf, logprob_level, layout, flags)
        return pack_output(out), kv_cache

    return jax.jit(fn, donate_argnums=(1,), static_argnums=(4, 5))


def make_jitted_draft_step(graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef,
                           draft_graphdef: nnx.GraphDef, draft_treedef: jax.tree_util.PyTreeDef):
    """jit of `draft_step_fn` with both KV caches and the draft-probability store donated; both
    states as their leaves, the sample as `pack_output`'s array."""

    def fn(leaves, kv_cache, draft_leaves, draft_kv, q_store, buf, logprob_level, layout, flags):
        state = jax.tree.unflatten(treedef, leaves)
        draft_state = jax.tree.unflatten(draft_treedef, draft_leaves)
        (out, draft_ids), kv_cache, draft_kv, q_store = draft_step_fn(
            graphdef, draft_graphdef, state, kv_cache, draft_state, draft_kv, q_store, buf,
            logprob_level, layout, flags)
        return (pack_output(out), draft_ids), kv_cache, draft_kv, q_store

    return jax.jit(fn, donate_argnums=(1, 3, 4), static_argnums=(7, 8))
