"""runtime/sampler.py against numpy references: exact greedy, batch independence, distributions
(chi-square), penalties, logit bias, allowed-token mask, logprobs; and runtime/spec_verify.py's
verification: the rejection rule for a draft model's drafts, matching for n-gram drafts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer.runtime import sampler, spec_verify
from jaxinfer.runtime.sampler import default_sampling_metadata

NUM_DRAWS = 20_000
P_MIN = 0.01  # chi-square p-value floor (the draws are seeded: the test is deterministic)


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "needs_sort", "all_greedy"))
def _sample(logits, md, num_top_logprobs=0, needs_sort=True, all_greedy=False):
    return sampler.sample(logits, md, num_top_logprobs=num_top_logprobs, needs_sort=needs_sort,
                          all_greedy=all_greedy)


_rejection_sample = jax.jit(spec_verify.rejection_sample)
_adjust_logits = jax.jit(sampler.adjust_logits)


def _md(num_rows, **fields):
    arrays = {}
    dtypes = dict(temperature=np.float32, top_k=np.int32, top_p=np.float32, min_p=np.float32,
                  seeds=np.uint32, positions=np.int32, presence_penalty=np.float32,
                  frequency_penalty=np.float32, repetition_penalty=np.float32)
    for name, value in fields.items():
        if value is None:
            arrays[name] = None
        elif name in dtypes:
            arrays[name] = jnp.asarray(np.broadcast_to(np.asarray(value, dtypes[name]), (num_rows,)))
        else:
            arrays[name] = jnp.asarray(value)
    return default_sampling_metadata(num_rows, **arrays)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _reference_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """float64 numpy: temperature -> min-p -> top-k -> top-p, renormalised (no ties in logits)."""
    probs = np.exp(_log_softmax(np.asarray(logits, np.float64) / temperature))
    keep = probs >= min_p * probs.max()
    order = np.argsort(-probs, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    if top_p < 1.0:
        sorted_probs = kept[order]
        mass_before = np.cumsum(sorted_probs) - sorted_probs
        keep[order[mass_before >= top_p]] = False
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


def _assert_matches(samples, probs, vocab_size):
    counts = np.bincount(np.asarray(samples), minlength=vocab_size)
    assert counts.shape == (vocab_size,)
    excluded = probs == 0
    assert counts[excluded].sum() == 0, f"excluded tokens sampled: {counts=} {probs=}"
    expected = probs[~excluded] * counts.sum()
    p_value = stats.chisquare(counts[~excluded], expected).pvalue
    assert p_value > P_MIN, f"{p_value=} {counts=} expected={expected}"


# A small vocab with well separated probabilities (no ties, no top-p boundary within 0.03).
V_SMALL = 8
PROBS_SMALL = np.array([0.10, 0.30, 0.01, 0.15, 0.04, 0.20, 0.12, 0.08])
LOGITS_SMALL = np.log(PROBS_SMALL).astype(np.float32) + 1.5


def test_greedy_is_exact_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 64)).astype(np.float32) * 3  # (16, 64): shared executables
    # near-ties within float32: argmax must still be exact (first max on exact ties)
    logits[3, 10] = logits[3].max() + np.float32(1e-6)
    logits[4, :] = 0.0
    md = _md(16, temperature=0.0, top_k=5, top_p=0.5, min_p=0.3, seeds=np.arange(16))
    for flags in (dict(), dict(needs_sort=False), dict(all_greedy=True)):
        out = _sample(jnp.asarray(logits), md, **flags)
        np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(logits, axis=-1))
    assert int(out.token_ids[4]) == 0


def test_greedy_rows_in_a_mixed_batch():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, 64)).astype(np.float32)
    temperature = np.tile(np.array([0.0, 1.0, 0.0, 0.8, 0.0, 1e-7, 2.0, 0.0], np.float32), 2)
    out = _sample(jnp.asarray(logits), _md(16, temperature=temperature, seeds=np.arange(16)))
    greedy = temperature < sampler.GREEDY_EPS
    np.testing.assert_array_equal(np.asarray(out.token_ids)[greedy], np.argmax(logits, -1)[greedy])


def _row_params(rng, num_rows):
    return dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.3], num_rows).astype(np.float32),
        top_k=rng.choice([0, 0, 3, 10], num_rows).astype(np.int32),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5], num_rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.0, 0.05], num_rows).astype(np.float32),
        seeds=rng.integers(0, 2**32, num_rows, dtype=np.uint64).astype(np.uint32),
        positions=rng.integers(0, 5000, num_rows).astype(np.int32),
    )


def test_batch_independence():
    """A row's token depends only on its own seed, position, params and logits."""
    rng = np.random.default_rng(2)
    vocab_size, num_rows, num_other = 128, 12, 20
    logits = rng.normal(size=(num_rows, vocab_size)).astype(np.float32) * 2
    params = _row_params(rng, num_rows)
    alone = np.asarray(_sample(jnp.asarray(logits), _md(num_rows, **params)).token_ids)
    # one row at a time (batch of 1)
    for r in (0, 5, 11):
        one = _sample(jnp.asarray(logits[r:r + 1]),
                      _md(1, **{n: v[r:r + 1] for n, v in params.items()})).token_ids
        assert int(one[0]) == alone[r]
    # shuffled among other rows with other logits and params, in a bigger batch
    other_logits = rng.normal(size=(num_other, vocab_size)).astype(np.float32) * 2
    other_params = _row_params(rng, num_other)
    perm = rng.permutation(num_rows + num_other)
    big_logits = np.concatenate([logits, other_logits])[perm]
    big_params = {n: np.concatenate([params[n], other_params[n]])[perm] for n in params}
    big_md = _md(num_rows + num_other, **big_params)
    big = np.asarray(_sample(jnp.asarray(big_logits), big_md).token_ids)
    inverse = np.argsort(perm)
    np.testing.assert_array_equal(big[inverse[:num_rows]], alone)


def test_static_flags_do_not_change_unaffected_rows():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(16, 64)).astype(np.float32))
    md = _md(16, temperature=0.9, min_p=0.02, seeds=np.arange(16) * 7919, positions=np.arange(16))
    with_sort = _sample(logits, md, needs_sort=True).token_ids
    without_sort = _sample(logits, md, needs_sort=False).token_ids
    np.testing.assert_array_equal(np.asarray(with_sort), np.asarray(without_sort))
    # neutral penalties with a history present: same tokens as without the optional part
    history = jnp.asarray(rng.integers(-1, 64, size=(16, 5)).astype(np.int32))
    with_history = _sample(logits, md._replace(output_token_ids=history, prompt_token_ids=history))
    np.testing.assert_array_equal(np.asarray(with_history.token_ids), np.asarray(with_sort))
    # the step's choice of fast path (sample_any): 0 all greedy, 1 no cut-off search, 2 full
    greedy_top_k = _md(3, temperature=np.zeros(3), top_k=np.array([5, 0, 0]), top_p=np.ones(3))
    assert not bool(sampler.uses_cutoff(greedy_top_k)) and int(sampler.sample_path(greedy_top_k)) == 0
    top_p_row = _md(2, temperature=np.array([0, 1.0]), top_k=np.zeros(2), top_p=np.array([1.0, 0.9]))
    assert bool(sampler.uses_cutoff(top_p_row)) and int(sampler.sample_path(top_p_row)) == 2
    assert int(sampler.sample_path(_md(2, temperature=np.array([0, 1.0])))) == 1


def test_seed_and_position_drive_the_draw():
    logits = jnp.asarray(np.zeros((16, 64), np.float32))
    same = _sample(logits, _md(16, temperature=1.0, seeds=5, positions=9)).token_ids
    assert len(set(np.asarray(same).tolist())) == 1
    by_seed = _sample(logits, _md(16, temperature=1.0, seeds=np.arange(16), positions=9)).token_ids
    by_pos = _sample(logits, _md(16, temperature=1.0, seeds=5, positions=np.arange(16))).token_ids
    assert len(set(np.asarray(by_seed).tolist())) > 8
    assert len(set(np.asarray(by_pos).tolist())) > 8


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=1.4, top_k=6, top_p=0.8, min_p=0.1),
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_distribution_matches_renormalised_target(params):
    logits = jnp.asarray(np.broadcast_to(LOGITS_SMALL, (NUM_DRAWS, V_SMALL)))
    md = _md(NUM_DRAWS, seeds=np.arange(NUM_DRAWS), positions=17, **params)
    samples = _sample(logits, md).token_ids
    _assert_matches(samples, _reference_probs(LOGITS_SMALL, **params), V_SMALL)


def test_truncation_never_picks_excluded_tokens_on_a_large_vocab():
    rng = np.random.default_rng(4)
    num_rows, vocab_size = 64, 1000
    logits = rng.normal(size=(num_rows, vocab_size)).astype(np.float32) * 3
    params = dict(temperature=rng.uniform(0.5, 2.0, num_rows).astype(np.float32),
                  top_k=rng.choice([0, 1, 5, 50], num_rows).astype(np.int32),
                  top_p=rng.choice([1.0, 0.3, 0.9], num_rows).astype(np.float32),
                  min_p=rng.choice([0.0, 0.1], num_rows).astype(np.float32))
    for trial in range(4):
        md = _md(num_rows, seeds=np.arange(num_rows) + 1000 * trial, **params)
        tokens = np.asarray(_sample(jnp.asarray(logits), md).token_ids)
        for r in range(num_rows):
            probs = _reference_probs(logits[r], params["temperature"][r], params["top_k"][r],
                                     params["top_p"][r], params["min_p"][r])
            assert probs[tokens[r]] > 0, (r, params["top_k"][r], params["top_p"][r])


def test_truncation_sets_match_reference():
    """The kept set of warp_logits (bisection cut-offs) equals the numpy sort-based reference."""
    rng = np.random.default_rng(9)
    num_rows, vocab_size = 16, 300
    scale = rng.uniform(0.5, 4, (num_rows, 1))
    logits = (rng.normal(size=(num_rows, vocab_size)) * scale).astype(np.float32)
    params = dict(temperature=rng.uniform(0.3, 2.0, num_rows).astype(np.float32),
                  top_k=np.array([0, 1, 2, 7, 50, 299, 300, 1000] * 2, np.int32),
                  top_p=np.array([0.8, 0.3, 1.0, 0.999, 0.1, 0.5, 0.95, 1.0] * 2, np.float32),
                  min_p=np.array([0.0] * 12 + [0.01, 0.1, 0.5, 0.9], np.float32))
    md = _md(num_rows, **params)
    kept = np.isfinite(np.asarray(jax.jit(sampler.warp_logits)(jnp.asarray(logits), md)))
    for r in range(num_rows):
        want = _reference_probs(logits[r], params["temperature"][r], params["top_k"][r],
                                params["top_p"][r], params["min_p"][r]) > 0
        np.testing.assert_array_equal(kept[r], want, err_msg=f"row {r}")
    # ties at the cut-off are all kept
    tied = np.array([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]], np.float32)
    tied_md = _md(1, temperature=1.0, top_k=2)
    got = np.isfinite(np.asarray(jax.jit(sampler.warp_logits)(jnp.asarray(tied), tied_md)))
    np.testing.assert_array_equal(got[0], [True, False, True, True, True, False])


def _reference_adjust(logits, prompt_ids, output_ids, presence, frequency, repetition,
                      bias_ids=None, bias_values=None):
    out = np.array(logits, np.float64)
    for r in range(out.shape[0]):
        if bias_ids is not None:
            for t, b in zip(bias_ids[r], bias_values[r]):
                if t >= 0:
                    out[r, t] += b
        counts = np.bincount(output_ids[r][output_ids[r] >= 0], minlength=out.shape[1])
        seen = (counts > 0) | (np.bincount(prompt_ids[r][prompt_ids[r] >= 0],
                                           minlength=out.shape[1]) > 0)
        rep = np.where(out[r] > 0, out[r] / repetition[r], out[r] * repetition[r])
        out[r] = np.where(seen, rep, out[r])
        out[r] -= frequency[r] * counts + presence[r] * (counts > 0)
    return out


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(5)
    num_rows, vocab_size = 6, 40
    logits = rng.normal(size=(num_rows, vocab_size)).astype(np.float32) * 2
    prompt_ids = rng.integers(0, vocab_size, size=(num_rows, 9)).astype(np.int32)
    output_ids = rng.integers(0, 12, size=(num_rows, 7)).astype(np.int32)  # repeats likely
    prompt_ids[:, 6:] = -1
    output_ids[1, 3:] = -1
    output_ids[2, :] = -1
    presence = np.array([0.0, 0.5, 1.0, -0.5, 2.0, 0.0], np.float32)
    frequency = np.array([0.0, 0.3, 0.0, 1.0, -0.2, 0.7], np.float32)
    repetition = np.array([1.0, 1.2, 1.5, 0.8, 1.0, 2.0], np.float32)
    md = _md(num_rows, presence_penalty=presence, frequency_penalty=frequency,
             repetition_penalty=repetition, prompt_token_ids=prompt_ids, output_token_ids=output_ids)
    got = np.asarray(_adjust_logits(jnp.asarray(logits), md))
    want = _reference_adjust(logits, prompt_ids, output_ids, presence, frequency, repetition)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    greedy = _sample(jnp.asarray(logits), md).token_ids
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(want, axis=-1))


def test_logit_bias_and_allowed_mask():
    rng = np.random.default_rng(6)
    num_rows, vocab_size = 4, 70  # not a multiple of 32
    logits = rng.normal(size=(num_rows, vocab_size)).astype(np.float32)
    bias_ids = np.array([[5, 69, -1], [3, 3, -1], [-1, -1, -1], [0, 1, 2]], np.int32)
    bias_values = np.array([[100.0, -5.0, 9.0], [1.0, 2.0, 9.0], [9.0, 9.0, 9.0],
                            [-np.inf, -np.inf, -np.inf]], np.float32)
    md = _md(num_rows, bias_token_ids=bias_ids, bias_values=bias_values)
    got = np.asarray(_adjust_logits(jnp.asarray(logits), md))
    want = _reference_adjust(logits, np.full((4, 1), -1), np.full((4, 1), -1), np.zeros(4),
                             np.zeros(4), np.ones(4), bias_ids, bias_values)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert int(_sample(jnp.asarray(logits), md).token_ids[0]) == 5
    # -inf bias: never sampled, at any temperature
    hot = md._replace(temperature=jnp.full((4,), 5.0), seeds=jnp.arange(4, dtype=jnp.uint32))
    for position in range(20):
        tokens = _sample(jnp.asarray(logits), hot._replace(
            positions=jnp.full((4,), position, jnp.int32))).token_ids
        assert int(tokens[3]) not in (0, 1, 2)

    # allowed-token bitmask (xgrammar layout): row 0 allows {7, 40, 69}; row 1 all; rows 2-3 {33}
    allowed = np.zeros((num_rows, vocab_size), bool)
    allowed[0, [7, 40, 69]] = True
    allowed[1] = True
    allowed[2:, 33] = True
    padded = np.zeros((num_rows, 96), bool)
    padded[:, :vocab_size] = allowed
    bits = (padded.reshape(num_rows, 3, 32) * (1 << np.arange(32, dtype=np.uint64))).sum(-1)
    bitmask = bits.astype(np.uint32).view(np.int32)
    md = _md(num_rows, temperature=3.0, seeds=np.arange(num_rows), allowed_token_bitmask=bitmask)
    got = np.asarray(_adjust_logits(jnp.asarray(logits), md))
    np.testing.assert_array_equal(np.isfinite(got), allowed)
    for position in range(30):
        tokens = np.asarray(_sample(jnp.asarray(logits), md._replace(
            positions=jnp.full((num_rows,), position, jnp.int32))).token_ids)
        assert allowed[np.arange(num_rows), tokens].all()
    # an all-ones mask (a step whose rows are all unconstrained) leaves logits and draws as
    # they are without one
    ones = _md(num_rows, temperature=3.0, seeds=np.arange(num_rows),
               allowed_token_bitmask=np.full((num_rows, 3), -1, np.int32))
    none = ones._replace(allowed_token_bitmask=None)
    np.testing.assert_array_equal(np.asarray(_adjust_logits(jnp.asarray(logits), ones)),
                                  np.asarray(_adjust_logits(jnp.asarray(logits), none)))
    np.testing.assert_array_equal(np.asarray(_sample(jnp.asarray(logits), ones).token_ids),
                                  np.asarray(_sample(jnp.asarray(logits), none).token_ids))


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(7)
    num_rows, vocab_size = 5, 50
    logits = rng.normal(size=(num_rows, vocab_size)).astype(np.float32) * 4
    md = _md(num_rows, temperature=np.array([0.0, 0.5, 1.0, 2.0, 1.0]), top_k=np.array([0, 3, 0, 0, 1]),
             seeds=np.arange(num_rows), repetition_penalty=1.5,
             output_token_ids=rng.integers(0, vocab_size, (num_rows, 4)).astype(np.int32))
    out = _sample(jnp.asarray(logits), md, num_top_logprobs=4)
    want = _log_softmax(logits)
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs), want[np.arange(num_rows), tokens], atol=2e-5)
    order = np.argsort(-want, axis=-1)[:, :4]
    np.testing.assert_array_equal(np.asarray(out.top_token_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs),
                               np.take_along_axis(want, order, -1), atol=2e-5)
    assert _sample(jnp.asarray(logits), md).top_token_ids is None


@pytest.mark.parametrize("greedy", [True, False])
def test_sample_any_computes_logprobs_only_at_the_level_asked(greedy):
    rng = np.random.default_rng(11)
    num_rows, vocab_size = 6, 40
    logits = jnp.asarray(rng.normal(size=(num_rows, vocab_size)).astype(np.float32) * 3)
    md = _md(num_rows, temperature=0.0 if greedy else 0.8, seeds=np.arange(num_rows),
             positions=np.arange(num_rows))
    full = _sample(logits, md, num_top_logprobs=sampler.MAX_TOP_LOGPROBS, needs_sort=False)
    run = jax.jit(sampler.sample_any)
    none, token, top = (run(logits, md, jnp.int32(level)) for level in (
        sampler.NO_LOGPROBS, sampler.TOKEN_LOGPROBS, sampler.TOP_LOGPROBS))
    for out in (none, token, top):  # the same tokens whatever is asked
        np.testing.assert_array_equal(np.asarray(out.token_ids), np.asarray(full.token_ids))
    np.testing.assert_array_equal(np.asarray(none.logprobs), np.zeros(num_rows, np.float32))
    np.testing.assert_array_equal(np.asarray(none.top_token_ids), 0)
    np.testing.assert_array_equal(np.asarray(token.logprobs), np.asarray(full.logprobs))
    np.testing.assert_array_equal(np.asarray(token.top_logprobs), 0.0)
    np.testing.assert_array_equal(np.asarray(top.logprobs), np.asarray(full.logprobs))
    np.testing.assert_array_equal(np.asarray(top.top_token_ids), np.asarray(full.top_token_ids))
    np.testing.assert_allclose(np.asarray(top.top_logprobs), np.asarray(full.top_logprobs),
                               atol=1e-6)


def test_shape_errors():
    with pytest.raises(ValueError, match="md.top_k.shape"):
        sampler.sample(jnp.zeros((3, 8)), default_sampling_metadata(3)._replace(top_k=jnp.zeros(2)))
    with pytest.raises(ValueError, match="num_top_logprobs"):
        sampler.sample(jnp.zeros((3, 8)), default_sampling_metadata(3), num_top_logprobs=9)


# ---------------------------------------------------------------- rejection sampler

def _draw(rng, probs):
    """One categorical draw per row from probs [N, V] (numpy, inverse CDF)."""
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random((probs.shape[0], 1)) * cdf[:, -1:]
    return np.minimum((u > cdf).sum(-1), probs.shape[-1] - 1).astype(np.int32)


def _normalize(x):
    return x / x.sum()


V_SPEC, K_SPEC = 6, 2
P_TARGET = np.array([[0.05, 0.40, 0.10, 0.25, 0.15, 0.05],
                     [0.30, 0.05, 0.05, 0.20, 0.10, 0.30],
                     [0.10, 0.10, 0.40, 0.10, 0.20, 0.10]])  # [k+1, V]
Q_DRAFT = np.array([[0.30, 0.20, 0.20, 0.10, 0.10, 0.10],
                    [0.10, 0.30, 0.10, 0.30, 0.10, 0.10]])  # [k, V]


def _spec_rows(num_rows, draft_ids, draft_probs, num_draft=K_SPEC, seed_offset=0):
    keys = sampler.row_keys(jnp.arange(num_rows, dtype=jnp.uint32) + seed_offset,
                            jnp.full((num_rows,), 3, jnp.int32))
    target = jnp.asarray(np.broadcast_to(P_TARGET, (num_rows, K_SPEC + 1, V_SPEC)), jnp.float32)
    q = jnp.asarray(np.broadcast_to(draft_probs, (num_rows, K_SPEC, V_SPEC)), jnp.float32)
    out, num_accepted = _rejection_sample(
        target, q, jnp.asarray(draft_ids), jnp.full((num_rows,), num_draft, jnp.int32), keys)
    return np.asarray(out), np.asarray(num_accepted)


def _check_spec_output_shape(out, num_accepted, num_draft=K_SPEC):
    assert ((num_accepted >= 0) & (num_accepted <= num_draft)).all()
    for n in range(num_draft + 1):
        rows = num_accepted == n
        assert (out[rows, :n + 1] >= 0).all() and (out[rows, n + 1:] == -1).all()


def test_rejection_sampler_matches_target_with_draft_probs():
    num_rows = 3 * NUM_DRAWS
    rng = np.random.default_rng(8)
    draft_ids = np.stack([_draw(rng, np.broadcast_to(Q_DRAFT[j], (num_rows, V_SPEC)))
                          for j in range(K_SPEC)], axis=1)
    out, num_accepted = _spec_rows(num_rows, draft_ids, Q_DRAFT)
    _check_spec_output_shape(out, num_accepted)
    accepted_drafts = out[:, :K_SPEC] == draft_ids
    assert (accepted_drafts[np.arange(num_rows), 0] == (num_accepted >= 1)).all()
    # acceptance rate of the first draft: sum_x min(p, q)
    rate = np.minimum(P_TARGET[0], Q_DRAFT[0]).sum()
    assert abs((num_accepted >= 1).mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / num_rows)
    # first emitted token ~ p0 (whether accepted or replaced)
    _assert_matches(out[:, 0], P_TARGET[0], V_SPEC)
    # the replacement after a rejection ~ normalize(max(0, p0 - q0))
    rejected = num_accepted == 0
    _assert_matches(out[rejected, 0], _normalize(np.maximum(P_TARGET[0] - Q_DRAFT[0], 0)), V_SPEC)
    # the token after an accepted first draft ~ p1; after all accepted, the bonus ~ p2
    _assert_matches(out[num_accepted >= 1, 1], P_TARGET[1], V_SPEC)
    _assert_matches(out[num_accepted == 2, 2], P_TARGET[2], V_SPEC)
    assert (num_accepted == 2).sum() > 2000


@jax.jit
def _verify_ngram(logits, md, spec):
    sampled = sampler.sample(logits, md)
    return sampled, spec_verify.verify_drafts(logits, md, sampled, spec)


def test_matched_ngram_drafts_emit_the_sampled_tokens_and_follow_the_target():
    """n-gram drafts (q one-hot) are verified by matching the rows' own seeded draws: the emitted
    tokens are exactly the tokens `sample` draws at those positions (what decoding one token at
    a time gives), and they follow the rejection rule's distributions: the first ~ p0, after a
    rejected draft ~ p0 without the draft, then ~ p1 and the bonus ~ p2; P(accept) = p0(draft)."""
    num_seqs = NUM_DRAWS
    rows = num_seqs * (K_SPEC + 1)
    logits = jnp.asarray(np.log(np.tile(P_TARGET, (num_seqs, 1))), jnp.float32)  # f32[rows, V]
    md = _md(rows, temperature=1.0, seeds=np.repeat(np.arange(num_seqs) + 77, K_SPEC + 1),
             positions=np.tile(np.arange(K_SPEC + 1) + 3, num_seqs))
    spec = spec_verify.SpecInputs(
        row_ids=jnp.arange(rows, dtype=jnp.int32).reshape(num_seqs, K_SPEC + 1),
        draft_ids=jnp.asarray(np.tile([[1, 0]], (num_seqs, 1)), jnp.int32),  # p0[1]=0.4, p1[0]=0.3
        num_draft=jnp.full((num_seqs,), K_SPEC, jnp.int32),
        seq_ids=jnp.arange(num_seqs, dtype=jnp.int32),
        store_rows=jnp.arange(num_seqs, dtype=jnp.int32))
    sampled, (verified, num_accepted) = _verify_ngram(logits, md, spec)
    drawn = np.asarray(sampled.token_ids).reshape(num_seqs, K_SPEC + 1)
    out = np.asarray(verified.token_ids).reshape(num_seqs, K_SPEC + 1)
    num_accepted = np.asarray(num_accepted)
    _check_spec_output_shape(out, num_accepted)
    emitted = out >= 0
    np.testing.assert_array_equal(out[emitted], drawn[emitted])
    np.testing.assert_array_equal(np.asarray(verified.logprobs)[emitted.reshape(-1)],
                                  np.asarray(sampled.logprobs)[emitted.reshape(-1)])
    rate = P_TARGET[0, 1]
    assert abs((num_accepted >= 1).mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / num_seqs)
    _assert_matches(out[:, 0], P_TARGET[0], V_SPEC)
    after_rejection = np.where(np.arange(V_SPEC) == 1, 0.0, P_TARGET[0])
    _assert_matches(out[num_accepted == 0, 0], _normalize(after_rejection), V_SPEC)
    _assert_matches(out[num_accepted >= 1, 1], P_TARGET[1], V_SPEC)
    _assert_matches(out[num_accepted == 2, 2], P_TARGET[2], V_SPEC)


def test_rejection_sampler_bonus_comes_from_num_draft():
    """Rows with fewer real drafts than k take their bonus from p[num_draft]; num_draft 0 = decode."""
    num_rows = NUM_DRAWS
    draft_ids = np.tile(np.array([[1, -1]], np.int32), (num_rows, 1))
    out, num_accepted = _spec_rows(num_rows, draft_ids, Q_DRAFT, num_draft=1, seed_offset=10**6)
    _check_spec_output_shape(out, num_accepted, num_draft=1)
    _assert_matches(out[num_accepted == 1, 1], P_TARGET[1], V_SPEC)
    out, num_accepted = _spec_rows(num_rows, draft_ids, Q_DRAFT, num_draft=0,
                                   seed_offset=2 * 10**6)
    assert (num_accepted == 0).all() and (out[:, 1:] == -1).all()
    _assert_matches(out[:, 0], P_TARGET[0], V_SPEC)


def test_rejection_sampler_greedy_rows():
    # argmax of P_TARGET rows: 1, 0 (first max of the 0.30 tie), 2
    target = jnp.asarray(np.broadcast_to(P_TARGET, (5, 3, V_SPEC)), jnp.float32)
    draft_ids = jnp.asarray([[1, 0], [1, 5], [4, 0], [1, 0], [1, 0]], jnp.int32)
    num_draft = jnp.asarray([2, 2, 2, 1, 0], jnp.int32)
    keys = sampler.row_keys(jnp.arange(5, dtype=jnp.uint32), jnp.zeros(5, jnp.int32))
    greedy = jnp.ones(5, bool)
    q = jnp.asarray(np.broadcast_to(Q_DRAFT, (5, 2, V_SPEC)), jnp.float32)
    out, num_accepted = _rejection_sample(target, q, draft_ids, num_draft, keys, is_greedy=greedy)
    np.testing.assert_array_equal(np.asarray(num_accepted), [2, 1, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(out), [[1, 0, 2], [1, 0, -1], [1, -1, -1],
                                                    [1, 0, -1], [1, -1, -1]])
    # an explicit target_argmax (from the logits) overrides argmax(target_probs)
    target_argmax = jnp.asarray(np.tile([[1, 5, 3]], (5, 1)), jnp.int32)
    out, num_accepted = _rejection_sample(target, q, draft_ids, num_draft, keys,
                                          is_greedy=greedy, target_argmax=target_argmax)
    np.testing.assert_array_equal(np.asarray(num_accepted), [1, 2, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(out)[1], [1, 5, 3])


@pytest.mark.parametrize("vocab_size", [1000, 3 * sampler.ARGMAX_CHUNK, 32000, 49152])
def test_greedy_argmax_matches_jnp_argmax_with_ties_and_masked_rows(vocab_size):
    """The sampler's argmax (chunk maxima, then the first chunk holding the row's maximum)
    equals jnp.argmax at vocabularies of one chunk, whole chunks and a padded last chunk: ties
    go to the lowest id (within a chunk and across chunks), a row with every token masked to
    -inf gives 0."""
    rng = np.random.default_rng(11)
    logits = rng.integers(-3, 4, (8, vocab_size)).astype(np.float32)  # many ties at the maximum
    logits[2] = -np.inf
    logits[4, :vocab_size // 2] = -np.inf
    logits[5] = -1.0
    logits[5, [vocab_size - 1, vocab_size // 2 + 1]] = 2.0  # tie across chunks: the lower id wins
    logits[6] = -1.0
    logits[6, vocab_size - 1] = 0.5  # the maximum in the last (padded) chunk alone
    x = jnp.asarray(logits)
    got = np.asarray(sampler._argmax(x))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, -1)))
    assert got[5] == vocab_size // 2 + 1 and got[6] == vocab_size - 1 and got[2] == 0


def test_greedy_argmax_of_a_nan_row_is_zero():
    logits = np.zeros((2, 3000), np.float32)
    logits[0] = np.nan
    logits[1, 2500] = 1.0
    np.testing.assert_array_equal(np.asarray(sampler._argmax(jnp.asarray(logits))), [0, 2500])
