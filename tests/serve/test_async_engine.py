"""AsyncEngine on the fake engine: streaming, abort, the waiting bound, step errors, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from jaxinfer.engine.async_engine import AsyncEngine, EngineError, EngineOverloaded, EngineShuttingDown
from jaxinfer.sampling_params import SamplingParams
from tests.serve.fake_engine import GREEDY_TEXT, FakeEngine

pytestmark = pytest.mark.anyio
TIMEOUT = 20.0


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _collect(ae, prompt, params, request_id):
    outs = []
    async for out in ae.generate(prompt, params, request_id):
        outs.append(out)
    return outs


def _expected_greedy(prompt_ids, n):
    start = sum(prompt_ids)
    return "".join(GREEDY_TEXT[(start + i) % len(GREEDY_TEXT)] for i in range(n))


async def test_generate_streams_cumulative_outputs_until_finished():
    engine = FakeEngine()
    ae = AsyncEngine(engine)
    await ae.wait_ready(TIMEOUT)
    assert engine.warmed_up and ae.is_ready
    params = SamplingParams(max_tokens=5, temperature=0.0)
    outs = await asyncio.wait_for(_collect(ae, [10, 11, 12], params, "r1"), TIMEOUT)
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == _expected_greedy([10, 11, 12], 5)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert ae.num_in_flight == 0 and ae.num_waiting == 0
    await ae.shutdown(TIMEOUT)


class _SlowMetricsEngine(FakeEngine):
    """engine.metrics takes a while: a snapshot taken after the outputs went out would lose the
    race against a caller that reads it right after its last output."""

    @property
    def metrics(self):
        time.sleep(0.1)
        return super().metrics


async def test_a_finished_request_is_in_the_metrics_when_its_last_output_arrives():
    ae = AsyncEngine(_SlowMetricsEngine())
    await ae.wait_ready(TIMEOUT)
    for i in range(3):
        outs = await asyncio.wait_for(
            _collect(ae, [10, 11], SamplingParams(max_tokens=3, temperature=0.0), f"m{i}"), TIMEOUT)
        assert outs[-1].finished
        snap = ae.metrics_snapshot  # read at once, as GET /metrics after the response would
        assert snap.num_finished_total == i + 1
        assert snap.num_running == 0 and snap.num_waiting == 0 and snap.num_used_pages == 0
    await ae.shutdown(TIMEOUT)


async def test_leaving_early_aborts_and_frees_pages():
    engine = FakeEngine(step_delay_s=0.002)
    ae = AsyncEngine(engine)
    await ae.wait_ready(TIMEOUT)

    async def take_two():
        n = 0
        async for out in ae.generate([5] * 10, SamplingParams(max_tokens=200, temperature=0), "r"):
            n += 1
            if n == 2:
                return out

    out = await asyncio.wait_for(take_two(), TIMEOUT)
    assert not out.finished
    await ae.call(lambda e: None)  # the abort command ran before this one
    assert engine.aborted_ids == ["r"]
    metrics = await ae.call(lambda e: e.metrics)
    assert metrics.num_used_pages == 0 and metrics.num_running == 0
    await ae.shutdown(TIMEOUT)


async def test_cancelling_the_task_aborts():
    engine = FakeEngine(step_delay_s=0.002)
    ae = AsyncEngine(engine)
    await ae.wait_ready(TIMEOUT)
    task = asyncio.create_task(_collect(ae, [5] * 10, SamplingParams(max_tokens=10_000 // 50), "c"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await ae.call(lambda e: None)
    assert engine.aborted_ids == ["c"]
    assert (await ae.call(lambda e: e.metrics)).num_used_pages == 0
    await ae.shutdown(TIMEOUT)


async def test_bad_prompt_raises_value_error():
    ae = AsyncEngine(FakeEngine(max_model_len=16))
    with pytest.raises(ValueError, match="context limit is 16"):
        await asyncio.wait_for(_collect(ae, [7] * 20, SamplingParams(), "long"), TIMEOUT)
    assert ae.num_waiting == 0 and ae.num_in_flight == 0
    await ae.shutdown(TIMEOUT)


async def test_waiting_bound_raises_overloaded():
    engine = FakeEngine(max_num_seqs=1, step_delay_s=0.01)
    ae = AsyncEngine(engine, max_waiting=2)
    await ae.wait_ready(TIMEOUT)
    params = SamplingParams(max_tokens=3, temperature=0)
    # Two admitted requests have no token yet: the third is refused at once.
    gens = [ae.generate([9, 9], params, f"w{i}") for i in range(2)]
    tasks = [asyncio.create_task(g.__anext__()) for g in gens]
    await asyncio.sleep(0)  # both registered
    assert ae.num_waiting == 2
    with pytest.raises(EngineOverloaded):
        await ae.generate([9, 9], params, "w2").__anext__()
    for t in tasks:
        await asyncio.wait_for(t, TIMEOUT)
    for g in gens:
        await g.aclose()
    await ae.shutdown(TIMEOUT)


async def test_step_error_fails_requests_and_keeps_serving():
    engine = FakeEngine()
    ae = AsyncEngine(engine)
    await ae.wait_ready(TIMEOUT)
    engine.fail_steps = 1  # read by the engine thread at its next step
    with pytest.raises(EngineError, match="injected step failure"):
        await asyncio.wait_for(_collect(ae, [3, 4], SamplingParams(max_tokens=4), "bad"), TIMEOUT)
    assert ae.num_step_errors == 1
    outs = await asyncio.wait_for(_collect(ae, [3, 4], SamplingParams(max_tokens=4), "good"), TIMEOUT)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    await ae.shutdown(TIMEOUT)


async def test_many_concurrent_requests_each_get_their_own_output():
    engine = FakeEngine(max_num_seqs=4)
    ae = AsyncEngine(engine)
    prompts = [[20 + i, 30] for i in range(12)]
    results = await asyncio.wait_for(asyncio.gather(*[
        _collect(ae, p, SamplingParams(max_tokens=6, temperature=0), f"m{i}")
        for i, p in enumerate(prompts)]), TIMEOUT)
    for p, outs in zip(prompts, results):
        assert outs[-1].outputs[0].text == _expected_greedy(p, 6)
    assert engine.max_batch_seen == 4
    await ae.shutdown(TIMEOUT)


async def test_shutdown_drains_running_and_refuses_new():
    engine = FakeEngine(step_delay_s=0.005)
    ae = AsyncEngine(engine)
    await ae.wait_ready(TIMEOUT)
    task = asyncio.create_task(_collect(ae, [1, 2, 3], SamplingParams(max_tokens=20), "d"))
    await asyncio.sleep(0.02)
    ae.stop_admissions()
    await asyncio.sleep(0)
    assert not ae.is_ready
    with pytest.raises(EngineShuttingDown):
        await ae.generate([1], SamplingParams(), "late").__anext__()
    await asyncio.wait_for(ae.shutdown(TIMEOUT), TIMEOUT)
    outs = task.result()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 20


async def test_warmup_error_is_reported_not_ready():
    class Broken(FakeEngine):
        def warmup(self):
            raise RuntimeError("no device")

    ae = AsyncEngine(Broken())
    await ae.wait_ready(TIMEOUT)
    assert not ae.is_ready and "no device" in str(ae.warmup_error)
    await ae.shutdown(TIMEOUT)


async def test_any_engine_call_failing_keeps_the_loop_alive():
    class Flaky(FakeEngine):
        fail_checks = 0

        def has_unfinished_requests(self):
            if self.fail_checks and self._running:
                self.fail_checks -= 1
                raise RuntimeError("flaky check")
            return super().has_unfinished_requests()

    engine = Flaky(step_delay_s=0.002)
    ae = AsyncEngine(engine)
    await ae.wait_ready(TIMEOUT)
    engine.fail_checks = 1
    with pytest.raises(EngineError, match="flaky check"):
        await asyncio.wait_for(_collect(ae, [3], SamplingParams(max_tokens=50), "x"), TIMEOUT)
    outs = await asyncio.wait_for(_collect(ae, [3], SamplingParams(max_tokens=3), "y"), TIMEOUT)
    assert outs[-1].finished
    assert (await ae.call(lambda e: e.metrics)).num_used_pages == 0
    await ae.shutdown(TIMEOUT)


async def test_a_caller_leaving_before_its_add_runs_fails_nobody_else():
    """A request cancelled while its add waits for the engine thread (busy in a step) is dropped
    there; the requests in flight finish as if it never came (no engine error)."""
    engine = FakeEngine(step_delay_s=0.05)
    ae = AsyncEngine(engine)
    await ae.wait_ready(TIMEOUT)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    running = asyncio.create_task(_collect(ae, [3, 4], params, "running"))
    while ae.num_in_flight == 0:
        await asyncio.sleep(0.001)
    for i in range(5):
        leaving = asyncio.create_task(_collect(ae, [7], params, f"leaving-{i}"))
        await asyncio.sleep(0)  # its add is queued; the engine thread is inside a step
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
    outs = await asyncio.wait_for(running, TIMEOUT)
    assert outs[-1].outputs[0].text == _expected_greedy([3, 4], 8)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert ae.num_consecutive_step_errors == 0 and ae.num_in_flight == 0
    await ae.shutdown(TIMEOUT)
