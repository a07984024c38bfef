"""Background requests (batch lines, service_tier "flex") yield to interactive ones: they queue
behind them, are preempted for them, and share a capped part of each step while any interactive
request is in the engine; with none, they get the whole step."""

import pytest

from jaxinfer.request import Request, RequestStatus
from jaxinfer.sampling_params import SamplingParams
from tests.sched.fake_runner import Harness, make_request, solo_outputs


def prompt(n, start=10):
    return list(range(start, start + n))


def background(rid, p, **sp):
    req = make_request(rid, p, **sp)
    req.background = True
    return req


def ids(sched_out):
    return [s.request.request_id for s in sched_out.scheduled]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_interactive_requests_queue_ahead_of_background_ones(policy):
    h = Harness(num_pages=32, max_model_len=32, max_num_seqs=1, policy=policy)
    h.add(background("b0", prompt(3), max_tokens=1))
    h.add(background("b1", prompt(3, 30), max_tokens=1))
    h.add(make_request("i0", prompt(3, 50), max_tokens=1))
    h.add(make_request("i1", prompt(3, 70), max_tokens=1))
    order = []
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        order += ids(out)
    assert order == ["i0", "i1", "b0", "b1"]


def test_a_preempted_background_request_stays_behind_interactive_ones_under_fcfs():
    h = Harness(num_pages=32, max_model_len=32, max_num_seqs=2)
    b = h.add(background("b", prompt(3), max_tokens=6, ignore_eos=True))
    h.step()
    h.add(make_request("i0", prompt(3, 40), max_tokens=6, ignore_eos=True))
    h.add(make_request("i1", prompt(3, 60), max_tokens=6, ignore_eos=True))
    out, _ = h.step()  # i0 takes the free slot
    assert sorted(ids(out)) == ["b", "i0"]
    out, _ = h.step()  # i1, at the head of the queue, finds no slot and preempts b
    assert out.preempted_request_ids == ["b"] and b.status is RequestStatus.PREEMPTED
    assert sorted(ids(out)) == ["i0", "i1"]
    assert [r.request_id for r in h.sched.waiting] == ["b"]
    h.add(make_request("i2", prompt(3, 80), max_tokens=1))
    assert [r.request_id for r in h.sched.waiting] == ["i2", "b"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_interactive_request_preempts_background_ones_for_a_slot_not_interactive_ones(policy):
    h = Harness(num_pages=32, max_model_len=32, max_num_seqs=2, policy=policy)
    i0 = h.add(make_request("i0", prompt(3), max_tokens=8, ignore_eos=True))
    b0 = h.add(background("b0", prompt(3, 30), max_tokens=8, ignore_eos=True))
    h.step()
    assert h.sched.running == [i0, b0]
    h.add(make_request("i1", prompt(3, 50), max_tokens=8, ignore_eos=True))
    out, _ = h.step()
    assert out.preempted_request_ids == ["b0"] and "i1" in ids(out)
    h.add(make_request("i2", prompt(3, 70), max_tokens=8, ignore_eos=True))
    out, _ = h.step()  # only interactive ones run: i2 waits for a slot
    assert out.preempted_request_ids == [] and sorted(ids(out)) == ["i0", "i1"]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_background_requests_get_a_capped_share_while_interactive_ones_run():
    clock = FakeClock()
    h = Harness(num_pages=64, max_model_len=32, max_num_seqs=8, max_num_batched_tokens=64,
                background_max_num_seqs=2, background_max_num_batched_tokens=5,
                background_linger_s=0.5, clock=clock)
    bgs = [h.add(background(f"b{i}", prompt(2, 10 + 4 * i), max_tokens=20, ignore_eos=True))
           for i in range(5)]
    out, _ = h.step()  # alone, they get the whole step
    assert sorted(ids(out)) == [f"b{i}" for i in range(5)]
    i0 = h.add(make_request("i0", prompt(12, 60), max_tokens=6, ignore_eos=True))
    out, _ = h.step()
    assert ids(out) == ["b0", "b1", "i0"]  # running ones first: 2 of the 5, then the admission
    assert out.scheduled[2].num_new_tokens == 12 and out.num_batched_tokens == 14
    while not i0.is_finished():
        out, _ = h.step()
        assert ids(out) == ["i0", "b0", "b1"]  # interactive first among running ones
    clock.now += 0.4
    out, _ = h.step()  # the interactive request is done, but left less than the linger ago
    assert ids(out) == ["b0", "b1"]
    clock.now += 0.1
    out, _ = h.step()  # the linger is over: every background one runs again
    assert sorted(ids(out)) == [f"b{i}" for i in range(5)]
    assert all(b.status is RequestStatus.RUNNING for b in bgs)


def test_background_prompts_go_in_chunks_of_the_share_while_interactive_ones_run():
    h = Harness(num_pages=64, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64,
                background_max_num_seqs=2, background_max_num_batched_tokens=6)
    h.add(make_request("i0", prompt(3, 60), max_tokens=10, ignore_eos=True))
    b = h.add(background("b", prompt(14), max_tokens=2, ignore_eos=True))
    chunks = []
    while b.num_output_tokens == 0:
        out, _ = h.step()
        chunks += [s.num_new_tokens for s in out.scheduled if s.request is b]
    assert chunks == [6, 6, 2]


def test_outputs_do_not_depend_on_the_background_share():
    specs = [(f"r{i}", prompt(3 + i % 5, 10 + 7 * i), dict(max_tokens=3 + i % 4, seed=i))
             for i in range(10)]
    h = Harness(num_pages=14, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=8,
                background_max_num_seqs=1, background_max_num_batched_tokens=3,
                background_linger_s=0.0)
    reqs = []
    for i, (rid, p, sp) in enumerate(specs):
        reqs.append(h.add(background(rid, p, **sp) if i % 2 else make_request(rid, p, **sp)))
    h.run()
    for (rid, p, sp), r in zip(specs, reqs):
        assert r.output_token_ids == solo_outputs(p, **sp), rid
    assert h.sched.pool.num_used_pages == 0


def test_priority_still_orders_within_each_kind():
    h = Harness(num_pages=32, max_model_len=32, max_num_seqs=1, policy="priority")
    reqs = [Request("b-late", prompt(3), SamplingParams(max_tokens=1), arrival_time=0.0,
                    priority=0, background=True),
            Request("i-low", prompt(3, 30), SamplingParams(max_tokens=1), arrival_time=1.0,
                    priority=9),
            Request("i-high", prompt(3, 50), SamplingParams(max_tokens=1), arrival_time=2.0,
                    priority=1)]
    for r in reqs:
        h.add(r)
    order = []
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        order += ids(out)
    assert order == ["i-high", "i-low", "b-late"]


def test_background_share_must_be_positive():
    from jaxinfer.config import EngineConfig
    with pytest.raises(ValueError, match="background_max_num_seqs=0"):
        EngineConfig(background_max_num_seqs=0)
    with pytest.raises(ValueError, match="background_linger_s=-1"):
        EngineConfig(background_linger_s=-1)
