"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and on-device verification.

How a step goes (engine.py, sched/scheduler.py, runtime/step.py):

1. Between steps a decoding request holds up to k drafts (`Request.spec_token_ids`): from
   `NgramProposer` (host, numpy) or from the draft model's loop in the previous step.
2. The scheduler schedules 1 + k new tokens for it (its last token, then the drafts) in the same
   ragged step as everyone's prefills and decodes; the step computes the target's logits at all
   1 + k positions (k + 1 sampled rows) and `verify_drafts` runs on the device:
   greedy rows accept the longest prefix of drafts equal to the target's argmax, then take the
   target's argmax (exactly what decoding one token at a time gives); sampled rows use the
   rejection rule (Leviathan et al.): accept draft x with probability min(1, p(x) / q(x)), on a
   rejection draw from normalize(max(0, p - q)), after k acceptances draw a bonus token from p.
   p is softmax(warp_logits(adjust_logits(logits))): the distribution `sample` draws from.
   n-gram drafts are deterministic (q one-hot). Keys: `fold_in(key(seed), position)` of the row's
   first verified position, so results do not depend on the batch.
3. `Scheduler.update` appends the emitted tokens and lowers `num_computed_tokens` past the
   rejected drafts; their K/V is simply overwritten later (pages past the end are freed).

The draft model (`DraftModel`) shares the target's tokenizer and its page ids: it has its own KV
cache array with the same page layout, and every step also runs the draft over the step's batch
(`propose_drafts`), so its cache holds exactly the tokens the target's holds (prefix-cache hits,
preemption and rollback need nothing extra). Then, in the same jitted call, it runs up to K
single-token steps (`lax.fori_loop`) from each sequence's last emitted token and returns the
drafts for the next step; for sampled rows their draft distributions q stay on the device, in a
store indexed by the request's page-table row, until the next step verifies them. The draft's
K/V for its own drafts lands in pages the scheduler holds for it (`num_lookahead`). A draft whose
vocabulary differs from the target's (size or token -> id mapping) is refused with ValueError.
Costs to know: the draft's pass over the batch runs in every step, also when the policy gives
nobody drafts (that is what keeps its cache complete; a draft ~10x smaller than the target costs
~10% there), and the q store takes max_num_seqs * K * V * 4 bytes (64 x 4 x 49152: 48 MiB).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache, allocate_kv_cache
from jaxinfer.runtime.sampler import (GREEDY_EPS, SamplerOutput, SamplingMetadata, _categorical,
                                      adjust_logits, rejection_sample, row_keys, warp_logits)

DRAFT_KEY_STREAM = 0x5D  # fold_in constant: the draft's own random numbers at a position


# ----------------------------------------------------------------------------- n-gram lookup
@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = ngram_max down
    to ngram_min) in the request's own prompt + output and propose the tokens that followed it.
    Host-side numpy: one vectorised scan of the tokens per n."""

    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self):
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max} must satisfy "
                             "1 <= ngram_min <= ngram_max")

    def propose(self, token_ids, k: int) -> list[int]:
        """Up to `k` drafts continuing `token_ids` (prompt + output so far); [] when no n-gram
        of the suffix occurred before. Prefers the latest match that has k tokens after it."""
        if k <= 0:
            return []
        tokens = np.asarray(token_ids, np.int64)  # i64[L]
        length = tokens.shape[0]
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            suffix = tokens[length - n:]
            starts = np.flatnonzero(tokens[:length - n] == suffix[0])  # a match leaves >= 1 token
            for j in range(1, n):
                starts = starts[tokens[starts + j] == suffix[j]]
            if starts.size:
                full = starts[starts <= length - n - k]
                start = int(full[-1] if full.size else starts[-1]) + n
                return tokens[start:start + k].tolist()
        return []


# ----------------------------------------------------------------------------- verification
class SpecInputs(NamedTuple):
    """Which rows verify which drafts (see sched/step_input.py)."""

    row_ids: jax.Array  # i32[Sv, K+1] rows of each verified position; R (out of range) = padding
    draft_ids: jax.Array  # i32[Sv, K] -1 padded
    num_draft: jax.Array  # i32[Sv]
    seq_ids: jax.Array  # i32[Sv] the sequence (S = padding)
    store_rows: jax.Array  # i32[Sv] where the draft model keeps this sequence's q


def greedy_verify(target_ids: jax.Array, draft_ids: jax.Array, num_draft: jax.Array):
    """Exact greedy verification. target_ids i32[N, K+1] (the target's argmax at each verified
    position), draft_ids i32[N, K], num_draft i32[N] -> (emitted i32[N, K+1] (-1 after the
    target's own token), num_accepted i32[N])."""
    k = draft_ids.shape[1]
    valid = jnp.arange(k)[None, :] < num_draft[:, None]
    accept = (draft_ids == target_ids[:, :k]) & valid
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # i32[N]
    emitted = jnp.where(jnp.arange(k + 1)[None, :] <= num_accepted[:, None], target_ids, -1)
    return emitted.astype(jnp.int32), num_accepted.astype(jnp.int32)


def _gather_rows(md: SamplingMetadata, rows: jax.Array) -> SamplingMetadata:
    return jax.tree.map(lambda a: a[rows], md)


def target_probs(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """f32[N, V]: softmax(warp_logits(adjust_logits(logits))), the distribution `sample` draws
    from; the top-k/top-p search runs only when some sampled row uses it."""
    x = adjust_logits(logits.astype(jnp.float32), md)
    sampled = md.temperature >= GREEDY_EPS
    needs_sort = jnp.any(sampled & ((md.top_k > 0) | (md.top_p < 1.0)))
    x = jax.lax.cond(needs_sort, functools.partial(warp_logits, needs_sort=True),
                     functools.partial(warp_logits, needs_sort=False), x, md)
    return jax.nn.softmax(x, axis=-1)


def verify_drafts(
    logits: jax.Array,  # f32[R, V] the target's logits at every sampled row
    md: SamplingMetadata,  # per row
    sampled: SamplerOutput,  # `sample` on those rows (greedy rows: the exact argmax)
    spec: SpecInputs,
    draft_probs_store: jax.Array | None = None,  # f32[rows, K, V] a draft model's q; None: n-gram
) -> tuple[SamplerOutput, jax.Array]:
    """Verifies the drafts; returns the sampler output with each verified row's token replaced
    by what it emits (accepted draft, then the target's own token, then -1) and its raw logprob,
    and num_accepted i32[Sv]."""
    num_spec, k_plus_1 = spec.row_ids.shape
    vocab_size = logits.shape[-1]
    flat = spec.row_ids.reshape(-1)  # i32[Sv*(K+1)]; padding R gathers row R-1, scatters nowhere
    target_ids = sampled.token_ids[flat].reshape(num_spec, k_plus_1)
    first = spec.row_ids[:, 0]
    is_greedy = md.temperature[first] < GREEDY_EPS  # padding rows: whatever row R-1 is

    def greedy(_):
        return greedy_verify(target_ids, spec.draft_ids, spec.num_draft)

    def rejection(_):
        probs = target_probs(logits[flat], _gather_rows(md, flat))
        q = None if draft_probs_store is None else draft_probs_store[spec.store_rows]
        keys = row_keys(md.seeds[first], md.positions[first])
        return rejection_sample(probs.reshape(num_spec, k_plus_1, vocab_size), q, spec.draft_ids,
                                spec.num_draft, keys, is_greedy=is_greedy, target_argmax=target_ids)

    emitted, num_accepted = jax.lax.cond(jnp.all(is_greedy), greedy, rejection, None)
    flat_emitted = emitted.reshape(-1)
    raw = jax.nn.log_softmax(logits[flat].astype(jnp.float32), axis=-1)
    logprobs = jnp.take_along_axis(raw, jnp.maximum(flat_emitted, 0)[:, None], axis=-1)[:, 0]
    out = sampled._replace(
        token_ids=sampled.token_ids.at[flat].set(flat_emitted, mode="drop"),
        logprobs=sampled.logprobs.at[flat].set(logprobs, mode="drop"))
    return out, num_accepted


# ----------------------------------------------------------------------------- the draft model
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
    sampled_ids = _categorical(q, keys)
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
    page_size = draft_kv.k.shape[2]
    k = q_store.shape[1]
    last_row = draft.seq_rows + num_accepted  # i32[S]
    seq_md = _gather_rows(sampling._replace(
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
        logits = draft_model.compute_logits(hidden)[jnp.argsort(order)]  # f32[S, V] in seq order
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
        graphdef, state = nnx.split(module)
        kv_dtype = engine_config.kv_cache_dtype or engine_config.dtype
        kv_cache = allocate_kv_cache(config, num_pages, engine_config.page_size, kv_dtype)
        q_store = jnp.zeros((engine_config.max_num_seqs, engine_config.num_speculative_tokens,
                             config.vocab_size), jnp.float32)
        return cls(config, graphdef, state, kv_cache, q_store)


def load_draft_model(engine_config: EngineConfig, target_config: ModelConfig, target_vocab,
                     target_source: str):
    """(ModelConfig, module) of `engine_config.draft_model`, checked against the target.
    `target_vocab`: the target tokenizer's token -> id dict (None: not checked)."""
    from jaxinfer.models.loader import load_model, model_source
    from jaxinfer.tokenizer import Tokenizer

    path = engine_config.draft_model
    draft_ec = dataclasses.replace(engine_config, quantization=engine_config.draft_quantization,
                                   speculative_method=None, draft_model=None)
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
