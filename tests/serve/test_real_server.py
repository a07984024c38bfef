"""A real uvicorn process on 127.0.0.1 (random free port), driven by the official `openai` client
and by raw httpx streams: the API end to end, client disconnects, graceful SIGTERM.

The fake-engine server starts in about a second; the tiny-model server (real engine, random
weights) is in test_real_engine_server.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

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


def metric_values(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


# -- the API through the official client -------------------------------------------------------------
def check_openai_api(client: openai.OpenAI, model: str) -> None:
    """Generic checks that hold for any engine (shared with the real-engine server test)."""
    models = client.models.list()
    assert [m.id for m in models.data] == [model]

    # completions; the stream carries the same text
    r = client.completions.create(model=model, prompt="Hello there", max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="Hello there", max_tokens=12, temperature=0, stream=True)
        if ch.choices)
    assert streamed == c.text

    # chat, and streaming chat with usage
    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage.completion_tokens == chat.usage.completion_tokens and finish is not None

    # seeds: reproducible, and n=2 gives choice i the seed + i
    def sample(seed, n=1):
        return client.completions.create(model=model, prompt="Once", max_tokens=10,
                                         temperature=1.0, seed=seed, n=n)

    a, b = sample(1234), sample(1234)
    assert a.choices[0].text == b.choices[0].text
    pair = sample(1234, n=2)
    assert [ch.index for ch in pair.choices] == [0, 1]
    assert pair.choices[0].text == a.choices[0].text
    assert pair.choices[1].text == sample(1235).choices[0].text
    assert pair.usage.completion_tokens >= 2 and pair.usage.prompt_tokens == a.usage.prompt_tokens

    # stop strings cut the text before the stop string
    full = client.completions.create(model=model, prompt="The", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next((full[i:i + 3] for i in range(2, len(full) - 3)
                 if full[i:i + 3].strip() and "\ufffd" not in full[i:i + 3]), None)
    if stop is not None:
        cut = client.completions.create(model=model, prompt="The", max_tokens=24, temperature=0,
                                        stop=[stop], extra_body={"ignore_eos": True}).choices[0]
        assert cut.finish_reason == "stop"
        assert cut.text == full[:full.index(stop)]

    # logprobs, both shapes
    r = client.completions.create(model=model, prompt="Hi", max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(e.logprob <= 0.0 and len(e.top_logprobs) == 2 for e in content)
    # greedy: the sampled token is the most likely one
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)

    # errors come back as the client's typed exceptions
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def test_openai_client_against_fake_engine_server(client):
    check_openai_api(client, MODEL)


def test_fake_server_exact_greedy_text(client):
    from tests.serve.fake_engine import GREEDY_TEXT, FakeTokenizer

    ids = FakeTokenizer().encode("Hello")
    want = "".join(GREEDY_TEXT[(sum(ids) + i) % len(GREEDY_TEXT)] for i in range(9))
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0)
    assert r.choices[0].text == want


# -- disconnects ------------------------------------------------------------------------------------------
async def _open_streams_drop_half(base_url: str, num_streams: int = 20) -> list[dict]:
    """Opens `num_streams` streams; after 3 events each, drops the odd ones (closing the
    connection); reads the rest to [DONE]. Returns the finished streams' last chunks."""
    limits = httpx.Limits(max_connections=num_streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT, limits=limits) as http:

        async def one(i: int):
            keep = i % 2 == 0
            body = {"model": MODEL, "prompt": f"stream {i}", "stream": True, "temperature": 0,
                    "max_tokens": 60 if keep else 1500}
            events = []
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if not keep and len(events) == 3:
                        return None  # leaving the block closes the connection mid-stream
                    if events[-1] == "[DONE]":
                        break
            assert events[-1] == "[DONE]"
            return json.loads(events[-2])

        results = await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(num_streams)]),
                                         TIMEOUT)
    return [r for r in results if r is not None]


def _wait_for_metrics(base_url: str, want: dict[str, float], timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(base_url)
        if all(values.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def test_dropping_half_of_20_streams_frees_every_page(fake_server):
    base = fake_server.base_url
    before = metric_values(base).get(
        'jaxinfer_requests_total{endpoint="completions",outcome="disconnected"}', 0.0)
    finished = asyncio.run(_open_streams_drop_half(base))
    assert len(finished) == 10
    assert all(ch["choices"][0]["finish_reason"] == "length" for ch in finished)
    values = _wait_for_metrics(base, {"jaxinfer_kv_pages_used": 0.0,
                                      "jaxinfer_num_requests_running": 0.0,
                                      "jaxinfer_server_requests_in_flight": 0.0})
    assert values["jaxinfer_kv_pages_used"] == 0
    assert values["jaxinfer_num_requests_running"] == 0
    assert values["jaxinfer_num_requests_waiting"] == 0
    assert values["jaxinfer_server_requests_in_flight"] == 0
    dropped = values['jaxinfer_requests_total{endpoint="completions",outcome="disconnected"}']
    assert dropped - before == 10
    # the dropped streams were cut short: far fewer tokens than their 10 x 1500
    assert values["jaxinfer_generation_tokens_total"] < 10 * 1500
    assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}


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
        # uvicorn re-raises the captured SIGTERM once it has shut down cleanly
        assert code in (0, -signal.SIGTERM), srv.log()[-3000:]
        assert "Application shutdown complete" in srv.log()
