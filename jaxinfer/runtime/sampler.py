"""On-device sampling, run inside the jitted step: one token per row from its logits.

Pure `jnp`: every function here is jit-able and has no state. One row per sampled row (`R`).

Order of the logit transforms (the same as vLLM v1):

1. raw logprobs = `log_softmax(logits)`: the logprobs returned to users are those of the *raw* model
   distribution, before the allowed-token mask, bias, penalties, temperature and truncation (vLLM's
   default "raw_logprobs"). They describe what the model thinks, whatever the request's knobs are.
2. `adjust_logits`: allowed-token bitmask (-inf outside), sparse logit bias (added), penalties
   (repetition on prompt + output tokens, then frequency and presence on output tokens).
3. greedy rows (temperature < `GREEDY_EPS`): exact `argmax` of the adjusted logits (ties: lowest id).
4. `warp_logits`: divide by the temperature, then min-p, then top-k, then top-p (truncated tokens get
   -inf). Ties at a top-k/top-p cut-off are all kept. The cut-offs come from an exact bisection,
   not a sort (see `_top_k_top_p`).
5. One draw from softmax(warped) by a two-level inverse CDF (`categorical`) with two uniforms from
   the row's own key `fold_in(key(seed), position)`: a request's token depends only on its seed,
   its position and its own logits, never on the other rows, the batch size or the static flags.

`sample_any` is what the step calls: it picks `sample`'s fast path on the device, so one
executable serves every mix of requests. The speculative-decoding verification built on these
transforms is runtime/spec_verify.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_TOP_LOGPROBS = 20  # OpenAI's maximum: `sample_any` computes this many when a row asks


class SamplingMetadata(NamedTuple):
    """Device arrays, one entry per sampled row. The optional parts are `None` when no row in the
    batch needs them: the step then compiles without them (a different executable when present)."""

    temperature: jax.Array  # f32[R]  < GREEDY_EPS (0) -> greedy
    top_k: jax.Array  # i32[R]  <= 0 -> off
    top_p: jax.Array  # f32[R]  1.0 -> off; in (0, 1]
    min_p: jax.Array  # f32[R]  0.0 -> off
    seeds: jax.Array  # u32[R]
    positions: jax.Array  # i32[R]  position of the token being sampled
    presence_penalty: jax.Array  # f32[R]  0.0 -> off (OpenAI, on output tokens)
    frequency_penalty: jax.Array  # f32[R]  0.0 -> off (OpenAI, on output tokens)
    repetition_penalty: jax.Array  # f32[R]  1.0 -> off (vLLM/CTRL, on prompt + output tokens)
    prompt_token_ids: jax.Array | None = None  # i32[R, M]  -1 padded; repetition penalty only
    output_token_ids: jax.Array | None = None  # i32[R, M]  -1 padded; all three penalties
    bias_token_ids: jax.Array | None = None  # i32[R, B]  -1 padded
    bias_values: jax.Array | None = None  # f32[R, B]  added to the logits (may be -inf)
    allowed_token_bitmask: jax.Array | None = None  # i32[R, ceil(V/32)] bit t%32 of word t//32 set
    #   -> token t allowed (xgrammar's layout); a row with no constraint is all -1 (all bits set)


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R]  raw-model logprob of the sampled token
    top_token_ids: jax.Array | None  # i32[R, K]  K = num_top_logprobs, best first; None when K == 0
    top_logprobs: jax.Array | None  # f32[R, K]


def default_sampling_metadata(num_rows: int, **overrides) -> SamplingMetadata:
    """Greedy, no truncation, no penalties; seeds 0, positions 0. Handy for padding and tests."""
    fields = dict(
        temperature=jnp.zeros((num_rows,), jnp.float32),
        top_k=jnp.zeros((num_rows,), jnp.int32),
        top_p=jnp.ones((num_rows,), jnp.float32),
        min_p=jnp.zeros((num_rows,), jnp.float32),
        seeds=jnp.zeros((num_rows,), jnp.uint32),
        positions=jnp.zeros((num_rows,), jnp.int32),
        presence_penalty=jnp.zeros((num_rows,), jnp.float32),
        frequency_penalty=jnp.zeros((num_rows,), jnp.float32),
        repetition_penalty=jnp.ones((num_rows,), jnp.float32),
    )
    fields.update(overrides)
    return SamplingMetadata(**fields)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Per-row typed PRNG keys: `fold_in(key(seed), position)`. seeds u32[R], positions i32[R]."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def _token_counts(token_ids: jax.Array, vocab_size: int) -> jax.Array:
    """i32[R, M] (-1 padded) -> f32[R, V] occurrence counts. Out-of-range ids are dropped."""
    num_rows = token_ids.shape[0]
    ids = jnp.where(token_ids < 0, vocab_size, token_ids)  # -1 would wrap around: send it past V
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
    counts = jnp.zeros((num_rows, vocab_size), jnp.float32)
    return counts.at[rows, ids].add(1.0, mode="drop")


def _unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """i32[R, W] -> bool[R, V]: bit j of word i is token 32 * i + j."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[R, W, 32]
    bits = bits.reshape(bitmask.shape[0], -1)
    if bits.shape[1] < vocab_size:
        raise ValueError(f"{bitmask.shape=} must have at least ceil({vocab_size=} / 32) words")
    return bits[:, :vocab_size].astype(bool)


def adjust_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Allowed-token mask, logit bias, then penalties (vLLM v1's order). f32[R, V] -> f32[R, V].

    Repetition penalty (CTRL / vLLM): for tokens seen in the prompt or the output, a positive logit
    is divided by the penalty, a negative one multiplied. Then `logit -= frequency * count` and
    `logit -= presence * (count > 0)` over the output tokens (OpenAI's definition).
    """
    num_rows, vocab_size = logits.shape
    if md.allowed_token_bitmask is not None:
        allowed = _unpack_bitmask(md.allowed_token_bitmask, vocab_size)
        logits = jnp.where(allowed, logits, -jnp.inf)
    if (md.bias_token_ids is None) != (md.bias_values is None):
        raise ValueError("bias_token_ids and bias_values must be given together")
    if md.bias_token_ids is not None:
        ids = jnp.where(md.bias_token_ids < 0, vocab_size, md.bias_token_ids)
        rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
        logits = logits.at[rows, ids].add(md.bias_values.astype(jnp.float32), mode="drop")
    if md.prompt_token_ids is None and md.output_token_ids is None:
        return logits
    seen = jnp.zeros((num_rows, vocab_size), bool)
    if md.prompt_token_ids is not None:
        seen = seen | (_token_counts(md.prompt_token_ids, vocab_size) > 0)
    output_counts = None
    if md.output_token_ids is not None:
        output_counts = _token_counts(md.output_token_ids, vocab_size)  # f32[R, V]
        seen = seen | (output_counts > 0)
    rep = md.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    if output_counts is not None:
        logits = logits - md.frequency_penalty[:, None] * output_counts
        logits = logits - md.presence_penalty[:, None] * (output_counts > 0)
    return logits


def _ordered_u32(x: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (-inf < ... < -0 <= +0 < ... < +inf)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_true(pred, lo: jax.Array, hi: jax.Array, num_iters: int) -> jax.Array:
    """Per row, the largest t in [lo, hi] (u32[R]) with pred(t) true, for a pred that is true at
    lo and non-increasing in t. Bisection; `num_iters` >= log2(hi - lo + 1) makes it exact."""

    def body(_, carry):
        lo, hi = carry
        span = hi - lo
        mid = lo + (span >> 1) + (span & 1)  # ceil((lo + hi) / 2) without overflow
        ok = pred(mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, num_iters, body, (lo, hi))[0]


def _top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """-inf outside the top-k, then outside the smallest top-p nucleus of what is left.

    No sort: each cut-off is found by an exact bisection over the float bit patterns, 32 (top-k)
    plus 30 (top-p) masked reductions over the row, far cheaper than XLA's CPU sort of the
    vocabulary and on par with a sort on a GPU. Ties at a cut-off are all kept.
    """
    num_rows, vocab_size = x.shape
    keys = _ordered_u32(x)  # u32[R, V]
    k = top_k[:, None]
    zeros = jnp.zeros((num_rows,), jnp.uint32)
    k_cut = _largest_true(lambda t: jnp.sum(keys >= t, axis=-1) >= top_k,
                          zeros, jnp.full((num_rows,), 0xFFFFFFFF, jnp.uint32), 32)
    k_off = (k <= 0) | (k >= vocab_size)
    x = jnp.where(k_off | (keys >= k_cut[:, None]), x, -jnp.inf)

    probs = jax.nn.softmax(x, axis=-1)  # f32[R, V]
    prob_bits = jax.lax.bitcast_convert_type(probs, jnp.uint32)  # ordered: probs are >= 0
    one = 0x3F800000  # bits of 1.0f
    p_cut = _largest_true(lambda t: jnp.sum(jnp.where(prob_bits >= t, probs, 0.0), axis=-1) >= top_p,
                          zeros, jnp.full((num_rows,), one, jnp.uint32), 30)
    p_off = top_p[:, None] >= 1.0
    return jnp.where(p_off | (prob_bits >= p_cut[:, None]), x, -jnp.inf)


def categorical(weights: jax.Array, keys: jax.Array, page: int = 256) -> jax.Array:
    """One draw per row from unnormalised weights f32[R, V] (>= 0), by inverse CDF in two levels:
    a group of `page` tokens with probability (its mass / total), then a token within it.

    Two uniforms per row (threefry for 2 numbers, not V): a Gumbel-max draw needs V random
    numbers per row, which on XLA CPU costs more than the rest of the sampler. Each level resolves
    probabilities down to 2^-23 of its own mass. Zero-weight tokens are never drawn (unless the
    whole row is zero: then token 0).
    """
    num_rows, vocab_size = weights.shape
    num_groups = -(-vocab_size // page)
    w = jnp.pad(weights, ((0, 0), (0, num_groups * page - vocab_size)))
    w = w.reshape(num_rows, num_groups, page)
    u = jax.vmap(lambda key: jax.random.uniform(key, (2,), jnp.float32))(keys)  # f32[R, 2]

    def pick(row_weights, u_col):  # f32[R, n], f32[R, 1] -> i32[R]: first cum > u * total
        cum = jnp.cumsum(row_weights, axis=-1)
        index = jnp.sum(cum <= u_col * cum[:, -1:], axis=-1)
        n = row_weights.shape[-1]
        last_positive = jnp.max(jnp.where(row_weights > 0, jnp.arange(n), 0), axis=-1)
        return jnp.minimum(index, last_positive).astype(jnp.int32)  # u * total rounded to total

    group = pick(jnp.sum(w, axis=-1), u[:, :1])  # i32[R]
    in_group = jnp.take_along_axis(w, group[:, None, None], axis=1)[:, 0]  # f32[R, page]
    return group * page + pick(in_group, u[:, 1:])


def _categorical_from_logits(x: jax.Array, keys: jax.Array) -> jax.Array:
    """Draw from softmax(x) per row; -inf entries are never drawn."""
    x_max = jnp.max(x, axis=-1, keepdims=True)
    x_max = jnp.where(jnp.isfinite(x_max), x_max, 0.0)  # a row with nothing allowed
    return categorical(jnp.exp(x - x_max), keys)


def warp_logits(logits: jax.Array, md: SamplingMetadata, *, needs_sort: bool = True) -> jax.Array:
    """Temperature, min-p, top-k, top-p on adjusted logits: f32[R, V] -> f32[R, V], -inf = excluded.

    Greedy rows are left at temperature 1 (their token is the argmax anyway). With
    `needs_sort=False` top-k and top-p are ignored: the caller promises no row uses them.
    `softmax(warp_logits(adjust_logits(l, md), md))` is the distribution `sample` draws from
    (also the target distribution for speculative verification).
    """
    greedy = md.temperature < GREEDY_EPS
    x = logits / jnp.where(greedy, 1.0, md.temperature)[:, None]
    x_max = jnp.max(x, axis=-1, keepdims=True)
    x = jnp.where(x >= x_max + jnp.log(md.min_p)[:, None], x, -jnp.inf)  # p >= min_p * p_max
    if needs_sort:
        x = _top_k_top_p(x, md.top_k, md.top_p)
    return x


def _check_shapes(logits: jax.Array, md: SamplingMetadata) -> None:
    if logits.ndim != 2:
        raise ValueError(f"{logits.shape=} must be [num_rows, vocab_size]")
    num_rows = logits.shape[0]
    for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions",
                 "presence_penalty", "frequency_penalty", "repetition_penalty"):
        shape = getattr(md, name).shape
        if shape != (num_rows,):
            raise ValueError(f"md.{name}.shape={shape} must be ({num_rows},) like the logits' rows")


def sample(
    logits: jax.Array,  # f32[R, V] (any float dtype; computed in f32)
    md: SamplingMetadata,
    *,
    num_top_logprobs: int = 0,
    needs_sort: bool = True,
    all_greedy: bool = False,
) -> SamplerOutput:
    """Sample one token per row. All keyword arguments are static (part of the executable).

    `needs_sort=False` skips the top-k / top-p cut-off search (both ignored): set it when no row
    uses them (`uses_cutoff`). `all_greedy=True` skips the random draw: every row takes the argmax.
    Neither flag changes the token of a row that does not use the skipped feature.
    """
    _check_shapes(logits, md)
    vocab_size = logits.shape[1]
    if not 0 <= num_top_logprobs <= vocab_size:
        raise ValueError(f"{num_top_logprobs=} must be in [0, {vocab_size=}]")
    logits = logits.astype(jnp.float32)
    token_ids = sample_token_ids(logits, md, needs_sort=needs_sort, all_greedy=all_greedy)
    x_max, log_sum = _log_softmax_terms(logits)
    picked = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)  # f32[R, 1]
    token_logprobs = ((picked - x_max) - log_sum)[:, 0]
    top_token_ids = top_logprobs = None
    if num_top_logprobs:
        raw_logprobs = (logits - x_max) - log_sum  # f32[R, V]
        top_logprobs, top_token_ids = jax.lax.top_k(raw_logprobs, num_top_logprobs)
        top_token_ids = top_token_ids.astype(jnp.int32)
    return SamplerOutput(token_ids, token_logprobs, top_token_ids, top_logprobs)


def sample_token_ids(logits: jax.Array, md: SamplingMetadata, *, needs_sort: bool = True,
                     all_greedy: bool = False) -> jax.Array:
    """`sample`'s tokens alone: f32[R, V] -> i32[R] (the flags as there)."""
    adjusted = adjust_logits(logits.astype(jnp.float32), md)
    greedy_ids = _argmax(adjusted)
    if all_greedy:
        return greedy_ids
    x = warp_logits(adjusted, md, needs_sort=needs_sort)
    sampled_ids = _categorical_from_logits(x, row_keys(md.seeds, md.positions))
    return jnp.where(md.temperature < GREEDY_EPS, greedy_ids, sampled_ids)


def _log_softmax_terms(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(max, log(sum(exp(x - max)))), each f32[R, 1]: log_softmax(x) = (x - max) - the second,
    as jax.nn.log_softmax computes it, without writing the [R, V] array."""
    x_max = jnp.max(logits, axis=-1, keepdims=True)
    return x_max, jnp.log(jnp.sum(jnp.exp(logits - x_max), axis=-1, keepdims=True))


def token_logprobs(logits: jax.Array, token_ids: jax.Array) -> jax.Array:
    """The raw model's log_softmax at `token_ids`: f32[R, V], i32[R] -> f32[R]."""
    logits = logits.astype(jnp.float32)
    x_max, log_sum = _log_softmax_terms(logits)
    picked = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)  # f32[R, 1]
    return ((picked - x_max) - log_sum)[:, 0]


ARGMAX_CHUNK = 1024  # vocabulary entries per chunk of `_argmax`'s first pass


def _argmax(x: jax.Array) -> jax.Array:
    """f32[R, V] -> i32[R]: jnp.argmax's result (ties: the lowest id) in one pass over the row.

    The row's maxima per chunk of ARGMAX_CHUNK entries are one plain reduction, which XLA:CPU
    vectorizes; the first chunk that holds the row's maximum is then searched alone. argmax's
    (value, index) pair reduction is several times slower over a 49k vocabulary, and a max then
    a masked min over the whole row reads it twice. NaN logits are not expected: a row of NaNs
    gives 0, as a row of -inf does."""
    num_rows, vocab_size = x.shape
    num_chunks = -(-vocab_size // ARGMAX_CHUNK)
    pad = num_chunks * ARGMAX_CHUNK - vocab_size
    if pad:  # -inf never wins over a real entry, and ties go to the lower (real) id
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    chunks = x.reshape(num_rows, num_chunks, ARGMAX_CHUNK)
    chunk_max = jnp.max(chunks, axis=-1)  # f32[R, C]
    row_max = jnp.max(chunk_max, axis=-1, keepdims=True)  # f32[R, 1]
    chunk_ids = jnp.arange(num_chunks, dtype=jnp.int32)
    chunk = jnp.min(jnp.where(chunk_max == row_max, chunk_ids, num_chunks), axis=-1)  # i32[R]
    chunk = jnp.where(chunk < num_chunks, chunk, 0)  # a row of NaNs
    picked = jnp.take_along_axis(chunks, chunk[:, None, None], axis=1)[:, 0]  # f32[R, ARGMAX_CHUNK]
    within_ids = jnp.arange(ARGMAX_CHUNK, dtype=jnp.int32)
    within = jnp.min(jnp.where(picked == row_max, within_ids, ARGMAX_CHUNK), axis=-1)  # i32[R]
    return jnp.where(within < ARGMAX_CHUNK, chunk * ARGMAX_CHUNK + within, 0)


def gather_rows(md: SamplingMetadata, rows: jax.Array) -> SamplingMetadata:
    """The metadata of rows `rows` (i32[N]) -> N rows."""
    return jax.tree.map(lambda a: a[rows], md)


def uses_cutoff(md: SamplingMetadata) -> jax.Array:
    """bool[]: some sampled row uses top-k or top-p (the only transforms that search the
    vocabulary for a cut-off)."""
    sampled = md.temperature >= GREEDY_EPS  # bool[R]
    return jnp.any(sampled & ((md.top_k > 0) | (md.top_p < 1.0)))


def sample_path(md: SamplingMetadata) -> jax.Array:
    """i32[]: the cheapest `sample` variant that gives every row its token: 0 all rows greedy
    (argmax only), 1 no sampled row uses top-k / top-p (no cut-off search), 2 the full path."""
    sampled = md.temperature >= GREEDY_EPS  # bool[R]
    return jnp.where(uses_cutoff(md), 2, jnp.where(jnp.any(sampled), 1, 0))


# `sample_any`'s logprob_level: what the step's rows asked for
NO_LOGPROBS, TOKEN_LOGPROBS, TOP_LOGPROBS = 0, 1, 2


def sample_any(logits: jax.Array, md: SamplingMetadata, logprob_level: jax.Array) -> SamplerOutput:
    """`sample` with its fast path chosen on the device (`sample_path`, `lax.switch`), not by
    recompiling; the chosen tokens' logprobs only when `logprob_level` (i32[]) is at least
    TOKEN_LOGPROBS (else zeros: at 64 rows the exponentials of the log-softmax cost more than
    the greedy argmax), and top logprobs (MAX_TOP_LOGPROBS of them) at TOP_LOGPROBS. One
    executable serves every mix of requests, so warm-up covers all traffic; a row's token is the
    same whichever branch runs (the flags only skip work no row needs). An allowed-token
    bitmask that is all ones (the engine gives one to every step) is skipped the same way: the
    paths without it run, so a free step neither unpacks the mask nor copies the logits
    (docs/performance.md, the last section)."""
    branches = [
        lambda l, m: sample_token_ids(l, m, all_greedy=True),
        lambda l, m: sample_token_ids(l, m, needs_sort=False),
        lambda l, m: sample_token_ids(l, m, needs_sort=True),
    ]

    def pick(m: SamplingMetadata) -> jax.Array:
        return jax.lax.switch(sample_path(m), branches, logits, m)

    if md.allowed_token_bitmask is None:
        token_ids = pick(md)
    else:  # all ones in a step with no constrained row: sample as if there were no mask
        unmasked = md._replace(allowed_token_bitmask=None)
        token_ids = jax.lax.cond(jnp.any(md.allowed_token_bitmask != -1),
                                 lambda: pick(md), lambda: pick(unmasked))
    num_rows = logits.shape[0]
    logprobs = jax.lax.cond(logprob_level >= TOKEN_LOGPROBS, token_logprobs,
                            lambda l, ids: jnp.zeros((num_rows,), jnp.float32), logits, token_ids)

    def top(l):
        vals, ids = jax.lax.top_k(jax.nn.log_softmax(l.astype(jnp.float32), axis=-1), MAX_TOP_LOGPROBS)
        return ids.astype(jnp.int32), vals

    def no_top(l):
        return (jnp.zeros((num_rows, MAX_TOP_LOGPROBS), jnp.int32),
                jnp.zeros((num_rows, MAX_TOP_LOGPROBS), jnp.float32))

    top_ids, top_lps = jax.lax.cond(logprob_level >= TOP_LOGPROBS, top, no_top, logits)
    return SamplerOutput(token_ids, logprobs, top_ids, top_lps)
