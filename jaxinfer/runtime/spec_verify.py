"""Speculative decoding's verification, on the device inside the step: which drafts the target
accepts, and the token it emits after them.

Every verified position is a sampled row of the step, so `sample` has already drawn the target's
own token there (greedy rows: the exact argmax; sampled rows: a draw keyed by
`fold_in(key(seed), position)`, the key decoding one token at a time uses at that position).

- n-gram drafts (deterministic: q one-hot) are verified by matching: a row accepts the longest
  prefix of drafts equal to the target's own tokens, then emits the target's token at the first
  mismatch (or the bonus position). For a sampled row this is the rejection rule for a one-hot q:
  draft x is accepted with probability p(x), and on a mismatch the emitted token is a draw from p
  given that it is not x, i.e. from normalize(max(0, p - q)). And the emitted tokens are exactly
  the tokens decoding one token at a time with the same seed gives: drafts and the batch change
  how many steps a request takes, never its tokens (`match_drafts`).
- A draft model's drafts (q a real distribution, from its store: runtime/draft_model.py) use the
  rejection rule (Leviathan et al. 2023; Chen et al. 2023): accept draft x with probability
  min(1, p(x) / q(x)), on a rejection draw from normalize(max(0, p - q)), after k acceptances draw
  a bonus token from p, so the emitted tokens are distributed exactly as the target's. p is
  softmax(warp_logits(adjust_logits(logits))), the distribution `sample` draws from. Keys:
  `fold_in(key(seed), position)` of the row's first verified position, so results do not depend
  on the batch. Greedy rows match, as above.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.runtime.sampler import (GREEDY_EPS, SamplerOutput, SamplingMetadata, adjust_logits,
                                      categorical, gather_rows, row_keys, token_logprobs,
                                      uses_cutoff, warp_logits)


class SpecInputs(NamedTuple):
    """Which rows verify which drafts (see sched/step_input.py)."""

    row_ids: jax.Array  # i32[Sv, K+1] rows of each verified position; R (out of range) = padding
    draft_ids: jax.Array  # i32[Sv, K] -1 padded
    num_draft: jax.Array  # i32[Sv]
    seq_ids: jax.Array  # i32[Sv] the sequence (S = padding)
    store_rows: jax.Array  # i32[Sv] where the draft model keeps this sequence's q


def match_drafts(target_ids: jax.Array, draft_ids: jax.Array, num_draft: jax.Array):
    """Verification by matching: target_ids i32[N, K+1] (the target's own token at each verified
    position: argmax or seeded draw), draft_ids i32[N, K], num_draft i32[N] -> (emitted
    i32[N, K+1] (the accepted drafts, the target's own token, then -1), num_accepted i32[N])."""
    k = draft_ids.shape[1]
    valid = jnp.arange(k)[None, :] < num_draft[:, None]
    accept = (draft_ids == target_ids[:, :k]) & valid
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # i32[N]
    emitted = jnp.where(jnp.arange(k + 1)[None, :] <= num_accepted[:, None], target_ids, -1)
    return emitted.astype(jnp.int32), num_accepted.astype(jnp.int32)


def rejection_sample(
    target_probs: jax.Array,  # f32[R, k+1, V]  target distribution at each draft position + bonus
    draft_probs: jax.Array,  # f32[R, k, V]  the draft model's q at each draft position
    draft_token_ids: jax.Array,  # i32[R, k]
    num_draft: jax.Array,  # i32[R]  real drafts per row (<= k); the rest is padding
    keys: jax.Array,  # key[R]  one typed PRNG key per row (e.g. row_keys(seeds, positions))
    *,
    is_greedy: jax.Array | None = None,  # bool[R]  rows verified by exact argmax match
    target_argmax: jax.Array | None = None,  # i32[R, k+1]  exact argmax of the target logits
) -> tuple[jax.Array, jax.Array]:
    """Verification of a draft model's drafts (Leviathan et al. 2023; Chen et al. 2023).

    Draft token j is accepted with probability min(1, p_j(x) / q_j(x)); the first rejection draws
    its replacement from normalize(max(0, p_j - q_j)); when all `num_draft` drafts are accepted a
    bonus token comes from p[num_draft]. The emitted tokens are then distributed exactly as the
    target. Greedy rows accept while the draft equals the target argmax and then emit that argmax
    (pass `target_argmax` from the logits for an exact argmax; otherwise argmax of `target_probs`).

    Returns `output_token_ids` i32[R, k+1] (the accepted drafts, then the replacement or bonus
    token, then -1) and `num_accepted` i32[R] (accepted drafts; the row emits num_accepted + 1).
    """
    num_rows, k_plus_1, vocab_size = target_probs.shape
    k = k_plus_1 - 1
    if draft_token_ids.shape != (num_rows, k):
        raise ValueError(
            f"{draft_token_ids.shape=} must be ({num_rows}, {k}) for {target_probs.shape=}")
    if draft_probs.shape != (num_rows, k, vocab_size):
        raise ValueError(f"{draft_probs.shape=} must be ({num_rows}, {k}, {vocab_size})")
    if num_draft.shape != (num_rows,) or keys.shape != (num_rows,):
        raise ValueError(f"{num_draft.shape=} and {keys.shape=} must be ({num_rows},)")
    target_probs = target_probs.astype(jnp.float32)
    rows = jnp.arange(num_rows)
    draft_ids = jnp.clip(draft_token_ids, 0, vocab_size - 1)  # padding may be -1
    valid = jnp.arange(k)[None, :] < num_draft[:, None]  # bool[R, k]

    p_draft = jnp.take_along_axis(target_probs[:, :k], draft_ids[..., None], axis=-1)[..., 0]
    draft_probs = draft_probs.astype(jnp.float32)
    q_draft = jnp.take_along_axis(draft_probs, draft_ids[..., None], axis=-1)[..., 0]
    uniform = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0), (k,)))(keys)
    accept = uniform * q_draft < p_draft  # u < p / q without dividing by q
    if is_greedy is not None:
        if target_argmax is None:
            target_argmax = jnp.argmax(target_probs, axis=-1)
        target_argmax = target_argmax.astype(jnp.int32)  # i32[R, k+1]
        accept = jnp.where(is_greedy[:, None], draft_token_ids == target_argmax[:, :k], accept)
    accept = accept & valid
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # i32[R]

    # The one extra token: replacement at the first rejection, or bonus after all drafts.
    p_last = target_probs[rows, num_accepted]  # f32[R, V]
    rejected = num_accepted < num_draft
    if k > 0:
        q_last = draft_probs[rows, jnp.minimum(num_accepted, k - 1)]
        residual = jnp.maximum(p_last - q_last, 0.0)
        use_residual = rejected & (jnp.sum(residual, axis=-1) > 0)  # 0: p == q up to rounding
        dist = jnp.where(use_residual[:, None], residual, p_last)
    else:
        dist = p_last
    last = categorical(dist, jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys))
    if is_greedy is not None:
        last = jnp.where(is_greedy, target_argmax[rows, num_accepted], last)

    positions = jnp.arange(k + 1)[None, :]
    drafts = jnp.pad(draft_token_ids.astype(jnp.int32), ((0, 0), (0, 1)), constant_values=-1)
    output_token_ids = jnp.where(
        positions < num_accepted[:, None], drafts,
        jnp.where(positions == num_accepted[:, None], last[:, None], -1))
    return output_token_ids, num_accepted.astype(jnp.int32)


def target_probs(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """f32[N, V]: softmax(warp_logits(adjust_logits(logits))), the distribution `sample` draws
    from; the top-k/top-p search runs only when some sampled row uses it."""
    x = adjust_logits(logits.astype(jnp.float32), md)
    x = jax.lax.cond(uses_cutoff(md), functools.partial(warp_logits, needs_sort=True),
                     functools.partial(warp_logits, needs_sort=False), x, md)
    return jax.nn.softmax(x, axis=-1)


def verify_drafts(
    logits: jax.Array,  # f32[R, V] the target's logits at every sampled row
    md: SamplingMetadata,  # per row
    sampled: SamplerOutput,  # `sample` on those rows (greedy rows: the exact argmax)
    spec: SpecInputs,
    draft_probs_store: jax.Array | None = None,  # f32[rows, K, V] a draft model's q; None: n-gram
) -> tuple[SamplerOutput, jax.Array]:
    """Verifies the drafts (n-gram: `match_drafts` on every row; a draft model's: the rejection
    rule, greedy rows matched); returns the sampler output with each verified row's token
    replaced by what it emits (accepted draft, then the target's own token, then -1) and its raw
    logprob, and num_accepted i32[Sv]."""
    num_spec, k_plus_1 = spec.row_ids.shape
    vocab_size = logits.shape[-1]
    flat = spec.row_ids.reshape(-1)  # i32[Sv*(K+1)]; padding R gathers row R-1, scatters nowhere
    target_ids = sampled.token_ids[flat].reshape(num_spec, k_plus_1)
    first = spec.row_ids[:, 0]
    is_greedy = md.temperature[first] < GREEDY_EPS  # padding rows: whatever row R-1 is

    def matched(_):  # every emitted token is the sampled one of its row, logprob included
        emitted, num_accepted = match_drafts(target_ids, spec.draft_ids, spec.num_draft)
        logprobs = sampled.logprobs[flat].reshape(num_spec, k_plus_1)
        return emitted, num_accepted, logprobs

    def rejection(_):
        probs = target_probs(logits[flat], gather_rows(md, flat))
        keys = row_keys(md.seeds[first], md.positions[first])
        emitted, num_accepted = rejection_sample(
            probs.reshape(num_spec, k_plus_1, vocab_size), draft_probs_store[spec.store_rows],
            spec.draft_ids, spec.num_draft, keys, is_greedy=is_greedy, target_argmax=target_ids)
        logprobs = token_logprobs(logits[flat], jnp.maximum(emitted.reshape(-1), 0))
        return emitted, num_accepted, logprobs.reshape(num_spec, k_plus_1)

    if draft_probs_store is None:  # n-gram drafts (q one-hot): matching is their rejection rule
        emitted, num_accepted, logprobs = matched(None)
    else:
        emitted, num_accepted, logprobs = jax.lax.cond(jnp.all(is_greedy), matched, rejection,
                                                       None)
    out = sampled._replace(
        token_ids=sampled.token_ids.at[flat].set(emitted.reshape(-1), mode="drop"),
        logprobs=sampled.logprobs.at[flat].set(logprobs.reshape(-1), mode="drop"))
    return out, num_accepted
