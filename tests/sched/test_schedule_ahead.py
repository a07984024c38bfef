"""Scheduling ahead (`Scheduler.schedule_ahead`): the step after a running one, scheduled before
its tokens are known, must give every request exactly the tokens the synchronous loop gives."""

import numpy as np
import pytest

from jaxinfer.request import RequestStatus
from jaxinfer.sampling_params import StructuredOutputs
from jaxinfer.sched.output import RunnerOutput
from jaxinfer.sched.scheduler import Scheduler
from jaxinfer.sched.spec_policy import SpecPolicy
from tests.sched.fake_runner import EOS, Harness, make_config, make_request, solo_outputs


def prompt(n, start=10):
    return list(range(start, start + n))


def _workload(seed: int, n: int = 10):
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(2, 64, 12)]
    specs = []
    for i in range(n):
        p = shared[: rng.integers(0, 13)] + [int(t) for t in rng.integers(2, 64, rng.integers(1, 10))]
        specs.append((f"r{i}", p, dict(max_tokens=int(rng.integers(1, 12)), seed=i)))
    return specs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_match_alone_with_preemption_prefix_hits_and_eos(seed):
    """A small pool (preemptions, in the synchronous steps), shared prefixes, EOS stops, chunked
    prompts: each request's tokens are those it gets alone."""
    h = Harness(num_pages=12, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=8)
    specs = _workload(seed)
    reqs = [h.add(make_request(rid, p, **sp)) for rid, p, sp in specs]
    h.run(ahead=True)
    stats = h.sched.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hit_tokens > 0
    assert h.sched.num_ahead_steps > 0
    for (rid, p, sp), r in zip(specs, reqs):
        assert r.output_token_ids == solo_outputs(p, max_model_len=40, **sp), rid
    assert h.sched.pool.num_used_pages == 0
    assert sum(r.finish_reason() == "stop" for r in reqs) > 0  # some ended on EOS


@pytest.mark.parametrize("seed", [3, 4])
def test_outputs_match_alone_when_most_steps_run_ahead(seed):
    h = Harness(num_pages=64, max_model_len=40, max_num_seqs=10, max_num_batched_tokens=16)
    specs = _workload(seed)
    reqs = [h.add(make_request(rid, p, **sp)) for rid, p, sp in specs]
    h.run(ahead=True)
    steps = h.sched.stats().num_steps
    assert h.sched.num_ahead_steps >= steps // 2, (h.sched.num_ahead_steps, steps)
    for (rid, p, sp), r in zip(specs, reqs):
        assert r.output_token_ids == solo_outputs(p, max_model_len=40, **sp), rid
    assert h.sched.pool.num_used_pages == 0


def test_a_decode_runs_ahead_with_its_token_filled_in():
    h = Harness(num_pages=16, max_model_len=32)
    req = h.add(make_request("a", prompt(5), max_tokens=4))
    first, _ = h.step_ahead()  # the prefill ran; the first decode is in flight already
    assert first.scheduled[0].num_new_tokens == 5
    ahead_out, ahead_si = h.inflight
    (item,) = ahead_out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens) == (5, 1)
    assert req.output_token_ids == [int(ahead_si.input_ids[0])]  # the token sampled by the prefill
    assert req.num_computed_tokens == 6 and not req.has_placeholder
    h.step_ahead()
    assert len(req.output_token_ids) == 2 and h.sched.num_ahead_steps == 2
    assert req.output_token_ids == solo_outputs(prompt(5), max_tokens=4)[:2]


def test_a_request_at_its_length_cap_is_left_out_of_the_step_ahead():
    h = Harness(num_pages=16, max_model_len=32)
    a = h.add(make_request("a", prompt(5), max_tokens=2))
    b = h.add(make_request("b", prompt(6, start=20), max_tokens=5))
    h.step_ahead()
    ahead_out, _ = h.inflight
    assert [it.request for it in ahead_out.scheduled] == [a, b]
    _, changed = h.step_ahead()  # a's second token (max_tokens) is sampled by the step it runs
    assert a in changed and a.finish_reason() == "length" and a.page_ids == []
    ahead_out, _ = h.inflight
    assert [it.request for it in ahead_out.scheduled] == [b]  # a has no step after its last
    h.run(ahead=True)
    assert a.output_token_ids == solo_outputs(prompt(5), max_tokens=2)
    assert b.output_token_ids == solo_outputs(prompt(6, start=20), max_tokens=5)
    assert h.sched.pool.num_used_pages == 0

    # alone, at the context limit: no step ahead at all, so none runs for nothing
    h = Harness(num_pages=16, max_model_len=8)
    c = h.add(make_request("c", prompt(6), max_tokens=100))
    h.step_ahead()
    assert h.inflight is not None  # its first decode (position 6)
    _, changed = h.step_ahead()  # the token at position 7 is its last (max_model_len=8)
    assert changed == [c] and c.finish_reason() == "length" and h.inflight is None
    assert c.output_token_ids == solo_outputs(prompt(6), max_model_len=8, max_tokens=100)


def test_a_request_that_stops_on_a_token_is_in_the_step_ahead_and_that_row_is_ignored():
    first, second = solo_outputs(prompt(5), max_tokens=2)
    assert first != second  # so the stop token ends it at its second token
    h = Harness(num_pages=16, max_model_len=32)
    req = h.add(make_request("a", prompt(5), max_tokens=8, stop_token_ids=[second]))
    h.step_ahead()
    _, changed = h.step_ahead()  # its second token ends it; the step after it is in flight
    assert changed == [req] and req.finish_reason() == "stop"
    assert req.page_ids == [] and h.sched.pool.num_used_pages == 0
    ahead_out, _ = h.inflight
    assert [it.request for it in ahead_out.scheduled] == [req]
    _, changed = h.step_ahead()  # runs the step ahead: nothing more for `req`
    assert changed == [] and len(req.output_token_ids) == 2 and h.inflight is None
    assert req.output_token_ids == [first, second]


def test_abort_while_the_step_ahead_runs():
    h = Harness(num_pages=16, max_model_len=32)
    a = h.add(make_request("a", prompt(5), max_tokens=8))
    b = h.add(make_request("b", prompt(6, start=20), max_tokens=8))
    h.step_ahead()
    h.sched.abort_request("a")  # between steps, its next one in flight
    assert a.finish_reason() == "abort" and a.page_ids == []
    h.run(ahead=True)
    assert b.output_token_ids == solo_outputs(prompt(6, start=20), max_tokens=8)
    assert len(a.output_token_ids) == 1 and h.sched.pool.num_used_pages == 0


def _ahead_after_one_step(sched: Scheduler):
    """Runs one synchronous step, then tries to schedule the next one ahead of it."""
    out = sched.schedule()
    ahead = sched.schedule_ahead(out)
    return out, ahead


def test_penalties_prompt_logprobs_grammars_and_speculation_wait():
    cases = [
        (dict(), dict(presence_penalty=0.5)),
        (dict(), dict(repetition_penalty=1.2)),
    ]
    for cfg, sp in cases:
        sched = Scheduler(make_config(**cfg), 16, 32, (EOS,))
        req = make_request("a", prompt(5), **sp)
        sched.add_request(req)
        out, ahead = _ahead_after_one_step(sched)
        assert ahead is None and not req.has_placeholder, sp
        sched.update(out, RunnerOutput(np.array([7], np.int32)))
        assert req.output_token_ids == [7]

    sched = Scheduler(make_config(max_num_batched_tokens=4), 16, 32, (EOS,))
    req = make_request("a", prompt(10), prompt_logprobs=1)  # chunks of 4: scored by update
    sched.add_request(req)
    assert _ahead_after_one_step(sched)[1] is None

    sched = Scheduler(make_config(), 16, 32, (EOS,))
    req = make_request("a", prompt(5), structured_outputs=StructuredOutputs(regex="a+"))
    req.grammar = object()  # any matcher: its masks need the tokens
    sched.add_request(req)
    assert _ahead_after_one_step(sched)[1] is None and not req.has_placeholder

    config = make_config(speculative_method="ngram", num_speculative_tokens=2)
    sched = Scheduler(config, 16, 32, (EOS,), spec_policy=SpecPolicy.from_config(config))
    req = make_request("a", prompt(5))
    req.spec_enabled = True
    sched.add_request(req)
    assert _ahead_after_one_step(sched)[1] is None and not req.has_placeholder


def test_a_request_that_opted_out_of_speculation_runs_ahead():
    """On a speculating engine, requests with spec_decode off get no drafts: their next step is
    known before their tokens are, unless one running request speculates."""
    config = make_config(speculative_method="ngram", num_speculative_tokens=2)
    sched = Scheduler(config, 16, 32, (EOS,), spec_policy=SpecPolicy.from_config(config))
    plain = make_request("a", prompt(5))  # spec_enabled False: the engine's resolution of
    sched.add_request(plain)              # SamplingParams(spec_decode=False)
    out, ahead = _ahead_after_one_step(sched)
    assert ahead is not None and plain.has_placeholder
    sched.update(out, RunnerOutput(np.array([7], np.int32)))
    assert plain.output_token_ids == [7] and not plain.has_placeholder

    sched = Scheduler(config, 16, 32, (EOS,), spec_policy=SpecPolicy.from_config(config))
    speculating = make_request("b", prompt(6, start=40))
    speculating.spec_enabled = True
    sched.add_request(make_request("a", prompt(5)))
    sched.add_request(speculating)
    assert _ahead_after_one_step(sched)[1] is None


def test_a_request_no_lookup_can_draft_for_runs_ahead():
    """With `may_draft_next` (the n-gram proposer's `may_match_next`), a speculating request
    whose last token is new to it runs ahead: no lookup can match after its next token; one whose
    last token occurred before does not."""
    from jaxinfer.runtime.spec_decode import NgramProposer

    config = make_config(speculative_method="ngram", num_speculative_tokens=2)
    for last, runs_ahead in ((99, True), (11, False)):
        sched = Scheduler(config, 16, 32, (EOS,), spec_policy=SpecPolicy.from_config(config),
                          may_draft_next=NgramProposer(2, 3).may_match_next)
        req = make_request("a", prompt(5) + [last])  # 10 .. 14, then 99 (new) or 11 (again)
        req.spec_enabled = True
        sched.add_request(req)
        out, ahead = _ahead_after_one_step(sched)
        assert (ahead is not None) == runs_ahead and req.has_placeholder == runs_ahead


def test_a_batch_too_large_to_speculate_runs_ahead():
    """Speculating requests block scheduling ahead only while they may have drafts: with a
    budget of 4 decode + draft tokens a step, 4 requests get none (4 // 4 - 1 = 0) and their
    next step is scheduled ahead; 2 may have one each, and a request holding drafts blocks it."""
    config = make_config(speculative_method="ngram", num_speculative_tokens=2,
                         spec_max_batched_tokens=4, max_num_seqs=4)

    def scheduler_with(n):
        sched = Scheduler(config, 32, 32, (EOS,), spec_policy=SpecPolicy.from_config(config))
        reqs = [make_request(f"r{i}", prompt(3, start=10 + 5 * i)) for i in range(n)]
        for req in reqs:
            req.spec_enabled = True
            sched.add_request(req)
        return sched, reqs

    sched, reqs = scheduler_with(4)
    out, ahead = _ahead_after_one_step(sched)
    assert ahead is not None and all(r.has_placeholder for r in reqs)
    sched.update(out, RunnerOutput(np.array([7, 8, 9, 6], np.int32)))
    assert [r.output_token_ids for r in reqs] == [[7], [8], [9], [6]]

    sched, reqs = scheduler_with(2)
    assert _ahead_after_one_step(sched)[1] is None

    sched, reqs = scheduler_with(4)
    sched.update(sched.schedule(), RunnerOutput(np.array([7, 8, 9, 6], np.int32)))
    reqs[2].spec_token_ids = [11]  # as if proposed at a smaller count
    out, ahead = _ahead_after_one_step(sched)  # the running step verifies it: 0 or 1 accepted
    assert [it.spec_token_ids for it in out.scheduled] == [[], [], [11], []]
    assert ahead is None and not any(r.has_placeholder for r in reqs)


def test_no_step_ahead_when_an_admission_or_a_preemption_is_due():
    # a free sequence slot and a waiting request: the next step admits it
    sched = Scheduler(make_config(max_num_seqs=2, max_num_batched_tokens=8), 16, 32, (EOS,))
    sched.add_request(make_request("a", prompt(8)))
    sched.add_request(make_request("b", prompt(8, start=30)))
    out, ahead = _ahead_after_one_step(sched)  # a's prompt fills the step; b waits
    assert [it.request.request_id for it in out.scheduled] == ["a"] and ahead is None

    # every slot taken: the waiting one could not be admitted anyway, so the step runs ahead
    sched = Scheduler(make_config(max_num_seqs=1), 16, 32, (EOS,))
    sched.add_request(make_request("a", prompt(5)))
    sched.add_request(make_request("b", prompt(5, start=30)))
    out, ahead = _ahead_after_one_step(sched)
    assert ahead is not None and [it.request.request_id for it in ahead.sched_out.scheduled] == ["a"]

    # ... unless the waiting one outranks a running one (priority policy: it would preempt)
    sched = Scheduler(make_config(max_num_seqs=1), 16, 32, (EOS,), policy="priority")
    sched.add_request(make_request("a", prompt(5)))
    sched.schedule()
    urgent = make_request("u", prompt(5, start=30))
    urgent.priority = -1
    sched.add_request(urgent)
    out = sched.schedule()  # preempts a for u
    assert [it.request.request_id for it in out.scheduled] == ["u"]
    sched.add_request(make_request("c", prompt(5, start=40)))
    assert sched.schedule_ahead(out) is not None  # c (priority 0) outranks nobody
    sched = Scheduler(make_config(max_num_seqs=1), 16, 32, (EOS,), policy="priority")
    sched.add_request(make_request("a", prompt(5)))
    out = sched.schedule()
    sched.add_request(urgent := make_request("u", prompt(5, start=30)))
    urgent.priority = -1
    assert sched.schedule_ahead(out) is None

    # the next page is not free: a preemption may be due, so the step waits
    sched = Scheduler(make_config(max_num_seqs=2, max_num_batched_tokens=16), 5, 16, (EOS,))
    sched.add_request(make_request("a", prompt(8)))
    sched.add_request(make_request("b", prompt(8, start=30)))
    out = sched.schedule()  # 2 pages each: the pool (4 usable pages) is full
    assert sched.pool.num_free_pages == 0
    assert sched.schedule_ahead(out) is None
    assert all(not it.request.has_placeholder for it in out.scheduled)


def test_update_ignores_the_record_of_another_step_ahead():
    """A step scheduled ahead is tied to the step it followed: a stale one (its step failed and
    was never updated) does not shift a later update."""
    sched = Scheduler(make_config(), 16, 32, (EOS,))
    a = make_request("a", prompt(5))
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, RunnerOutput(np.array([7], np.int32)))
    out2 = sched.schedule()
    assert sched.schedule_ahead(out2) is not None
    sched.finish_request("a", "abort")  # the engine's recovery ends the requests of both steps
    b = make_request("a", prompt(5, start=30))  # the same id, reused
    sched.add_request(b)
    out3 = sched.schedule()
    assert sched.update(out3, RunnerOutput(np.array([9], np.int32))) == [b]
    assert b.output_token_ids == [9] and b.status is RequestStatus.RUNNING
    sched.check_invariants()
