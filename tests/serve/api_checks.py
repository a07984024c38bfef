"""Checks shared by the real-server tests (fake engine and tiny real engine): the OpenAI API through
the official client, and 20 streams of which half are dropped mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest


def metric_values(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


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


def check_drop_half_of_20_streams(base_url: str, model: str, *, keep_tokens: int,
                                  drop_tokens: int, timeout: float) -> None:
    """Opens 20 streams; after 3 events each, drops the odd ones (closing the connection); reads
    the rest to [DONE]. Then every page must be free, nothing running, and /health ok."""
    disconnected = 'jaxinfer_requests_total{endpoint="completions",outcome="disconnected"}'
    before = metric_values(base_url)
    finished = asyncio.run(asyncio.wait_for(
        _open_streams_drop_half(base_url, model, keep_tokens, drop_tokens, timeout), timeout))
    assert len(finished) == 10
    assert all(ch["choices"][0]["finish_reason"] == "length" for ch in finished)
    values = wait_for_metrics(base_url, {"jaxinfer_kv_pages_used": 0.0,
                                         "jaxinfer_num_requests_running": 0.0,
                                         "jaxinfer_server_requests_in_flight": 0.0}, timeout)
    assert values["jaxinfer_kv_pages_used"] == 0
    assert values["jaxinfer_num_requests_running"] == 0
    assert values["jaxinfer_num_requests_waiting"] == 0
    assert values["jaxinfer_server_requests_in_flight"] == 0
    assert values[disconnected] - before.get(disconnected, 0.0) == 10
    # the dropped streams were cut short
    generated = (values["jaxinfer_generation_tokens_total"]
                 - before.get("jaxinfer_generation_tokens_total", 0.0))
    assert generated < 10 * keep_tokens + 10 * drop_tokens
    assert httpx.get(f"{base_url}/health", timeout=10).json() == {"status": "ok"}


async def _open_streams_drop_half(base_url: str, model: str, keep_tokens: int, drop_tokens: int,
                                  timeout: float, num_streams: int = 20) -> list[dict]:
    limits = httpx.Limits(max_connections=num_streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:

        async def one(i: int):
            keep = i % 2 == 0
            body = {"model": model, "prompt": f"stream {i}", "stream": True, "temperature": 0,
                    "ignore_eos": True, "max_tokens": keep_tokens if keep else drop_tokens}
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

        results = await asyncio.gather(*[one(i) for i in range(num_streams)])
    return [r for r in results if r is not None]


def wait_for_metrics(base_url: str, want: dict[str, float], timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(base_url)
        if all(values.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return values
        time.sleep(0.1)
