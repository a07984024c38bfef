"""The draft model of speculative decoding: its device state and its part of every step.

The draft shares the target's tokenizer and its page ids: it has its own KV cache array with the
same page layout, and every step also runs the draft over the step's batch (`propose_drafts`), so
its cache holds exactly the tokens the target's holds (prefix-cache hits, preemption and rollback
need nothing extra). Then, in the same jitted call, it runs up to K single-token steps
(`lax.fori_loop`) from each sequence's last emitted token and returns the drafts for the next
step; for sampled rows their draft distributions q stay on the device, in a store indexed by the
request's page-table row, until the next step verifies them (runtime/spec_verify.py). The draft's
K/V for its own drafts lands in pages the scheduler holds for it (`num_lookahead`). A draft whose
vocabulary differs from the target's (size or token -> id mapping) is refused with ValueError.

Costs: the draft's pass over the batch runs in every step, also when the policy gives nobody
drafts (that is what keeps its cache complete), and the q store takes
max_num_seqs * K * V * 4 bytes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer import ops
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models.loader import load_model, model_source
from jaxinfer.models.layers import pad_code_strides
from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache, allocate_kv_cache
from jaxinfer.runtime.sampler import (GREEDY_EPS, SamplingMetadata, categorical, gather_rows,
                                      row_keys, warp_logits)
from jaxinfer.tokenizer import Tokenizer

DRAFT_KEY_STREAM = 0x5D  # fold_in constant: the draft's own random numbers at a position


class DraftInputs(NamedTuple):
    """Per sequence of the step (see sched/step_input.py)."""

    draft_k: jax.Array  # i32[S] drafts to propose (0: none)
    seq_rows: jax.Array  # i32[S] first sampled row of the sequence
    store_rows: jax.Array  # i32[S] where its q goes (out of range: nowhere)


def draft_sample(logits: jax.Array, md: SamplingMetadata, positions: jax.Array):
    """One draft token per row from the draft's logits f32[S, V]: the argmax for greedy rows, else
    a draw from q = softmax(logits / temperature) cut by min-p, with the row's key at `positions`
    (the position the token takes). -> (i32[S], q f32[S, V]). No top-k / top-p: any q keeps the
    rejection rule exact, and this keeps the cut-off search out of the draft loop (a top-p
    request's drafts outside the nucleus are simply rejected)."""
    q = jax.nn.softmax(warp_logits(logits.astype(jnp.float32), md, needs_sort=False), axis=-1)
    keys = jax.vmap(lambda key: jax.random.fold_in(key, DRAFT_KEY_STREAM))(
        row_keys(md.seeds, positions))
    sampled_ids = categorical(q, keys)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.where(md.temperature < GREEDY_EPS, greedy_ids, sampled_ids), q


def propose_drafts(
    draft_model,  # LlamaForCausalLM (merged)
    draft_kv: KVCache,
    q_store: jax.Array,  # f32[rows, K, V]
    input_ids: jax.Array,  # i32[T] the step's tokens
    positions: jax.Array,  # i32[T]
    md: AttentionMetadata,  # the step's
    sampling: SamplingMetadata,  # per row
    emitted: jax.Array,  # i32[R] what each row emitted (-1: nothing)
    num_accepted: jax.Array,  # i32[S] accepted drafts per sequence (0 if it verified none)
    draft: DraftInputs,
    *,
    attention_backend: str,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """The draft over the step's batch (its cache then holds what the target's does), then up to
    K single-token steps from each sequence's last emitted token. -> (drafts i32[S, K] (-1 where
    none), draft_kv, q_store with the sampled rows' q)."""
    _, draft_kv = draft_model(input_ids, positions, draft_kv, md, attention_backend=attention_backend)
    num_seqs, pages_per_seq = md.page_indices.shape
    page_size = ops.cache_page_size(draft_kv, attention_backend)
    k = q_store.shape[1]
    last_row = draft.seq_rows + num_accepted  # i32[S]
    seq_md = gather_rows(sampling._replace(
        prompt_token_ids=None, output_token_ids=None, bias_token_ids=None, bias_values=None,
        allowed_token_bitmask=None), draft.seq_rows)
    seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)

    def one_step(i, carry):
        kv, tokens, pos, drafts, store = carry  # tokens/pos i32[S]: the input token, its position
        active = (i < draft.draft_k) & (pos // page_size < pages_per_seq)
        # the active sequences first (padding after them, as the attention contract wants)
        order = jnp.argsort(jnp.where(active, 0, 1) * num_seqs + seq_ids)
        act, pos_o = active[order], pos[order]
        pages = jnp.where(act[:, None], md.page_indices[order], 0)  # i32[S, P]
        page = jnp.take_along_axis(pages, jnp.clip(pos_o // page_size, 0, pages_per_seq - 1)[:, None],
                                   axis=1)[:, 0]
        step_md = AttentionMetadata(
            slot_mapping=jnp.where(act, page * page_size + pos_o % page_size, seq_ids % page_size),
            cu_q_lens=jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                       jnp.cumsum(act.astype(jnp.int32))]),
            kv_lens=jnp.where(act, pos_o + 1, 0),
            page_indices=pages,
            num_seqs=jnp.sum(act.astype(jnp.int32))[None],
        )
        hidden, kv = draft_model(jnp.where(act, tokens[order], 0), jnp.where(act, pos_o, 0), kv,
                                 step_md, attention_backend=attention_backend)
        logits = draft_model.compute_logits(hidden, step_md.num_real_tokens)  # f32[S, V]
        logits = logits[jnp.argsort(order)]  # in seq order; inactive ones' rows are zero
        new_tokens, q = draft_sample(logits, seq_md, pos + 1)
        drafts = drafts.at[:, i].set(jnp.where(active, new_tokens, -1))
        store = store.at[jnp.where(active, draft.store_rows, store.shape[0]), i].set(q, mode="drop")
        return kv, jnp.where(active, new_tokens, tokens), pos + 1, drafts, store

    init = (draft_kv, emitted[last_row], sampling.positions[last_row],
            jnp.full((num_seqs, k), -1, jnp.int32), q_store)
    draft_kv, _, _, drafts, q_store = jax.lax.fori_loop(0, jnp.max(draft.draft_k), one_step, init)
    return drafts, draft_kv, q_store


@dataclasses.dataclass
class DraftModel:
    """A draft model's device state: weights, its own paged KV cache (the target's page ids) and
    the store of its draft distributions q (f32[max_num_seqs, K, V], by page-table row)."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    kv_cache: KVCache
    q_store: jax.Array

    @classmethod
    def create(cls, config: ModelConfig, module, engine_config: EngineConfig,
               num_pages: int) -> "DraftModel":
        if ops.unrolled_layers_faster():
            module.unroll_layers()
        pad_code_strides(module)  # as the runner pads the target's (a draft runs on one device)
        graphdef, state = nnx.split(module)
        kv_dtype = engine_config.kv_cache_dtype or engine_config.dtype
        kv_cache = allocate_kv_cache(config, num_pages, engine_config.page_size, kv_dtype,
                                     head_major=ops.head_major_cache(engine_config.attention_backend))
        q_store = jnp.zeros((engine_config.max_num_seqs, engine_config.num_speculative_tokens,
                             config.vocab_size), jnp.float32)
        return cls(config, graphdef, state, kv_cache, q_store)


def load_draft_model(engine_config: EngineConfig, target_config: ModelConfig, target_vocab,
                     target_source: str):
    """(ModelConfig, module) of `engine_config.draft_model`, checked against the target.
    `target_vocab`: the target tokenizer's token -> id dict (None: not checked)."""
    path = engine_config.draft_model
    # int8 activations where the draft has quantized weights (a float draft stays float: its
    # proposals need not match anything, the target's verification decides)
    draft_ec = dataclasses.replace(engine_config, quantization=engine_config.draft_quantization or "auto",
                                   speculative_method=None, draft_model=None,
                                   int8_activations="off" if engine_config.int8_activations == "off"
                                   else "auto")
    config, module = load_model(path, draft_ec)
    draft_vocab = None
    if engine_config.load_format != "dummy" and target_vocab is not None:
        source = model_source(path)
        same = os.path.realpath(source.file) == os.path.realpath(target_source)
        if not same:
            draft_vocab = Tokenizer.from_source(source.path, source.gguf_file).hf_tokenizer.get_vocab()
    check_draft_compatible(target_config, config, target_vocab, draft_vocab)
    return config, module


def check_draft_compatible(target: ModelConfig, draft: ModelConfig, target_vocab: dict | None = None,
                           draft_vocab: dict | None = None) -> None:
    """ValueError unless the draft's token ids mean what the target's do."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model vocab_size={draft.vocab_size} must equal the target's "
                         f"vocab_size={target.vocab_size} (they must share a tokenizer)")
    if target_vocab is not None and draft_vocab is not None and draft_vocab != target_vocab:
        diff = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=str)[:3]
        raise ValueError(f"draft model tokenizer differs from the target's (token -> id mapping; "
                         f"e.g. {diff}): they must share a tokenizer")
