"""Overload on a real uvicorn server over the fake engine: 10x more concurrent clients than the
engine runs at once get either their completion (in bounded time) or 503 with Retry-After once
the waiting queue is full, and nothing else; a client that stops reading its stream stalls
nobody, holds one output's memory, and its request is aborted when it leaves."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.sampling_params import SamplingParams
from tests.serve.conftest import MODEL, anyio_backend  # noqa: F401 - a fixture
from tests.serve.fake_engine import FakeEngine
from tests.serve.uvicorn_thread import serving

MAX_NUM_SEQS = 4
MAX_WAITING = 8


async def _one(client: httpx.AsyncClient, max_tokens: int) -> tuple[int, float, httpx.Response]:
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7],
                                                   "max_tokens": max_tokens, "temperature": 0})
    return r.status_code, time.perf_counter() - t0, r


def test_ten_times_more_clients_than_slots_get_answers_or_503():
    engine = FakeEngine(max_num_seqs=MAX_NUM_SEQS, step_delay_s=0.01)
    num_clients, max_tokens = 10 * MAX_NUM_SEQS, 20
    with serving(engine, MAX_WAITING) as (base, ae):
        async def burst():
            limits = httpx.Limits(max_connections=num_clients)
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
                return await asyncio.gather(*[_one(client, max_tokens) for _ in range(num_clients)])

        results = asyncio.run(burst())
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 503}, statuses
        refused = [r for s, _, r in results if s == 503]
        assert refused, "the queue never filled"
        for r in refused:
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
        admitted = [dt for s, dt, _ in results if s == 200]
        assert len(admitted) >= MAX_WAITING
        # Admitted at most MAX_WAITING + MAX_NUM_SEQS deep: a few batches of 20 steps of 10 ms.
        batches = -(-(MAX_WAITING + MAX_NUM_SEQS) // MAX_NUM_SEQS)
        assert max(admitted) < 10 * batches * max_tokens * engine.step_delay_s
        assert httpx.get(f"{base}/health").status_code == 200
        assert ae.num_in_flight == 0 and ae.num_waiting == 0
    assert engine._used_pages == 0 and not engine._running and not engine._waiting


def test_a_client_that_stops_reading_stalls_nobody():
    engine = FakeEngine(max_num_seqs=MAX_NUM_SEQS, step_delay_s=0.002, max_model_len=8192)
    with serving(engine, MAX_WAITING) as (base, ae):
        port = int(base.rsplit(":", 1)[1])
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        body = json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 8000,
                           "temperature": 0, "stream": True}).encode()
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while ae.num_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ae.num_in_flight == 1  # streaming, never read
        steps = engine.num_steps
        t0 = time.perf_counter()
        for _ in range(5):
            r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": [3],
                                                           "max_tokens": 10}, timeout=30)
            assert r.status_code == 200
        assert time.perf_counter() - t0 < 10
        assert engine.num_steps > steps + 40  # the engine kept stepping
        stalled.close()  # leaving aborts its request
        deadline = time.monotonic() + 20
        while ae.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ae.num_in_flight == 0
    assert engine._used_pages == 0 and not engine._running and not engine._waiting


@pytest.mark.anyio
async def test_a_lagging_consumer_skips_to_the_newest_output():
    engine = FakeEngine(step_delay_s=0.001)
    ae = AsyncEngine(engine)
    await ae.wait_ready(20)
    gen = ae.generate([4, 4], SamplingParams(max_tokens=50, temperature=0), "lag")
    first = await gen.__anext__()
    deadline = time.monotonic() + 20
    while (engine._running or engine._waiting) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # the engine runs the request to its end; nobody reads
    last = await gen.__anext__()  # the one output the stream kept: the finished one
    assert last.finished and len(last.outputs[0].token_ids) == 50
    assert len(first.outputs[0].token_ids) < 50
    await gen.aclose()
    await ae.shutdown(20)
