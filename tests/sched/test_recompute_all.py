"""Scheduler.recompute_all, what the engine does after a failed step lost the KV cache: every
running request goes back to the queue (pages freed, admission order kept) and, with the prefix
cache reset, the pool is whole again; the requests then finish with the outputs they would have
had without the loss."""

from jaxinfer.request import RequestStatus
from tests.sched.fake_runner import Harness, make_request, solo_outputs


def test_recompute_all_frees_every_page_and_the_requests_finish_as_if_nothing_happened():
    h = Harness(num_pages=32, max_model_len=32, max_num_batched_tokens=32)
    a = h.add(make_request("a", range(10, 19), max_tokens=12, ignore_eos=True))
    b = h.add(make_request("b", range(30, 36), max_tokens=12, ignore_eos=True, seed=3))
    for _ in range(4):
        h.step()
    assert a.status is b.status is RequestStatus.RUNNING and a.num_output_tokens > 1
    sched = h.sched
    assert sched.pool.num_cached_pages > 0

    sched.recompute_all()
    sched.reset_prefix_cache()
    sched.check_invariants()
    assert sched.running == [] and list(sched.waiting) == [a, b]  # admission order
    assert a.status is b.status is RequestStatus.PREEMPTED and a.page_ids == b.page_ids == []
    assert sched.pool.num_free_pages == sched.pool.num_usable_pages
    assert sched.pool.num_cached_pages == 0

    h.run()
    assert a.output_token_ids == solo_outputs(range(10, 19), max_tokens=12, ignore_eos=True)
    assert b.output_token_ids == solo_outputs(range(30, 36), max_tokens=12, ignore_eos=True, seed=3)
    assert sched.pool.num_used_pages == 0
