import numpy as np
import pytest

from jaxinfer.request import Request, RequestStatus
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.sched.output import RunnerOutput
from jaxinfer.sched.scheduler import Scheduler
from jaxinfer.sched.step_input import make_step_input
from tests.sched.fake_runner import EOS, Harness, make_config, make_request, solo_outputs


def prompt(n, start=10):
    return list(range(start, start + n))


def step_with(sched, tokens):
    """One schedule() + update() with hand-picked sampled tokens (one per row)."""
    out = sched.schedule()
    changed = sched.update(out, RunnerOutput(
        np.asarray(tokens + [0] * (len(out.scheduled) - len(tokens)), np.int32)))
    sched.check_invariants()
    return out, changed


def test_add_request_rejects_a_prompt_that_leaves_no_room():
    sched = Scheduler(make_config(), 16, 32, (EOS,))
    with pytest.raises(ValueError, match=r"32 tokens.*max_model_len=32"):
        sched.add_request(make_request("a", prompt(32)))
    sched.add_request(make_request("b", prompt(31)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("b", prompt(3)))


def test_pool_too_small_for_one_sequence():
    with pytest.raises(ValueError, match="max_model_len=64"):
        Scheduler(make_config(), 16, 64)


def test_prefill_then_decode_exact_pages():
    sched = Scheduler(make_config(), 16, 32, (EOS,))
    req = make_request("a", prompt(6))
    sched.add_request(req)
    out, changed = step_with(sched, [7])
    (it,) = out.scheduled
    assert (it.num_computed_tokens, it.num_new_tokens, it.samples) == (0, 6, True)
    assert it.token_ids == prompt(6)
    assert req.page_ids == [1, 2] and changed == [req] and req.output_token_ids == [7]
    assert sched.pool.is_cached(1) and not sched.pool.is_cached(2)  # only the full page
    out, _ = step_with(sched, [8])  # position 6: still page 2
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (6, 1)
    assert out.scheduled[0].token_ids == [7]
    assert req.page_ids == [1, 2]
    step_with(sched, [9])  # position 7 fills page 2
    assert req.page_ids == [1, 2] and sched.pool.is_cached(2)
    step_with(sched, [11])  # position 8 needs page 3
    assert req.page_ids == [1, 2, 3]
    assert req.output_token_ids == [7, 8, 9, 11] and req.num_computed_tokens == 9


def test_chunked_prefill_splits_a_long_prompt():
    sched = Scheduler(make_config(max_num_batched_tokens=8), 16, 32, (EOS,))
    req = make_request("a", prompt(20))
    sched.add_request(req)
    chunks = []
    for _ in range(3):
        out, changed = step_with(sched, [5])
        (it,) = out.scheduled
        chunks.append((it.num_computed_tokens, it.num_new_tokens, it.samples, list(req.page_ids)))
        assert changed == ([req] if it.samples else [])
    assert chunks == [(0, 8, False, [1, 2]), (8, 8, False, [1, 2, 3, 4]),
                      (16, 4, True, [1, 2, 3, 4, 5])]
    assert req.output_token_ids == [5]  # mid-prompt chunks sampled nothing


def test_rows_are_decodes_then_prefill_chunks_then_admissions():
    sched = Scheduler(make_config(max_num_batched_tokens=16), 32, 64, (EOS,))
    a, b = make_request("a", prompt(3)), make_request("b", prompt(20, start=100))
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step_with(sched, [5, 5])
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3), ("b", 13)]
    c = make_request("c", prompt(10, start=200))
    sched.add_request(c)
    out, _ = step_with(sched, [5, 5, 5])
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1), ("b", 7), ("c", 8)]
    assert sum(s.num_new_tokens for s in out.scheduled) == out.num_batched_tokens == 16


def test_decodes_go_first_even_when_admitted_later():
    sched = Scheduler(make_config(max_num_batched_tokens=16), 32, 64, (EOS,))
    a = make_request("a", prompt(3), ignore_eos=True, max_tokens=30)
    b = make_request("b", prompt(60, start=100), ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    step_with(sched, [5, 5])  # a: 3 tokens; b: a 13-token chunk
    # White box: pretend b was admitted first (as after a preemption of a); b still prefills and
    # would take the whole budget, but a's decode goes first so it never starves.
    sched.running.reverse()
    out, _ = step_with(sched, [5, 5])
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 15)]


def test_common_prefix_shares_pages():
    sched = Scheduler(make_config(), 32, 32, (EOS,))
    shared = prompt(8, start=40)
    a = make_request("a", shared + [2, 3])
    sched.add_request(a)
    step_with(sched, [5])
    assert a.page_ids == [1, 2, 3]
    b = make_request("b", shared + [4, 5, 6])
    sched.add_request(b)
    out, _ = step_with(sched, [5, 5])
    it_b = out.scheduled[1]
    assert b.page_ids == [1, 2, 4]
    assert (it_b.num_computed_tokens, it_b.num_new_tokens) == (8, 3)
    assert b.num_cached_tokens == 8
    assert sched.pool.ref_count(1) == sched.pool.ref_count(2) == 2
    assert sched.stats().prefix_cache_hit_tokens == 8
    assert sched.stats().prefix_cache_query_tokens == 10 + 11
    sched.abort_request("a")
    assert sched.pool.ref_count(1) == 1 and sched.pool.ref_count(3) == 0


def test_full_prompt_hit_still_computes_the_last_token():
    sched = Scheduler(make_config(), 32, 32, (EOS,))
    a = make_request("a", prompt(8))
    sched.add_request(a)
    step_with(sched, [5])
    sched.abort_request("a")
    b = make_request("b", prompt(8))
    sched.add_request(b)
    out, _ = step_with(sched, [5])
    (it,) = out.scheduled
    # both pages are cached, but the last token must run to give logits: page 2 is not reused
    assert (it.num_computed_tokens, it.num_new_tokens) == (4, 4)
    assert b.page_ids[0] == a_first_page(sched, b) and b.num_cached_tokens == 4


def a_first_page(sched, req):
    return sched.pool.find_cached_prefix(req.page_hashes, 1)[0]


def test_preemption_when_pages_run_out_then_both_complete():
    # 8 usable pages = 32 tokens; two requests that each grow to 24 tokens
    h = Harness(num_pages=9, max_model_len=32, max_num_batched_tokens=32)
    a = h.add(make_request("a", prompt(8), max_tokens=16, ignore_eos=True))
    b = h.add(make_request("b", prompt(8, start=30), max_tokens=16, ignore_eos=True, seed=3))
    preempted_at = None
    for step in range(100):
        out, _ = h.step()
        if out.preempted_request_ids:
            assert out.preempted_request_ids == ["b"]  # the most recently admitted
            assert [s.request.request_id for s in out.scheduled] == ["a"]
            assert b.status is RequestStatus.PREEMPTED and b.page_ids == [] and b.num_computed_tokens == 0
            assert b.num_output_tokens == 9  # kept: they are recomputed as part of its prompt
            preempted_at = step
        if not h.sched.has_unfinished_requests():
            break
    assert preempted_at is not None
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    assert h.sched.stats().num_preemptions_total == 1
    assert a.finish_reason() == b.finish_reason() == "length"
    assert a.output_token_ids == solo_outputs(prompt(8), max_tokens=16, ignore_eos=True)
    assert b.output_token_ids == solo_outputs(prompt(8, start=30), max_tokens=16, ignore_eos=True, seed=3)
    assert h.sched.pool.num_used_pages == 0


def test_resume_after_preemption_hits_its_own_cached_pages():
    h = Harness(num_pages=9, max_model_len=32, max_num_batched_tokens=32)
    h.add(make_request("a", prompt(8), max_tokens=16, ignore_eos=True))
    b = h.add(make_request("b", prompt(8, start=30), max_tokens=16, ignore_eos=True))
    b_first_pages = None
    while b.status is not RequestStatus.PREEMPTED:
        h.step()
        b_first_pages = b_first_pages or list(b.page_ids[:2])
    while b.status is not RequestStatus.RUNNING:
        out, _ = h.step()
    (it,) = [s for s in out.scheduled if s.request is b]
    assert b.page_ids[:2] == b_first_pages  # its prompt pages survived in the prefix cache
    assert (it.num_computed_tokens, it.num_new_tokens, it.samples) == (8, 9, True)  # 17 known tokens


def test_stops_eos_min_tokens_stop_token_ids_and_lengths():
    sched = Scheduler(make_config(), 32, 32, (EOS, 2))
    reqs = {
        "eos": make_request("eos", prompt(3)),
        "ignore": make_request("ignore", prompt(3), ignore_eos=True, max_tokens=3),
        "min": make_request("min", prompt(3), min_tokens=2),
    }
    for r in reqs.values():
        sched.add_request(r)
    step_with(sched, [EOS, EOS, EOS])
    assert reqs["eos"].finish_reason() == "stop" and reqs["eos"].stop_reason is None
    assert reqs["eos"].output_token_ids == [EOS] and reqs["eos"].page_ids == []
    step_with(sched, [2, 2])  # second EOS id
    assert not reqs["min"].is_finished() and not reqs["ignore"].is_finished()
    step_with(sched, [EOS, 2])
    assert reqs["ignore"].finish_reason() == "length" and reqs["ignore"].output_token_ids == [EOS, 2, EOS]
    assert reqs["min"].finish_reason() == "stop" and reqs["min"].num_output_tokens == 3

    s = make_request("stop_id", prompt(3), stop_token_ids=[7], max_tokens=None)
    sched.add_request(s)
    step_with(sched, [6])
    step_with(sched, [7])
    assert s.finish_reason() == "stop" and s.stop_reason == 7 and s.output_token_ids == [6, 7]

    long = make_request("ctx", prompt(30), max_tokens=None)
    sched.add_request(long)
    for _ in range(3):  # chunks of 16 and 14 tokens, then one decode
        step_with(sched, [5])
    assert long.finish_reason() == "length" and long.num_tokens == 32
    assert sched.pool.num_used_pages == 0 and not sched.has_unfinished_requests()


def test_abort_running_and_waiting_and_unknown():
    sched = Scheduler(make_config(max_num_seqs=1), 16, 32, (EOS,))
    a, b = make_request("a", prompt(5)), make_request("b", prompt(5))
    sched.add_request(a)
    sched.add_request(b)
    step_with(sched, [5])
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert sched.abort_request("b") is b and b.finish_reason() == "abort"
    assert sched.abort_request("a") is a and a.page_ids == [] and sched.pool.num_used_pages == 0
    assert sched.abort_request("a") is None and sched.abort_request("nope") is None
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == ["b", "a"]
    assert sched.schedule().finished_request_ids == []
    sched.check_invariants()


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched = Scheduler(make_config(), 16, 32, (EOS,))
    a = make_request("a", prompt(5))
    sched.add_request(a)
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.update(out, RunnerOutput(np.array([5], np.int32))) == [] and a.output_token_ids == []
    sched.check_invariants()


def test_finish_request_for_a_stop_string():
    sched = Scheduler(make_config(), 16, 32, (EOS,))
    a = make_request("a", prompt(5))
    sched.add_request(a)
    step_with(sched, [5])
    assert sched.finish_request("a", "stop", stop_reason="###") is a
    assert a.finish_reason() == "stop" and a.stop_reason == "###" and a.page_ids == []
    with pytest.raises(ValueError, match="reason"):
        sched.finish_request("a", "running")


def _admission_steps(scheduling):
    h = Harness(num_pages=32, max_model_len=32, max_num_seqs=2, scheduling=scheduling)
    reqs = [h.add(make_request(n, prompt(4, start=20 + 10 * i), max_tokens=m, ignore_eos=True))
            for i, (n, m) in enumerate([("a", 2), ("b", 5), ("c", 2)])]
    first_step = {}
    for step in range(50):
        out, _ = h.step()
        for s in out.scheduled:
            first_step.setdefault(s.request.request_id, step)
        if not h.sched.has_unfinished_requests():
            break
    return first_step, reqs


def test_static_mode_waits_for_the_whole_batch():
    first, reqs = _admission_steps("static")
    assert first["a"] == first["b"] == 0
    assert first["c"] == 5  # b's 5th token comes out of step 4
    cont, _ = _admission_steps("continuous")
    assert cont["c"] == 2  # a finished at step 1
    assert all(r.finish_reason() == "length" for r in reqs)


def test_static_mode_forms_a_batch_across_chunked_steps():
    # the token budget admits one 8-token prompt a step; the batch still grows to max_num_seqs
    h = Harness(num_pages=32, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8,
                scheduling="static")
    a = h.add(make_request("a", prompt(8), max_tokens=4, ignore_eos=True))
    b = h.add(make_request("b", prompt(8, start=40), max_tokens=4, ignore_eos=True))
    c = h.add(make_request("c", prompt(8, start=60), max_tokens=1, ignore_eos=True))
    h.step()
    h.step()
    assert h.sched.running == [a, b]
    while not b.is_finished():
        h.step()
        assert c.status is RequestStatus.WAITING
    h.run()
    assert c.finish_reason() == "length"


def test_seed_is_drawn_at_add_and_kept():
    cfg = make_config(seed=123)
    seeds = []
    for _ in range(2):
        sched = Scheduler(cfg, 16, 32)
        r = Request("r", prompt(3), SamplingParams(seed=None))
        sched.add_request(r)
        seeds.append(r.seed)
    assert seeds[0] == seeds[1] and 0 <= seeds[0] < 2**32
    fixed = Request("f", prompt(3), SamplingParams(seed=7))
    sched.add_request(fixed)
    assert fixed.seed == 7
    step_with(sched, [5, 5])
    sched._preempt(fixed)
    assert fixed.seed == 7


def test_priority_policy_admits_lowest_priority_value_first():
    sched = Scheduler(make_config(max_num_seqs=1), 16, 32, (EOS,), policy="priority")
    low = Request("low", prompt(3), SamplingParams(max_tokens=1), arrival_time=0.0, priority=5)
    high = Request("high", prompt(3), SamplingParams(max_tokens=1), arrival_time=1.0, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    out, _ = step_with(sched, [5])
    assert [s.request.request_id for s in out.scheduled] == ["high"]
    out, _ = step_with(sched, [5])
    assert [s.request.request_id for s in out.scheduled] == ["low"]


def test_priority_preempts_outranked_running_requests_for_a_sequence_slot():
    sched = Scheduler(make_config(max_num_seqs=2), 16, 32, (EOS,), policy="priority")
    a = Request("a", prompt(3), SamplingParams(max_tokens=8, ignore_eos=True), arrival_time=0.0,
                priority=5)
    b = Request("b", prompt(3, 40), SamplingParams(max_tokens=8, ignore_eos=True),
                arrival_time=1.0, priority=3)
    sched.add_request(a)
    sched.add_request(b)
    step_with(sched, [5, 5])
    assert sched.running == [b, a]  # b first: more urgent
    urgent = Request("u", prompt(3, 70), SamplingParams(max_tokens=2, ignore_eos=True),
                     arrival_time=2.0, priority=0)
    sched.add_request(urgent)
    out, _ = step_with(sched, [6, 6])
    assert out.preempted_request_ids == ["a"]  # the least urgent goes, the other keeps running
    assert [s.request.request_id for s in out.scheduled] == ["b", "u"]
    assert a.status is RequestStatus.PREEMPTED and a.page_ids == [] and sched.waiting[0] is a
    assert a.output_token_ids == [5]  # kept: recomputed from prompt + output when it resumes
    same_rank = Request("v", prompt(3, 90), SamplingParams(max_tokens=1), arrival_time=3.0,
                        priority=3)
    sched.add_request(same_rank)  # does not outrank b (same priority, later): nobody preempted
    out, _ = step_with(sched, [7, 7])
    assert out.preempted_request_ids == []
    while sched.has_unfinished_requests():
        step_with(sched, [8] * 4)
    assert a.output_token_ids[:1] == [5] and len(a.output_token_ids) == 8
    assert sched.pool.num_free_pages == 15


def test_priority_preempts_for_pages_only_when_outranked():
    # 7 usable pages of 4 tokens; two running requests of 11-token prompts hold 6 of them
    sched = Scheduler(make_config(max_num_seqs=4, page_size=4, max_num_batched_tokens=32), 8, 28,
                      (EOS,), policy="priority")
    for i, pr in enumerate((5, 1)):
        sched.add_request(Request(f"r{i}", prompt(11, 10 + 20 * i), SamplingParams(
            max_tokens=4, ignore_eos=True), arrival_time=float(i), priority=pr))
    step_with(sched, [5, 5])
    assert sched.pool.num_free_pages == 1
    late = Request("late", prompt(12, 80), SamplingParams(max_tokens=1), arrival_time=5.0, priority=3)
    sched.add_request(late)
    out, _ = step_with(sched, [6, 6])
    assert out.preempted_request_ids == ["r0"]  # priority 5 < 3's claim; r1 (priority 1) stays
    assert {s.request.request_id for s in out.scheduled} == {"r1", "late"}


def test_stats_snapshot():
    sched = Scheduler(make_config(max_num_seqs=1), 16, 32, (EOS,))
    sched.add_request(make_request("a", prompt(6)))
    sched.add_request(make_request("b", prompt(6)))
    out = sched.schedule()
    st = out.stats
    assert (st.num_running, st.num_waiting, st.num_scheduled_seqs, st.num_batched_tokens) == (1, 1, 1, 6)
    assert st.num_used_pages == 2 and st.page_usage == pytest.approx(2 / 15)
    assert st.kv_utilization == pytest.approx(6 / 8)


def test_outputs_do_not_depend_on_batching_preemption_or_prefix_hits():
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(2, 64, 12)]
    specs = []
    for i in range(10):
        p = (shared[: rng.integers(0, 13)] + [int(t) for t in rng.integers(2, 64, rng.integers(1, 10))])
        specs.append((f"r{i}", p, dict(max_tokens=int(rng.integers(1, 12)), seed=i)))
    h = Harness(num_pages=12, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=8)
    reqs = [h.add(make_request(rid, p, **sp)) for rid, p, sp in specs]
    h.run()
    assert h.sched.stats().num_preemptions_total > 0
    assert h.sched.stats().prefix_cache_hit_tokens > 0
    for (rid, p, sp), r in zip(specs, reqs):
        assert r.output_token_ids == solo_outputs(p, max_model_len=40, **sp), rid
    assert h.sched.pool.num_used_pages == 0


def test_prompt_logprob_rows_across_chunks_and_no_prefix_hit():
    """prompt_logprobs: every chunk has one row per position that scores a prompt token (its
    last new tokens; position p scores token p + 1), then the sampled row; the step input names
    each row's target token; a cached prefix is not used for the part not yet scored."""
    config = make_config(max_num_batched_tokens=8)
    sched = Scheduler(config, 16, 32, (EOS,))
    p = prompt(20)
    sched.add_request(make_request("warm", p, max_tokens=1))  # caches 4 full pages of p
    while sched.has_unfinished_requests():
        step_with(sched, [5])
    req = make_request("a", p, max_tokens=1, prompt_logprobs=2)
    sched.add_request(req)
    layout = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        (it,) = out.scheduled
        si = make_step_input(out, config, 32)
        n = it.num_rows
        rows = si.logits_indices[:n]
        assert si.positions[rows].tolist() == list(range(it.kv_len - n, it.kv_len))
        assert si.target_token_ids[:it.num_prompt_rows].tolist() == \
            p[it.kv_len - n + 1:it.kv_len - n + 1 + it.num_prompt_rows]
        assert (si.target_token_ids[it.num_prompt_rows:] == -1).all()
        layout.append((it.num_computed_tokens, it.num_new_tokens, it.num_prompt_rows, it.samples))
        result = RunnerOutput(  # logprob of row r: -r - position / 100
            token_ids=np.full(n, 7, np.int32),
            logprobs=-(np.arange(n) + si.positions[rows] / 100).astype(np.float32),
            top_token_ids=np.tile(np.array([3, 4], np.int32), (n, 1)),
            top_logprobs=np.tile(np.array([-0.5, -0.7], np.float32), (n, 1)))
        sched.update(out, result)
        sched.check_invariants()
    assert layout == [(0, 8, 8, False), (8, 8, 8, False), (16, 4, 3, True)]
    assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == 20
    for i, e in enumerate(req.prompt_logprobs[1:]):  # token i + 1, scored at position i
        assert e.token_id == p[i + 1] and e.top_token_ids == [3, 4]
        assert e.logprob == pytest.approx(-(i % 8) - i / 100)
    assert req.output_token_ids == [7]
