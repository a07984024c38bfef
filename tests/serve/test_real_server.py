"""A real uvicorn process on 127.0.0.1 (random free port), driven by the official `openai` client
and by raw httpx streams: the API end to end, client disconnects, graceful SIGTERM.

The fake-engine server starts in about a second; the tiny-model server (real engine, random
weights) is in test_real_engine_server.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import openai
import pytest

from tests.serve.api_checks import check_drop_half_of_20_streams, check_openai_api
from tests.serve.conftest import free_port
from tests.serve.server_process import server_process

TIMEOUT = 60.0
MODEL = "fake-model"


@pytest.fixture(scope="module")
def fake_server():
    port = free_port()
    with server_process(["-m", "tests.serve.fake_server", "--port", str(port)], port,
                        timeout=TIMEOUT) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(fake_server):
    with openai.OpenAI(base_url=f"{fake_server.base_url}/v1", api_key="none", timeout=TIMEOUT,
                       max_retries=0) as c:
        yield c


def test_openai_client_against_fake_engine_server(client):
    check_openai_api(client, MODEL)


def test_fake_server_exact_greedy_text(client):
    from tests.serve.fake_engine import GREEDY_TEXT, FakeTokenizer

    ids = FakeTokenizer().encode("Hello")
    want = "".join(GREEDY_TEXT[(sum(ids) + i) % len(GREEDY_TEXT)] for i in range(9))
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0)
    assert r.choices[0].text == want


def test_fake_server_logs_ready_and_one_line_per_request(fake_server):
    """The process's own log (serve/logs.py's format on stderr): the ready line, then an access
    line per request with its tokens; uvicorn's access log is off."""
    port = fake_server.base_url.rsplit(":", 1)[1]
    r = httpx.post(f"{fake_server.base_url}/v1/completions", json={
        "prompt": "log me", "max_tokens": 3}, timeout=TIMEOUT)
    assert r.status_code == 200
    access = re.compile(r"INFO serve\.access: POST /v1/completions 200 prompt=6 output=3 "
                        r"\d+\.\d ms")
    deadline = time.monotonic() + TIMEOUT
    while not access.search(fake_server.log()):
        assert time.monotonic() < deadline, fake_server.log()[-3000:]
        time.sleep(0.05)
    log = fake_server.log()
    assert re.search(rf"INFO serve\.cli: ready: http://127\.0\.0\.1:{port} \(3 executables, "
                     r"\d+\.\d s\)", log), log[-3000:]
    assert "uvicorn.access" not in log


def test_dropping_half_of_20_streams_frees_every_page(fake_server):
    check_drop_half_of_20_streams(fake_server.base_url, MODEL, keep_tokens=60, drop_tokens=1500,
                                  timeout=TIMEOUT)


# -- graceful shutdown --------------------------------------------------------------------------------------
def test_sigterm_drains_running_streams_then_exits():
    port = free_port()
    args = ["-m", "tests.serve.fake_server", "--port", str(port), "--step-delay-s", "0.02"]
    with server_process(args, port, timeout=TIMEOUT) as srv:

        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:

                async def stream(i):
                    body = {"prompt": f"p{i}", "stream": True, "max_tokens": 40, "temperature": 0}
                    events = []
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                    return events

                tasks = [asyncio.create_task(stream(i)) for i in range(4)]
                await asyncio.sleep(0.3)  # the streams are running (40 steps of 20 ms each)
                srv.proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)

        results = asyncio.run(run())
        for events in results:
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "length"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            assert len(text) == 40  # the fake tokenizer: 1 character per token
        code = srv.proc.wait(TIMEOUT)
        assert code == 0, srv.log()[-3000:]  # a clean drain is a clean exit
        assert "Application shutdown complete" in srv.log()
