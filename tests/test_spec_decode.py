"""Speculative decoding: proposers, policy, rollback (host, fake model), verification statistics
(tiny model logits), end to end on the tiny Llama (random draft: many rejections) and on SmolLM2
(greedy output identical with and without speculation)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import shutil
import types

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.request import Request
from jaxinfer.sched.output import RunnerOutput
from jaxinfer.sched.spec_policy import PROBE_INTERVAL, SpecPolicy
from jaxinfer.sched.step_input import make_step_input
from tests.sched.fake_runner import Harness, fake_next_token, make_request, solo_outputs

# A budget that prefills a whole batch in one step keeps its sequences in lockstep, and no prefix
# cache keeps every prefill whole: few shapes, few compiles.
TINY_KW = dict(num_pages=128, page_size=8, max_num_seqs=8, max_num_batched_tokens=256,
               max_model_len=128, enable_prefix_caching=False)
NUM_DRAWS = 20_000
P_MIN = 0.01


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------------------ host only
def test_ngram_proposer_prefers_long_recent_matches():
    from jaxinfer.runtime.spec_decode import NgramProposer

    ngram = NgramProposer(ngram_min=1, ngram_max=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0: propose what followed it
    assert ngram.propose(tokens, 3) == [4, 5, 9]
    # suffix [7, 2, 3]? no; [2, 3] occurs at 1 and 6: the latest with k tokens after it wins
    assert ngram.propose([5, 2, 3, 4, 6, 2, 3, 8, 9, 0, 2, 3], 2) == [8, 9]
    assert ngram.propose([5, 2, 3, 4, 6, 2, 3, 8, 2, 3], 4) == [4, 6, 2, 3]  # only 0 has 4 after
    assert ngram.propose([5, 2, 3, 4, 6, 2, 3, 8, 2, 3], 2) == [8, 2]
    assert ngram.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert NgramProposer(2, 3).propose([1, 2, 5, 2], 3) == []  # a 1-gram match is not enough
    assert ngram.propose([7, 7, 7, 7], 3) == [7]  # overlapping run: as much as there is
    assert ngram.propose(tokens, 0) == []
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 2)


def test_ngram_lookup_prefers_the_longest_match_and_says_its_length():
    """Of the occurrences of the matched n-gram, the one that repeats the most of the last tokens
    wins (then the latest with k tokens after it), and its length comes with the drafts, counted
    up to k + 1 tokens."""
    from jaxinfer.runtime.spec_decode import NgramProposer, ngram_drafts

    ngram = NgramProposer(ngram_min=2, ngram_max=3)
    #         0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    tokens = [9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 6, 7, 9, 1, 2, 3]
    # [1, 2, 3] occurs at 1 (preceded by 9, as the suffix is: 4 tokens) and at 7 (by 8: 3)
    assert ngram.lookup(tokens, 3) == ([4, 5, 8], 4)
    # k = 1 counts no further than 2 tokens: both occurrences are 3 long, the latest wins
    assert ngram.lookup(tokens, 1) == ([6], 3)
    # a run repeated further back than k + 1 tokens: the count stops there
    assert ngram.lookup([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 2) == ([7, 8], 3)
    assert ngram.lookup([1, 2, 3, 4], 3) == ([], 0)
    assert ngram.lookup(tokens, 0) == ([], 0)
    assert ngram.propose(tokens, 3) == [4, 5, 8]
    # the policy cuts the drafts by the match: a long one is a copy (up to its length - 1 drafts
    # whatever alpha's threshold allows), a short one gets at most one draft
    policy = SpecPolicy(num_speculative_tokens=8, max_batched_tokens=64, min_accept_prob=0.3)
    copying = [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5]
    assert ngram_drafts(NgramProposer(2, 4), policy, _req(), copying, 1) == [6, 8, 9, 10]
    assert ngram_drafts(NgramProposer(2, 4), policy, _req(), [4, 1, 2, 7, 8, 1, 2], 1) == [7]
    assert ngram_drafts(NgramProposer(2, 4), policy, _req(spec_enabled=False), copying, 1) == []


def test_may_match_next_is_false_only_where_no_next_token_gives_a_match():
    """`may_match_next` (the scheduler may run a speculating request's next step ahead where it
    is False): over random sequences of a small vocabulary, wherever it says no, the lookup
    after every possible next token finds nothing; it says no for a last token new to the
    sequence, and always yes with 1-gram matches allowed."""
    from jaxinfer.runtime.spec_decode import NgramProposer

    rng = np.random.default_rng(5)
    ngram = NgramProposer(ngram_min=2, ngram_max=4)
    said_no = 0
    for _ in range(300):
        tokens = rng.integers(0, 12, rng.integers(2, 30)).tolist()
        may = ngram.may_match_next(tokens)
        assert may == (tokens[-1] in tokens[:-1])
        if not may:
            said_no += 1
            assert all(ngram.lookup(tokens + [c], 4) == ([], 0) for c in range(12))
        assert NgramProposer(ngram_min=1, ngram_max=4).may_match_next(tokens)
    assert 30 <= said_no <= 270  # both answers are exercised


def _req(**kw) -> Request:
    req = make_request("r", [1, 2, 3])
    req.spec_enabled = True
    for k, v in kw.items():
        setattr(req, k, v)
    return req


def test_spec_policy_adapts_k_to_acceptance_and_batch():
    policy = SpecPolicy(num_speculative_tokens=4, max_batched_tokens=64, min_accept_prob=0.3)
    req = _req()
    assert policy.acceptance(req) == pytest.approx(0.75)
    assert policy.num_drafts(req, 1) == 4  # 0.75**4 = 0.32 >= 0.3
    ks = []
    while (k := policy.num_drafts(req, 1)) > 0:  # everything rejected: k shrinks to 0
        ks.append(k)
        policy.observe(req, k, 0)
    assert ks == [4, 2, 1, 1]
    for _ in range(PROBE_INTERVAL - 1):  # steps without drafts, then one probe
        policy.observe(req, 0, 0)
        assert policy.num_drafts(req, 1) == 0
    policy.observe(req, 0, 0)
    assert policy.num_drafts(req, 1) == 1
    ks = []
    while (k := policy.num_drafts(req, 1)) < 4:  # everything accepted: back to k = 4
        ks.append(k)
        policy.observe(req, k, k)
    assert ks == [1, 1, 1, 2], ks
    # batch rule: 64 // n - 1 drafts each, off beyond 32 requests
    assert [policy.num_drafts(req, n) for n in (8, 16, 21, 32, 33, 64)] == [4, 3, 2, 1, 0, 0]
    assert policy.num_drafts(_req(spec_enabled=False), 1) == 0
    assert policy.num_drafts_for_acceptance(0.6) == 2 and policy.num_drafts_for_acceptance(0.2) == 0
    # the batch budget from measured step times: the largest step within 1.5x a one-token step
    assert SpecPolicy.calibrated_max_batched_tokens({1: .05, 2: .06, 4: .07, 8: .1, 16: .2}) == 4
    assert SpecPolicy.calibrated_max_batched_tokens({1: .01, 8: .01, 64: .012, 256: .03}) == 64


def test_spec_policy_trusts_a_long_match():
    """A prompt-lookup match of LONG_MATCH tokens or more may have up to its length - 1 drafts
    (rule 2 and K still cap them) whatever alpha's threshold says; with measured step times the
    count with the most tokens per unit of step time where drafts are kept together,
    E(j) = 1 + alpha j; a shorter match keeps the threshold rule, cut to its length - 1."""
    plain = SpecPolicy(8, max_batched_tokens=64, min_accept_prob=0.3)
    low = _req(spec_accept_num=0.4, spec_accept_den=1.0)  # the threshold rule: 1 draft
    assert plain.num_drafts(low, 1) == 1
    assert [plain.num_drafts(low, 1, match_len=n) for n in (4, 6, 9, 30)] == [3, 5, 8, 8]
    assert plain.num_drafts(low, 16, match_len=30) == 3  # rule 2: 64 // 16 - 1
    assert plain.num_drafts(_req(spec_enabled=False), 1, match_len=30) == 0
    high = _req(spec_accept_num=0.95, spec_accept_den=1.0)  # the threshold rule: 8
    assert [plain.num_drafts(high, 1, match_len=n) for n in (1, 2, 3)] == [1, 1, 2]
    cpu = ((1, 1.0), (2, 1.4), (4, 2.1), (8, 2.8), (9, 3.0), (16, 3.4), (32, 6.0))
    policy = SpecPolicy(8, max_batched_tokens=64, min_accept_prob=0.3, step_seconds=cpu)
    # alpha 0.4, (1 + 0.4 j) / c: j=1 1.4/1.4=1.0, j=3 2.2/2.1=1.05, j=7 3.8/2.8=1.36,
    # j=8 4.2/3.0=1.40: the best
    assert policy.num_drafts(low, 1, match_len=30) == 8
    # a match of 6: j <= 5, where j=5 gives 3.0/2.8=1.07 and j=3 1.05, both under MIN_GAIN: none
    assert policy.num_drafts(low, 1, match_len=6) == 0
    assert policy.num_drafts(high, 1, match_len=6) == 5  # 5.75/2.8=2.05


def test_spec_policy_weighs_drafts_by_measured_step_cost():
    """With step times measured, rule 1 takes the draft count with the most expected tokens per
    unit of step time (by hand below), drafts nothing unless that beats a plain step by
    MIN_GAIN, and probes less often where a probe's step costs more; with flat step times (a
    latency-bound device) the threshold rule alone decides."""
    cpu = ((1, 1.0), (2, 1.4), (4, 2.1), (8, 2.8), (9, 2.8), (16, 3.4), (32, 6.0))
    policy = SpecPolicy(8, max_batched_tokens=64, min_accept_prob=0.3, step_seconds=cpu)
    plain = SpecPolicy(8, max_batched_tokens=64, min_accept_prob=0.3)
    req = _req()  # alpha 0.75: the threshold rule allows 4 (0.75**4 >= 0.3)
    assert plain.num_drafts(req, 1) == 4
    # tokens per step time, E(j) / c(1 + j): j=1 1.75/1.4=1.25, j=2 2.31/2.1=1.10,
    # j=3 2.73/2.1=1.30, j=4 3.05/2.8 (padded to 8 tokens)=1.09
    assert policy.num_drafts(req, 1) == 3
    # alpha 0.6: threshold 2; j=1 1.6/1.4=1.14, j=2 1.96/2.1=0.93
    assert policy.num_drafts(_req(spec_accept_num=0.6, spec_accept_den=1.0), 1) == 1
    # alpha 0.5: threshold 1; j=1 1.5/1.4=1.07 < MIN_GAIN: none
    half = _req(spec_accept_num=0.5, spec_accept_den=1.0)
    assert plain.num_drafts(half, 1) == 1 and policy.num_drafts(half, 1) == 0
    # alpha 0.95: threshold 8; j=8 (1 - 0.95**9)/0.05=6.30/2.8=2.25, the best
    assert policy.num_drafts(_req(spec_accept_num=0.95, spec_accept_den=1.0), 1) == 8
    # 4 requests: steps of 4 (2.1) against 8, 12->16, 16, 20->32 tokens:
    # j=1 1.75*2.1/2.8=1.31, j=2 2.31*2.1/3.4=1.43, j=3 2.73*2.1/3.4=1.69, j=4 3.05*2.1/6.0=1.07
    assert policy.num_drafts(req, 4) == 3
    # probes: a 2-token step costs 0.4 more, so one every 0.4 / PROBE_OVERHEAD steps
    assert policy.probe_interval(1) == 20 > PROBE_INTERVAL == plain.probe_interval(1)
    for _ in range(19):
        policy.observe(half, 0, 0)
    assert policy.num_drafts(half, 1) == 0
    policy.observe(half, 0, 0)
    assert policy.num_drafts(half, 1) == 1
    # flat step times: the same counts as the threshold rule alone
    flat = SpecPolicy(8, max_batched_tokens=64, min_accept_prob=0.3,
                      step_seconds=((1, 1.0), (8, 1.0), (16, 1.05), (64, 1.1)))
    for alpha in (0.4, 0.5, 0.6, 0.75, 0.9):
        r = _req(spec_accept_num=alpha, spec_accept_den=1.0)
        assert flat.num_drafts(r, 1) == plain.num_drafts(r, 1) > 0, alpha
    assert flat.probe_interval(1) == PROBE_INTERVAL


def test_calibrated_budget_grants_a_request_alone_all_its_drafts():
    """Where steps grow from their first token (the knee is one token), a request alone may still
    verify its K drafts, while requests sharing a step share min(K, SHARED_DRAFTS) + 1 tokens:
    K = 16 alone -> 16 drafts, two requests 9 // 2 - 1 = 3 each, eight none; K <= 8 shares K + 1
    as before. Where the knee is higher it is the budget of both, and requests sharing a step
    have at most SHARED_DRAFTS drafts each, calibrated or not."""
    from jaxinfer.sched.spec_policy import SHARED_DRAFTS

    assert SHARED_DRAFTS == 8
    slow = {1: 1.0, 2: 1.6, 4: 2.0, 8: 3.0, 16: 5.0, 17: 5.2, 32: 9.0}
    wide = SpecPolicy(16, min_accept_prob=0.3).calibrated(slow)
    assert (wide.max_batched_tokens, wide.max_tokens_alone) == (9, 17)
    assert [wide.max_drafts_for_batch(n) for n in (1, 2, 3, 4, 8)] == [16, 3, 2, 1, 0]
    assert [wide.max_drafts(_req(), n) for n in (1, 2, 3, 4, 8)] == [16, 3, 2, 1, 0]
    narrow = SpecPolicy(4, min_accept_prob=0.3).calibrated(slow)
    assert (narrow.max_batched_tokens, narrow.max_tokens_alone) == (5, 5)
    assert [narrow.max_drafts_for_batch(n) for n in (1, 2, 3)] == [4, 1, 0]
    flat = {1: 1.0, 8: 1.0, 64: 1.2, 128: 1.4, 256: 2.0}
    gpu = SpecPolicy(16, min_accept_prob=0.3).calibrated(flat)
    assert (gpu.max_batched_tokens, gpu.max_tokens_alone) == (128, 128)
    assert [gpu.max_drafts_for_batch(n) for n in (1, 8, 64)] == [127, 15, 1]
    assert [gpu.max_drafts(_req(), n) for n in (1, 2, 8, 64)] == [16, 8, 8, 1]
    uncalibrated = SpecPolicy(16, min_accept_prob=0.3)  # a budget of 64 until warm-up times steps
    assert [uncalibrated.max_drafts(_req(), n) for n in (1, 2, 8, 16, 64)] == [16, 8, 7, 3, 0]
    # a budget given (not calibrated) applies to a request alone too
    given = SpecPolicy(16, max_batched_tokens=6, min_accept_prob=0.3)
    assert given.max_drafts_for_batch(1) == 5
    assert given.max_drafts(_req(), 1) == 5
    assert wide.max_drafts(_req(spec_enabled=False), 1) == 0


def test_calibration_sets_the_budget_from_timed_steps(tiny_ngram_llm, monkeypatch):
    """warmup()'s calibration times steps of real tokens (here on a virtual clock: a step of t
    real tokens sampling r real rows takes 1 ms + 0.1 ms t + 0.05 ms r, whatever its bucket):
    one sequence of 1 .. K + 1 tokens in a verification's layout, then each larger token bucket
    full, as a batch. It sets rule 2's budget to the largest count within 1.5x of a one-token
    step, or K + 1 where that is less."""
    import jaxinfer.engine.llm_engine as llm_engine

    eng = tiny_ngram_llm.engine
    before = eng.scheduler.spec_policy
    k = eng.engine_config.num_speculative_tokens
    clock = [0.0]
    timed: dict[int, float] = {}

    def execute(si):
        n = int(si.num_seqs[0])
        cu, t = si.cu_q_lens, int(si.cu_q_lens[-1])
        q_lens = np.diff(cu)[:n]
        assert (q_lens > 0).all() and (cu[n:] == t).all()  # n sequences, then padding
        np.testing.assert_array_equal(si.kv_lens[:n], q_lens)  # prompts from position 0
        assert (si.kv_lens[n:] == 0).all() and (si.page_indices == 0).all()  # the null page
        if t <= k + 1:  # a single stream, each token a sampled row (1 + t - 1 drafts)
            assert n == 1 and (si.spec_row_ids is not None) == (t > 1)
            rows = t
        else:  # a full bucket as a batch: a row a sequence
            assert si.shape[0] == t and n == min(t, eng.engine_config.max_num_seqs)
            assert si.spec_row_ids is None
            rows = n
        seconds = 1e-3 + 1e-4 * t + 5e-5 * rows
        clock[0] += seconds
        timed[t] = seconds

    monkeypatch.setattr(eng.runner, "execute", execute)
    monkeypatch.setattr(llm_engine, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    try:
        budget = eng.calibrate_speculation()
        assert sorted(timed) == list(range(1, k + 2)) + [
            t for t in eng.buckets.token_buckets if t > k + 1]
        knee = max(t for t, s in timed.items() if s <= 1.5 * timed[1])
        assert budget == eng.scheduler.spec_policy.max_batched_tokens == max(knee, k + 1)
        # rule 1's step times: each count's (the best of its timings; here all alike)
        assert dict(eng.scheduler.spec_policy.step_seconds) == pytest.approx(timed)
        assert 1 < knee < max(timed)
        # a slower device: the knee is 1 token, and one request may still verify K drafts
        clock[0] = 0.0
        monkeypatch.setattr(eng.runner, "execute", lambda si: clock.__setitem__(
            0, clock[0] + 1e-3 * int(si.cu_q_lens[-1])))
        assert eng.calibrate_speculation() == k + 1
    finally:
        eng.scheduler.spec_policy = before


def test_check_draft_compatible():
    from jaxinfer.config import ModelConfig
    from jaxinfer.runtime.draft_model import check_draft_compatible

    cfg = ModelConfig("llama", 100, 8, 16, 1, 2, 1, 4)
    check_draft_compatible(cfg, cfg, {"a": 0, "b": 1}, {"a": 0, "b": 1})
    with pytest.raises(ValueError, match="vocab_size=101"):
        check_draft_compatible(cfg, ModelConfig("llama", 101, 8, 16, 1, 2, 1, 4))
    with pytest.raises(ValueError, match="tokenizer"):
        check_draft_compatible(cfg, cfg, {"a": 0, "b": 1}, {"a": 1, "b": 0})


def test_step_input_rows_see_the_drafts_before_them():
    """A verifying request's rows: one per new token, each sampling the next position with the
    output history (penalties) and min_tokens ban of a request whose drafts before it were
    accepted; then update() keeps the accepted drafts + the target's token and rolls back."""
    from jaxinfer.sched.scheduler import Scheduler
    from jaxinfer.sched.step_input import make_step_input
    from tests.sched.fake_runner import EOS, make_config

    cfg = make_config(page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                      speculative_method="ngram", num_speculative_tokens=3)
    sched = Scheduler(cfg, 32, 64, (EOS,), spec_policy=SpecPolicy(3, 1000, 0.0))
    a = make_request("a", [10, 11, 12, 13, 14], max_tokens=20, min_tokens=3, seed=7,
                     repetition_penalty=1.5)
    b = make_request("b", [20, 21], max_tokens=20, seed=8)
    for r in (a, b):
        r.spec_enabled = True
        sched.add_request(r)
    sched.update(sched.schedule(), RunnerOutput(np.asarray([30, 40], np.int32)))
    a.spec_token_ids = [31, 32, 33]
    out = sched.schedule()
    assert [it.num_new_tokens for it in out.scheduled] == [4, 1] and a.num_computed_tokens == 9
    si = make_step_input(out, cfg, 64)
    assert si.num_rows == 5 and si.temperature.shape[0] >= 5
    assert si.input_ids[:5].tolist() == [30, 31, 32, 33, 40]
    assert si.logits_indices[:5].tolist() == [0, 1, 2, 3, 4]
    assert si.sample_positions[:5].tolist() == [6, 7, 8, 9, 3]
    assert si.seeds[:5].tolist() == [7, 7, 7, 7, 8]
    history = [[t for t in row if t >= 0] for row in si.output_token_ids[:5].tolist()]
    assert history == [[30], [30, 31], [30, 31, 32], [30, 31, 32, 33], [40]]
    assert [EOS in row.tolist() for row in si.bias_token_ids[:5]] == [True, True, False, False,
                                                                      False]  # 1, 2 outputs < 3
    assert si.spec_row_ids[0].tolist() == [0, 1, 2, 3] and si.spec_draft_ids[0].tolist() == [31, 32, 33]
    assert si.spec_num_draft.tolist()[:2] == [3, 0] and si.spec_seq_ids[0] == 0
    # verification: 31 and 32 accepted, 50 instead of 33; b decodes 41
    sched.update(out, RunnerOutput(np.asarray([31, 32, 50, -1, 41], np.int32)))
    assert a.output_token_ids == [30, 31, 32, 50] and b.output_token_ids == [40, 41]
    assert a.num_computed_tokens == a.num_tokens - 1 == 8 and len(a.page_ids) == 2
    assert (a.num_draft_tokens, a.num_accepted_tokens, a.num_spec_steps) == (3, 2, 1)
    sched.check_invariants()


class FakeVerifier:
    """A 'greedy model' over token ids (tests/sched/fake_runner.py's next-token function) that also
    verifies drafts: every context is read back through the pages (a stale or rolled-back-wrong
    slot fails at once), each verified row's token is the model's next token after that row's
    prefix, and rows emit the accepted drafts, then the model's token, then -1."""

    def __init__(self, num_pages, page_size, vocab_size=64):
        self.ps, self.vocab_size = page_size, vocab_size
        self.kv = np.full(num_pages * page_size, -1, np.int64)

    def execute(self, si, sched_out) -> RunnerOutput:
        ps = self.ps
        assert np.all(si.slot_mapping[si.num_real_tokens:] < ps), "padding writes a real page"
        assert np.all(si.slot_mapping[:si.num_real_tokens] >= ps), "a real token writes page 0"
        self.kv[si.slot_mapping] = si.input_ids
        out = np.full(si.seeds.shape[0], -2, np.int32)
        row = 0
        for s, item in enumerate(sched_out.scheduled):
            req, kv_len = item.request, int(si.kv_lens[s])
            pos = np.arange(kv_len)
            context = self.kv[si.page_indices[s][pos // ps] * ps + pos % ps]
            assert context.tolist() == (req.all_token_ids + item.spec_token_ids)[:kv_len]
            k = len(item.spec_token_ids)
            for j in range(k + 1):
                assert si.sample_positions[row + j] == kv_len - k + j
            want = [fake_next_token(context[:kv_len - k + j], req.seed, self.vocab_size)
                    for j in range(k + 1)]
            num_accepted = 0
            while num_accepted < k and item.spec_token_ids[num_accepted] == want[num_accepted]:
                num_accepted += 1
            out[row:row + k + 1] = want[:num_accepted + 1] + [-1] * (k - num_accepted)
            row += item.num_rows
        return RunnerOutput(out)


@pytest.mark.parametrize("seed", range(6))
def test_rollback_after_random_rejections_keeps_invariants_and_outputs(seed):
    """Random drafts (right for a while, then wrong) on a small pool with preemption and prefix
    caching: invariants after every schedule/update, outputs equal to running each request alone
    without drafts, every page back at the end."""
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4])
    max_model_len, k_max = 24, 4
    h = Harness(num_pages=1 + max_model_len // ps + rng.randint(0, 10), max_model_len=max_model_len,
                page_size=ps, max_num_seqs=rng.randint(1, 5),
                max_num_batched_tokens=rng.choice([4, 8, 16, 64]),
                enable_prefix_caching=rng.random() < 0.7, coarse_buckets=rng.random() < 0.5,
                speculative_method=rng.choice(["ngram", "draft"]), draft_model="x",
                num_speculative_tokens=k_max)
    h.sched.spec_policy = SpecPolicy(k_max, max_batched_tokens=1000, min_accept_prob=0.0,
                                     draft_lookahead=h.config.speculative_method == "draft")
    h.runner = FakeVerifier(h.sched.pool.num_pages, ps)
    family = [rng.randint(2, 63) for _ in range(10)]
    specs = {}
    for i in range(12):
        prompt = family[:rng.randint(0, 10)] + [rng.randint(2, 63) for _ in range(rng.randint(1, 5))]
        sp = dict(max_tokens=rng.randint(1, 12), seed=rng.randint(0, 9), ignore_eos=rng.random() < 0.5)
        req = make_request(f"r{i}", prompt, **sp)
        req.spec_enabled = rng.random() < 0.8
        specs[req.request_id] = (prompt, sp)
        h.add(req)
    num_drafted = 0
    for _ in range(500):
        if not h.sched.has_unfinished_requests():
            break
        for req in h.sched.running:  # propose: the true continuation for a while, then junk
            if req.spec_enabled and req.num_tokens - req.num_computed_tokens == 1:
                context, drafts = list(req.all_token_ids), []
                num_right = rng.randint(0, k_max)
                for j in range(rng.randint(0, k_max)):
                    t = fake_next_token(np.asarray(context), req.seed, 64)
                    drafts.append(t if j < num_right else (t + 1 + rng.randint(0, 5)) % 64)
                    context.append(drafts[-1])
                req.spec_token_ids = drafts
        if rng.random() < 0.05 and h.sched.running:
            h.sched._preempt(rng.choice(h.sched.running))
        _, changed = h.step()
        num_drafted = h.sched.num_draft_tokens_total
    assert not h.sched.has_unfinished_requests()
    assert num_drafted > 0 and h.sched.num_accepted_tokens_total < num_drafted  # rejections
    for rid, (prompt, sp) in specs.items():
        assert h.finished[rid].output_token_ids == solo_outputs(prompt, max_model_len, **sp), rid
    assert h.sched.pool.num_free_pages == h.sched.pool.num_pages - 1
    h.sched.check_invariants()


# ------------------------------------------------------------------------------ tiny model
@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory) -> str:
    """Another random tiny Llama with the same tokenizer: a draft that is mostly wrong."""
    from tests.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny_draft") / "llama", seed=1)


@pytest.fixture(scope="module")
def tiny_draft_llm(tiny_llama_dir, tiny_draft_dir):
    return LLM(tiny_llama_dir, **TINY_KW, speculative_method="draft", draft_model=tiny_draft_dir,
               num_speculative_tokens=3)


@pytest.fixture(scope="module")
def tiny_ngram_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **TINY_KW, speculative_method="ngram", ngram_min=1, ngram_max=3,
               num_speculative_tokens=4)


def _copy_prompts(n: int, seed: int) -> list[list[int]]:
    """28 tokens (one prefill shape): a block of 8 three times, then 4 more (n-gram food)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=8).tolist() * 3 + rng.integers(3, 300, size=4).tolist()
            for _ in range(n)]


def _generate(llm, prompts, params, async_scheduling: str):
    """llm.generate with `async_scheduling` set -> (tokens, steps scheduled ahead, drafts
    verified) of that call."""
    eng = llm.engine
    config = eng.engine_config
    before = (eng.metrics.num_ahead_steps_total, eng.scheduler.num_draft_tokens_total)
    eng.engine_config = dataclasses.replace(config, async_scheduling=async_scheduling)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        eng.engine_config = config
    return (_tokens(outs), eng.metrics.num_ahead_steps_total - before[0],
            eng.scheduler.num_draft_tokens_total - before[1])


def test_requests_without_speculation_are_scheduled_ahead(tiny_ngram_llm):
    """On an n-gram engine, requests with spec_decode=False get no drafts, so with
    async_scheduling their steps are scheduled ahead like a plain engine's, with the synchronous
    loop's tokens (greedy and seeded); a speculating request among them gives the same tokens
    too, and its steps wait for their drafts (fewer steps ahead)."""
    prompts = _copy_prompts(4, seed=11)
    plain = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, spec_decode=False),
             SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True,
                            spec_decode=False)] * 2

    sync, _, _ = _generate(tiny_ngram_llm, prompts, plain, "off")
    got, ahead, _ = _generate(tiny_ngram_llm, prompts, plain, "on")
    assert got == sync and ahead >= 10  # every decode step but the first
    mixed = plain[:3] + [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    sync, _, drafted = _generate(tiny_ngram_llm, prompts, mixed, "off")
    assert drafted > 0
    got, mixed_ahead, _ = _generate(tiny_ngram_llm, prompts, mixed, "on")
    assert got == sync and mixed_ahead < ahead


def test_a_batch_too_large_to_speculate_is_scheduled_ahead(tiny_ngram_llm, monkeypatch):
    """With a budget of 4 decode + draft tokens a step, 4 speculating requests get no drafts and
    their steps are scheduled ahead; as they finish, the last two speculate again. The lookup
    always finds drafts here (the last token, repeated), so every step the policy allows drafts
    in has them: the two loops must agree on which steps those are (drafts are proposed with the
    count of requests from before each update, the count a step ahead was decided with), and
    give the same greedy and seeded tokens."""
    from jaxinfer.runtime.spec_decode import NgramProposer

    monkeypatch.setattr(NgramProposer, "lookup",
                        lambda self, token_ids, k: ([int(token_ids[-1])] * k, k + 1) if k > 0
                        else ([], 0))
    monkeypatch.setattr(NgramProposer, "may_match_next", lambda self, token_ids: True)
    eng = tiny_ngram_llm.engine
    prompts = _copy_prompts(4, seed=12)
    params = [SamplingParams(max_tokens=n, temperature=0.8 if i % 2 else 0.0, seed=i,
                             ignore_eos=True) for i, n in enumerate((4, 8, 24, 24))]
    monkeypatch.setattr(eng.scheduler, "spec_policy", dataclasses.replace(
        eng.scheduler.spec_policy, max_batched_tokens=4, min_accept_prob=0.0))
    sync, sync_ahead, sync_drafts = _generate(tiny_ngram_llm, prompts, params, "off")
    got, ahead, drafts = _generate(tiny_ngram_llm, prompts, params, "on")
    assert got == sync and sync_ahead == 0 and ahead >= 3 and drafts == sync_drafts > 0


def test_a_step_no_lookup_can_draft_for_is_scheduled_ahead(tiny_ngram_llm, monkeypatch):
    """With 2-gram matches at least, a speculating request whose last token occurs nowhere
    before it gets no drafts after its next token, whichever that is, so that step is scheduled
    ahead; both loops give the same tokens and the same drafts. Prompts of tokens that are all
    new, then a copy (n-gram food): some steps run ahead, others verify drafts."""
    from jaxinfer.runtime.spec_decode import DraftProposer, NgramProposer

    eng = tiny_ngram_llm.engine
    monkeypatch.setattr(eng, "proposer", DraftProposer(NgramProposer(ngram_min=2, ngram_max=3)))
    rng = np.random.default_rng(21)
    prompts = [rng.permutation(np.arange(3, 300))[:20].tolist() for _ in range(3)]
    prompts = [p + p[:6] for p in prompts]  # a copy under way: its continuation can be drafted
    params = [SamplingParams(max_tokens=16, temperature=0.8 if i else 0.0, seed=i,
                             ignore_eos=True) for i in range(3)]

    sync, sync_ahead, sync_drafts = _generate(tiny_ngram_llm, prompts, params, "off")
    got, ahead, drafts = _generate(tiny_ngram_llm, prompts, params, "on")
    assert got == sync and sync_ahead == 0 and ahead >= 2 and drafts == sync_drafts > 0


def test_tiny_draft_model_greedy_identical_with_many_rejections(tiny_draft_llm):
    llm, eng = tiny_draft_llm, tiny_draft_llm.engine
    prompts = _copy_prompts(4, 0)
    off = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, spec_decode=False)
    on = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    before = eng.metrics
    expected = _tokens(llm.generate(prompts, off, use_tqdm=False))
    assert eng.metrics.num_draft_tokens_total == before.num_draft_tokens_total  # opted out
    outs = llm.generate(prompts, on, use_tqdm=False)
    assert _tokens(outs) == expected
    m = eng.metrics
    drafted = m.num_draft_tokens_total - before.num_draft_tokens_total
    accepted = m.num_accepted_tokens_total - before.num_accepted_tokens_total
    assert drafted >= 16 and accepted < drafted / 2  # a random draft: mostly rejected
    per_request = [o.metrics for o in outs]
    assert sum(r.num_draft_tokens for r in per_request) == drafted
    assert sum(r.num_accepted_tokens for r in per_request) == accepted
    for r in per_request:
        if r.num_spec_steps:
            assert r.acceptance_rate == r.num_accepted_tokens / r.num_draft_tokens
            assert r.mean_accepted_length == 1 + r.num_accepted_tokens / r.num_spec_steps
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1
    eng.scheduler.check_invariants()


def test_tiny_draft_model_sampled_batch_invariant_and_pages_back(tiny_draft_llm):
    llm, eng = tiny_draft_llm, tiny_draft_llm.engine
    prompts = _copy_prompts(3, 1)
    sps = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9 if i % 2 else 1.0, seed=50 + i,
                          ignore_eos=True) for i in range(len(prompts))]
    batched = _tokens(llm.generate(prompts, sps, use_tqdm=False))
    alone = [_tokens(llm.generate([p], [s], use_tqdm=False))[0] for p, s in zip(prompts, sps)]
    assert batched == alone
    assert eng.metrics.num_accepted_tokens_total > 0  # sampled drafts do get accepted
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1
    eng.scheduler.check_invariants()


def test_tiny_self_draft_sampled_accepts_nearly_everything(tiny_llama_dir):
    """The target as its own draft at temperature 1: p == q, so min(1, p/q) = 1 for every draft.
    A q kept for the wrong request or position, or a draft cache missing what a prefix-cache hit
    skipped (the third prompt repeats the first), would show as rejections."""
    llm = LLM(tiny_llama_dir, **{**TINY_KW, "enable_prefix_caching": True},
              speculative_method="draft", draft_model=tiny_llama_dir, num_speculative_tokens=3)
    p0, p1 = _copy_prompts(2, 2)
    outs = []
    for i, p in enumerate([p0, p1, p0[:-2] + p1[-2:]]):
        sp = SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True)
        outs += llm.generate([p], sp, use_tqdm=False)
    m = llm.engine.metrics
    assert m.prefix_cache_hit_tokens >= 24
    assert m.num_draft_tokens_total >= 40
    assert m.spec_acceptance_rate > 0.95, m
    assert m.spec_mean_accepted_length > 3.0
    assert all(len(t) == 24 for t in _tokens(outs))
    assert llm.engine.scheduler.pool.num_free_pages == llm.engine.num_pages - 1


def test_tiny_ngram_identical_with_logprobs_and_stops(tiny_ngram_llm):
    llm, eng = tiny_ngram_llm, tiny_ngram_llm.engine
    prompts = _copy_prompts(4, 3)
    base = dict(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    ref = llm.generate(prompts, SamplingParams(**base, spec_decode=False), use_tqdm=False)
    off = _tokens(ref)
    before = eng.metrics.num_draft_tokens_total
    on = llm.generate(prompts, SamplingParams(**base), use_tqdm=False)
    assert eng.metrics.num_draft_tokens_total > before + 12
    assert eng.metrics.num_accepted_tokens_total > 0
    assert _tokens(on) == off
    for a, b in zip(on, ref):  # raw logprobs of the emitted tokens, at the verified rows too
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        np.testing.assert_allclose([x.logprob for x in la], [x.logprob for x in lb], atol=1e-4)
        assert [x.top_token_ids for x in la] == [x.top_token_ids for x in lb]
    # a stop token (maybe in the middle of accepted drafts) ends the request right there
    stop_at = off[0][10]
    out = llm.generate([prompts[0]], SamplingParams(**base, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == off[0][:off[0].index(stop_at) + 1] and out.finish_reason == "stop"
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1


def test_tiny_ngram_sampled_tokens_do_not_depend_on_the_drafts(tiny_ngram_llm, monkeypatch):
    """Sampled requests (seeded; top-p with penalties, top-k) on an n-gram engine emit the tokens decoding one
    token at a time gives them: a verified row keeps its own seeded draw, and a draft is accepted
    only where it equals that draw. The lookup here proposes each request's own continuation
    (from the run without speculation) with every third draft wrong, so the step verifies many
    drafts, accepts about half and rejects the rest; the tokens and their logprobs must not change."""
    from jaxinfer.runtime.spec_decode import NgramProposer

    llm, eng = tiny_ngram_llm, tiny_ngram_llm.engine
    prompts = _copy_prompts(4, seed=14)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=6, ignore_eos=True,
                             frequency_penalty=0.5, presence_penalty=0.3),
              SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    ref = llm.generate(prompts, [dataclasses.replace(p, spec_decode=False) for p in params],
                       use_tqdm=False)
    continuations = [p + t for p, t in zip(prompts, _tokens(ref))]

    def lookup(self, token_ids, k):
        tokens = [int(t) for t in token_ids]
        for full in continuations:
            if k > 0 and full[:len(tokens)] == tokens and len(full) > len(tokens):
                nxt = full[len(tokens):len(tokens) + k]
                drafts = [t if (len(tokens) + i) % 3 else (t - 1 if t > 3 else t + 1)
                          for i, t in enumerate(nxt)]
                return drafts, len(drafts) + 1
        return [], 0

    monkeypatch.setattr(NgramProposer, "lookup", lookup)
    policy = eng.scheduler.spec_policy
    eng.scheduler.spec_policy = dataclasses.replace(policy, max_batched_tokens=64,
                                                    min_accept_prob=0.0)
    drafted, accepted = eng.scheduler.num_draft_tokens_total, eng.scheduler.num_accepted_tokens_total
    try:
        on = llm.generate(prompts, params, use_tqdm=False)
    finally:
        eng.scheduler.spec_policy = policy
    drafted = eng.scheduler.num_draft_tokens_total - drafted
    accepted = eng.scheduler.num_accepted_tokens_total - accepted
    assert _tokens(on) == _tokens(ref)
    assert 40 <= accepted < drafted  # about half the drafts accepted (the run: 48 of 100)
    np.testing.assert_allclose([x.logprob for x in on[0].outputs[0].logprobs],
                               [x.logprob for x in ref[0].outputs[0].logprobs], atol=1e-4)
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1


def test_the_benchmarks_hooks_fit_the_engine(tiny_ngram_llm, monkeypatch):
    """benchmarks/step_profile.py, spec_replay.py and step_call.py replace parts of the engine by
    name (the runner's `dispatch`, the engine's proposer, whose `propose` they implement) and read
    its internals: their hooks run here on a real engine, so a change of the engine that breaks
    them fails a test, not the next measurement."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import spec_replay
    import step_call
    import step_profile

    llm, eng = tiny_ngram_llm, tiny_ngram_llm.engine
    costs = spec_replay.step_costs(llm, 2, 16, 1)  # steps verifying 0, 1 and 2 fixed drafts
    assert sorted(costs) == [1, 2, 3] and min(costs.values()) > 0
    step_profile.decode_state(eng, 2, 16, "hooks")
    wall, groups = step_profile.profile_steps(eng, 1)
    step_profile.clear(eng)
    assert wall > 0 and groups["matmuls"] > 0 and groups["attention"] > 0
    step_input = step_call.decode_step_input(llm, 2)
    assert step_input.num_rows == 2
    np.testing.assert_array_equal(step_call.plain_call(eng.runner, step_input)(),
                                  eng.runner.execute(step_input).token_ids)
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1


def test_default_number_of_drafts_follows_the_method():
    """Unset, num_speculative_tokens is 16 for n-gram lookup (its drafts cost nothing to make) and
    4 for a draft model (each draft is a step of it); a value given is kept, 0 or 17 refused."""
    from jaxinfer.config import EngineConfig

    assert EngineConfig(speculative_method="ngram").num_speculative_tokens == 16
    assert EngineConfig(speculative_method="draft", draft_model="x").num_speculative_tokens == 4
    assert EngineConfig(speculative_method="ngram", num_speculative_tokens=3).num_speculative_tokens == 3
    for bad in (0, 17):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            EngineConfig(speculative_method="ngram", num_speculative_tokens=bad)


def test_tiny_spec_decode_true_needs_a_method(tiny_llm):
    with pytest.raises(ValueError, match="speculative_method"):
        tiny_llm.generate([[5, 6]], SamplingParams(max_tokens=2, spec_decode=True), use_tqdm=False)


def test_draft_with_another_tokenizer_is_refused(tiny_llama_dir, tiny_draft_dir, tmp_path):
    from tests.tiny_models import save_tiny_model

    bigger = save_tiny_model("llama", tmp_path / "bigger", seed=2, vocab_size=400)
    with pytest.raises(ValueError, match="vocab_size=400"):
        LLM(tiny_llama_dir, **TINY_KW, speculative_method="draft", draft_model=bigger)
    swapped = shutil.copytree(tiny_draft_dir, tmp_path / "swapped")
    with open(swapped / "tokenizer.json") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(swapped / "tokenizer.json", "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(tiny_llama_dir, **TINY_KW, speculative_method="draft", draft_model=str(swapped))


# ------------------------------------------------------------------------------ statistics
def _next_logits(model, contexts) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return model(torch.tensor(contexts)).logits[:, -1].float().numpy()


@functools.lru_cache(maxsize=None)
def _spec_round_fn():
    """Jitted: one verification step of one draft per row, with the engine's own functions:
    the draft samples from its real distribution (draft_sample, the draft loop's sampler), the
    target's logits at the verified rows come from tables, then `sample` + `verify_drafts` (the
    step's verification). Returns the first emitted token, the drafts and num_accepted."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.sampler import default_sampling_metadata, sample
    from jaxinfer.runtime.draft_model import draft_sample
    from jaxinfer.runtime.spec_verify import SpecInputs, verify_drafts

    @jax.jit
    def fn(first_logits, draft_logits, next_table, seeds, position):
        # first_logits f32[N, V]: target at the context; draft_logits f32[N, V]: draft there;
        # next_table f32[V, V]: target logits after each possible draft (the bonus row)
        n = first_logits.shape[0]
        ones = jnp.ones((n,), jnp.float32)
        seq_md = default_sampling_metadata(n, temperature=ones, seeds=seeds,
                                           positions=jnp.full((n,), position, jnp.int32))
        drafts, q = draft_sample(draft_logits, seq_md, jnp.full((n,), position, jnp.int32))
        logits = jnp.stack([first_logits, next_table[drafts]], axis=1).reshape(2 * n, -1)
        rows_md = default_sampling_metadata(
            2 * n, temperature=jnp.ones((2 * n,), jnp.float32), seeds=jnp.repeat(seeds, 2),
            positions=jnp.tile(jnp.asarray([position, position + 1], jnp.int32), n))
        spec = SpecInputs(row_ids=jnp.arange(2 * n, dtype=jnp.int32).reshape(n, 2),
                          draft_ids=drafts[:, None], num_draft=jnp.ones((n,), jnp.int32),
                          seq_ids=jnp.arange(n, dtype=jnp.int32),
                          store_rows=jnp.arange(n, dtype=jnp.int32))
        out, num_accepted = verify_drafts(logits, rows_md, sample(logits, rows_md), spec, q[:, None])
        return out.token_ids.reshape(n, 2)[:, 0], drafts, num_accepted

    return fn


def _run_rounds(first_logits, draft_logits, next_table, seeds, position, chunk=10_000):
    import jax.numpy as jnp

    fn, n = _spec_round_fn(), len(seeds)
    pad = -n % chunk
    idx = np.concatenate([np.arange(n), np.zeros(pad, np.int64)])
    outs = [fn(jnp.asarray(first_logits[idx[i:i + chunk]]), jnp.asarray(draft_logits[idx[i:i + chunk]]),
               jnp.asarray(next_table), jnp.asarray(seeds[idx[i:i + chunk]]), position)
            for i in range(0, n + pad, chunk)]
    return [np.concatenate([np.asarray(o[j]) for o in outs])[:n] for j in range(3)]


def _chisquare_p(tokens: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square of token counts against expected counts (bins < 5 expected merged)."""
    from scipy import stats

    counts = np.bincount(tokens, minlength=expected.shape[0]).astype(np.float64)
    expected = np.asarray(expected, np.float64)
    expected = expected * counts.sum() / expected.sum()
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        counts, expected = counts[:-1], expected[:-1]
    expected *= counts.sum() / expected.sum()
    return float(stats.chisquare(counts, expected).pvalue)


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_verified_tokens_follow_the_target_distribution(tiny_llama_dir, tiny_draft_dir):
    """Temperature 1, a different (random) draft model, the real tiny models' logits: the first
    token a verification emits follows the target's p(.|context) (chi-square over 60,000 draws);
    so does the token the next verification emits after a rejection, p(.|context, replacement)
    (chi-square over >= 20,000 rejected rows). The drafts themselves do not (the test's power)."""
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_draft_dir, torch_dtype=torch.float32).eval()
    context = [5, 17, 42, 99]
    vocab = target.config.vocab_size
    extended = [context + [t] for t in range(vocab)]
    p0, q0 = _next_logits(target, [context])[0], _next_logits(draft, [context])[0]
    p1, q1 = _next_logits(target, extended), _next_logits(draft, extended)  # [V, V]
    n = 3 * NUM_DRAWS
    seeds = np.arange(n, dtype=np.uint32) + 12345
    first, drafts, num_accepted = _run_rounds(np.broadcast_to(p0, (n, vocab)),
                                              np.broadcast_to(q0, (n, vocab)), p1, seeds, len(context))
    assert _chisquare_p(first, _softmax(p0)) > P_MIN
    assert _chisquare_p(drafts, _softmax(q0)) > P_MIN  # the draft samples from its own q
    assert _chisquare_p(drafts, _softmax(p0)) < 1e-6  # ... which the test can tell from p
    rate = np.minimum(_softmax(p0), _softmax(q0)).sum()  # theory: P(accept) = sum min(p, q)
    assert abs((num_accepted == 1).mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)

    rejected = np.flatnonzero(num_accepted == 0)
    assert rejected.size >= NUM_DRAWS
    x = first[rejected]  # the replacement token: the next step's context is (context, x)
    # the bonus row's logits (after the second draft) do not affect the first emitted token
    second, _, _ = _run_rounds(p1[x], q1[x], p1, seeds[rejected], len(context) + 1)
    assert _chisquare_p(second, _softmax(p1[x]).sum(axis=0)) > P_MIN


# ------------------------------------------------------------------------------ SmolLM2
SMOLLM2_KW = dict(num_pages=160, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=256, enable_prefix_caching=False)  # every prefill: one shape
CODE = "def add(a, b):\n    return a + b\n"
SMOLLM2_PROMPTS = [
    f"Repeat this code exactly:\n{CODE}",
    f"Rename the function add to plus in:\n{CODE}",
    "Repeat after me: the quick brown fox jumps over the lazy dog.",
    "Quote the first sentence: Paris is the capital of France. It is big.",
    "Write the numbers from 1 to 12 separated by commas.",
    "What is the capital of Italy?",
    "Name three colours.",
    "Say hello in French.",
]


@pytest.fixture(scope="module")
def smollm2_chat_prompts(smollm2_gguf) -> list[list[int]]:
    from jaxinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_source(smollm2_gguf)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in SMOLLM2_PROMPTS]
    assert all(33 <= len(p) <= 64 for p in prompts), [len(p) for p in prompts]  # one T bucket
    return prompts


def _one_at_a_time(llm, prompts, sp) -> list[list[int]]:
    """Single stream, so every step is a batch of one: few shapes, few compiles."""
    return [_tokens(llm.generate([p], sp, use_tqdm=False))[0] for p in prompts]


@pytest.mark.slow
def test_smollm2_greedy_identical_with_ngram_and_draft_model(smollm2_chat_prompts):
    # 31 = the prefill's token + 6 steps of 4 accepted drafts and a bonus token: the self-drafting
    # engine's steps all verify 4 drafts, and it compiles no T = 1 step (32 tokens left one token
    # for a last draftless step: a third executable of target and draft model, 8-16 s to compile;
    # the tiny draft-model tests above take such steps)
    sp_on = SamplingParams(max_tokens=31, temperature=0, ignore_eos=True)
    sp_off = SamplingParams(max_tokens=31, temperature=0, ignore_eos=True, spec_decode=False)
    ngram = LLM("smollm2-135m", **SMOLLM2_KW, speculative_method="ngram", num_speculative_tokens=4)
    expected = _one_at_a_time(ngram, smollm2_chat_prompts, sp_off)
    assert _one_at_a_time(ngram, smollm2_chat_prompts, sp_on) == expected
    m = ngram.engine.metrics
    assert m.num_accepted_tokens_total > 20, m  # the copy prompts get their drafts accepted
    assert m.num_compilations <= 5, m.num_compilations  # prefill, decode, verify T = 2, 4, 8
    del ngram
    draft = LLM("smollm2-135m", **SMOLLM2_KW, speculative_method="draft", draft_model="smollm2-135m")
    assert _one_at_a_time(draft, smollm2_chat_prompts, sp_on) == expected
    m = draft.engine.metrics
    assert m.spec_acceptance_rate > 0.9, m  # its own draft: everything but numerical near-ties
    assert m.num_compilations <= 5, m.num_compilations
    assert draft.engine.scheduler.pool.num_free_pages == draft.engine.num_pages - 1


@pytest.mark.parametrize("k", [3, 4])
def test_warmup_covers_the_verifying_layouts(k):
    """Warm-up inputs include every layout a speculating engine's steps take (host only); with
    k = 4 the verification size 1 + k = 5 is a token bucket of its own."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.sched.buckets import StepBuckets
    from jaxinfer.sched.step_input import warmup_step_inputs

    ec = EngineConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                      speculative_method="ngram", num_speculative_tokens=k)
    buckets = StepBuckets.coarse(ec, 32)
    assert buckets.token_buckets == ((1, 2, 4, 8, 16) if k == 3 else (1, 2, 4, 5, 8, 16))
    warm = {si.pack()[1] for si in warmup_step_inputs(ec, 32, buckets=buckets)}
    h = Harness(num_pages=40, max_model_len=32, page_size=4, max_num_seqs=4,
                max_num_batched_tokens=16, speculative_method="ngram", num_speculative_tokens=k,
                coarse_buckets=True)
    h.sched.spec_policy = SpecPolicy(k, max_batched_tokens=1000, min_accept_prob=0.0)
    h.runner = FakeVerifier(40, 4)
    rng = random.Random(0)
    for i in range(6):
        req = h.add(make_request(f"r{i}", [rng.randint(2, 63) for _ in range(rng.randint(1, 9))],
                                 max_tokens=10, ignore_eos=True))
        req.spec_enabled = True
    seen = set()
    while h.sched.has_unfinished_requests():
        for req in h.sched.running:
            if req.num_tokens - req.num_computed_tokens == 1:
                req.spec_token_ids = [rng.randint(2, 63) for _ in range(rng.randint(0, k))]
        out = h.sched.schedule()
        si = make_step_input(out, h.config, 32, buckets=h.buckets)
        seen.add(si.pack()[1])
        h.sched.update(out, h.runner.execute(si, out))
    assert any(any(f.name == "spec_row_ids" for f in layout) for layout in seen)
    assert seen <= warm, seen - warm
