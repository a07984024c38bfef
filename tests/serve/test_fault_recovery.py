"""A step that fails on the device, on the real engine (the tiny random Llama): a stand-in for the
runner's compiled step deletes the donated KV cache, as a step that died after taking its buffers
does, and raises. The step's requests fail (500, or an error event mid-stream), the cache is
re-allocated, every page comes back, the next requests give the tokens of a healthy engine, and
/health answers 503 only while the engine keeps failing."""

from __future__ import annotations

import json

import jax
import pytest
from starlette.testclient import TestClient

from jaxinfer.engine import LLMEngine
from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.client import StepFailed
from jaxinfer.sampling_params import SamplingParams
from serve.app import create_app
from tests.serve.conftest import sse_events, wait_healthy

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
MODEL = "tiny"


class FailingStep:
    """Replaces `runner._step` (the jitted step; the runner has no ahead-of-time executables
    without warm-up): the next `times` calls delete the donated KV cache and raise, or with
    `late`, return outputs whose computation failed (the error shows when they are awaited)."""

    def __init__(self, runner):
        self.runner, self.real, self.times, self.late = runner, runner._step, 0, False
        assert not runner._executables
        runner._step = self

    def __call__(self, *args):
        if self.times <= 0:
            return self.real(*args)
        self.times -= 1
        if self.late:  # args: state, kv_cache, buf, ...
            return FailedArray(args[1].k), jax.tree_util.tree_map(FailedArray, args[1])
        for x in jax.tree_util.tree_leaves(args[1]):
            x.delete()
        raise RuntimeError("RESOURCE_EXHAUSTED: injected out of device memory")


class FailedArray:
    """An output of a failed asynchronous computation: its metadata reads, awaiting it raises."""

    def __init__(self, like):
        self.shape, self.dtype, self.sharding = like.shape, like.dtype, like.sharding

    def is_deleted(self) -> bool:
        return False

    def block_until_ready(self):
        raise RuntimeError("INTERNAL: injected failure of an asynchronous step")

    copy_to_host_async = block_until_ready


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(tiny_llama_dir, num_pages=48, page_size=8, max_num_seqs=4,
                     max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def failing(engine):
    return FailingStep(engine.runner)


@pytest.fixture(scope="module")
def reference(engine, failing):
    """Greedy (tokens, text) of each prompt from the engine before any failure."""
    return [_run(engine, f"ref{i}", p) for i, p in enumerate(PROMPTS)]


def _run(engine, request_id, prompt, params=GREEDY) -> tuple[list[int], str]:
    """(token ids, text) of one request run alone."""
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids), out.outputs[0].text
    raise AssertionError("no finished output")


def _all_pages_back(engine) -> None:
    engine.scheduler.check_invariants()
    assert engine.scheduler.pool.num_free_pages == engine.num_pages - 1


def test_failed_step_ends_its_requests_and_the_engine_recovers(engine, failing, reference):
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.pool.num_cached_pages > 0  # the prompt's full pages
    engine.add_request("b", PROMPTS[1], GREEDY)
    failing.times = 1
    # The engine schedules decode steps ahead: a's next step was started by the last call, and
    # this one returns its token without starting another (b waits for a step of its own).
    assert [out.request_id for out in engine.step()] == ["a"]
    assert failing.times == 1
    with pytest.raises(StepFailed, match="RESOURCE_EXHAUSTED") as info:
        engine.step()
    assert set(info.value.request_ids) == {"a", "b"}
    assert not engine.has_unfinished_requests()
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(engine.runner.kv_cache))
    assert engine.scheduler.pool.num_cached_pages == 0  # their K/V went with the cache
    _all_pages_back(engine)
    assert [_run(engine, f"after{i}", p) for i, p in enumerate(PROMPTS)] == reference
    _all_pages_back(engine)


def test_a_failure_that_shows_when_the_step_is_awaited_recovers_too(engine, failing, reference):
    engine.add_request("late", PROMPTS[0], GREEDY)
    failing.times, failing.late = 1, True
    try:
        with pytest.raises(StepFailed, match="INTERNAL"):
            engine.step()
    finally:
        failing.late = False
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(engine.runner.kv_cache))
    _all_pages_back(engine)
    assert _run(engine, "after-late", PROMPTS[0]) == reference[0]


@pytest.fixture(scope="module")
def client(engine, failing, reference):
    ae = AsyncEngine(engine, warmup=False, max_step_failures=3)
    with TestClient(create_app(ae, served_model_name=MODEL)) as c:
        wait_healthy(c)
        yield c
    assert not engine.has_unfinished_requests()


def _complete(client, prompt, **extra):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                "temperature": 0, "ignore_eos": True, **extra})


def test_server_answers_500_then_serves_the_same_tokens(client, engine, failing, reference):
    failing.times = 1
    r = _complete(client, PROMPTS[0])
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error"
    assert "RESOURCE_EXHAUSTED" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    for prompt, ref in zip(PROMPTS, reference):
        r = _complete(client, prompt)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == ref[1]
    _all_pages_back(engine)


def test_stream_gets_an_error_event_mid_stream(client, engine, failing):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, armed = "", False
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for chunk in r.iter_text():
            if "data: {" in chunk and not armed:
                failing.times, armed = 1, True  # after the first token: fails mid-stream
            text += chunk
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error"
    assert any("choices" in e for e in events[:-2])
    assert failing.times == 0
    assert client.get("/health").status_code == 200
    _all_pages_back(engine)


def test_health_is_503_after_repeated_failures_and_200_once_a_step_succeeds(client, engine,
                                                                          failing, reference):
    errors_before = _step_errors(client)
    failing.times = 10**6
    try:
        for _ in range(3):
            assert _complete(client, PROMPTS[1]).status_code == 500
        health = client.get("/health")
        assert health.status_code == 503
        assert "consecutive engine steps failed" in health.json()["status"]
        assert "RESOURCE_EXHAUSTED" in health.json()["status"]
    finally:
        failing.times = 0
    r = _complete(client, PROMPTS[1])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[1][1]
    assert client.get("/health").status_code == 200
    assert _step_errors(client) == errors_before + 3
    _all_pages_back(engine)
    assert json.loads(client.get("/health").text) == {"status": "ok"}


def _step_errors(client) -> float:
    """The server's count of failed engine steps (/metrics)."""
    (value,) = [float(line.split()[1]) for line in client.get("/metrics").text.splitlines()
                if line.startswith("jaxinfer_engine_step_errors_total ")]
    return value
