"""Every route of the app in process, on the fake engine: bodies, streams, errors, auth, limits."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest

from jaxinfer.engine.async_engine import AsyncEngine
from serve.app import create_app
from tests.serve.conftest import MODEL, TIMEOUT, app_client, sse_events
from tests.serve.fake_engine import GREEDY_TEXT, FakeEngine, FakeTokenizer

TOK = FakeTokenizer()


def greedy(prompt_ids, n):
    start = sum(prompt_ids)
    return "".join(GREEDY_TEXT[(start + i) % len(GREEDY_TEXT)] for i in range(n))


def chat_ids(messages):
    return TOK.apply_chat_template(messages, add_generation_prompt=True)


def assert_error(r, status, param=None, code=None, type_=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if type_ is not None:
        assert err["type"] == type_, err
    return err


@pytest.fixture(scope="module")
def client():
    with app_client() as c:
        yield c


# -- small routes -----------------------------------------------------------------------------------
def test_health_is_503_until_warmup_is_done():
    engine = FakeEngine(warmup_delay_s=0.5)
    with app_client(engine, wait_ready=False) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        from tests.serve.conftest import wait_healthy
        wait_healthy(c)
        assert c.get("/health").json() == {"status": "ok"}
        assert engine.warmed_up


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == 256
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/gpt-9"), 404, param="model", code="model_not_found")


def test_unknown_route_and_method_use_the_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"prompt": "héllo"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == TOK.encode("héllo") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "héllo"}
    msgs = [{"role": "user", "content": "hi"}]
    assert client.post("/tokenize", json={"messages": msgs}).json()["tokens"] == chat_ids(msgs)
    assert_error(client.post("/detokenize", json={"tokens": [5, 10**6]}), 400, param="tokens")
    assert_error(client.post("/tokenize", json={}), 400, param="prompt")


# -- completions ----------------------------------------------------------------------------------------
def test_completion(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 7,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["text"] == greedy(TOK.encode("Hi"), 7) and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 7, "total_tokens": 9}


def test_completion_prompt_forms_and_n(client):
    ids = [40, 41, 42]
    for prompt in (ids, [ids]):
        body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3,
                                                    "temperature": 0}).json()
        assert [c["text"] for c in body["choices"]] == [greedy(ids, 3)]
    body = client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 4,
                                                "temperature": 0}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts == [greedy(TOK.encode("ab"), 4)] * 2 + [greedy(TOK.encode("cde"), 4)] * 2
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}


def test_completion_echo(client):
    body = client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 2, "echo": True,
                                                "temperature": 0}).json()
    assert body["choices"][0]["text"] == "Hey" + greedy(TOK.encode("Hey"), 2)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_with_logprobs(client, stream):
    """echo + logprobs: the prompt's tokens come first (the first with null logprob and top),
    then the output's; text offsets run on across both."""
    prompt = "Hey you"
    ids = TOK.encode(prompt)
    req = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    if stream:
        chunks = sse_events(client.post("/v1/completions", json={**req, "stream": True}).text)[:-1]
        parts = [c["choices"][0]["logprobs"] for c in chunks
                 if c["choices"] and c["choices"][0]["logprobs"]]
        lp = {k: [x for p in parts for x in p[k]] for k in parts[0]}
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        body = client.post("/v1/completions", json=req).json()
        lp, text = body["choices"][0]["logprobs"], body["choices"][0]["text"]
    assert text == prompt + greedy(ids, 3)
    n = len(ids)
    assert len(lp["tokens"]) == n + 3
    assert lp["token_logprobs"][:n] == [None] + [pytest.approx(-i / 10) for i in range(1, n)]
    assert lp["token_logprobs"][n:] == [-0.25] * 3
    assert lp["top_logprobs"][0] is None
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    offsets = np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1].tolist()
    assert lp["text_offset"] == offsets


def test_completion_stop_string(client):
    prompt = "x"
    full = greedy(TOK.encode(prompt), 40)
    stop = full[10:13]
    body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "stop": [stop],
                                                "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == full[: full.index(stop)]


def test_completion_seed_is_reproducible_and_n_uses_seed_plus_i(client):
    def run(**kw):
        return client.post("/v1/completions", json={"prompt": "s", "max_tokens": 8,
                                                    "temperature": 1.0, **kw}).json()

    a, b = run(seed=7), run(seed=7)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    pair = run(seed=7, n=2)
    assert pair["choices"][0]["text"] == a["choices"][0]["text"]
    assert pair["choices"][1]["text"] == run(seed=8)["choices"][0]["text"]
    assert pair["choices"][0]["text"] != pair["choices"][1]["text"]


def test_completion_logprobs(client):
    body = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 2,
                                                "temperature": 0}).json()
    lp = body["choices"][0]["logprobs"]
    text = body["choices"][0]["text"]
    assert "".join(lp["tokens"]) == text
    assert lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"] == [0, 1, 2]
    for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert len(top) == 2 and top[tok] == -0.25


def test_completion_stream(client):
    req = {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=req) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy(TOK.encode("Hi"), 6)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_completion_stream_include_usage(client):
    req = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True, "n": 2,
           "stream_options": {"include_usage": True}}
    events = sse_events(client.post("/v1/completions", json=req).text)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    assert all(c["usage"] is None for c in chunks)
    for index in (0, 1):
        text = "".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == index)
        assert text == greedy(TOK.encode("Hi"), 3)


# -- chat -------------------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_chat(client):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                   "max_completion_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": greedy(chat_ids(MESSAGES), 5)}
    assert choice["finish_reason"] == "length"
    n_prompt = len(chat_ids(MESSAGES))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5,
                             "total_tokens": n_prompt + 5}


def test_chat_content_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"},
                                          {"type": "text", "text": "lo"}]}]
    body = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 3,
                                                     "temperature": 0}).json()
    assert body["choices"][0]["message"]["content"] == greedy(
        chat_ids([{"role": "user", "content": "hello"}]), 3)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(client.post("/v1/chat/completions", json={"messages": image}), 400,
                 param="messages.0.content.0.type")


def test_chat_stream(client):
    req = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    events = sse_events(client.post("/v1/chat/completions", json=req).text)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == greedy(chat_ids(MESSAGES), 5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_chat_logprobs(client):
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3,
                                                     "logprobs": True, "top_logprobs": 2,
                                                     "temperature": 0}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    for e in content:
        assert e["logprob"] == -0.25 and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                     "temperature": 0}).json()
    assert body["choices"][0]["logprobs"] is None


def test_chat_stream_logprobs_cover_every_token(client):
    req = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True,
           "logprobs": True, "top_logprobs": 1}
    chunks = sse_events(client.post("/v1/chat/completions", json=req).text)[:-1]
    tokens = [e["token"] for c in chunks if c["choices"][0]["logprobs"]
              for e in c["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == greedy(chat_ids(MESSAGES), 6)


# -- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias.5"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": ["x"] * 600, "n": 2}, "n"),
    ({"prompt": [1, "a"]}, "prompt.1"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**7]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
])
def test_completion_invalid_values_name_the_field(client, body, param):
    err = assert_error(client.post("/v1/completions", json=body), 400, param=param,
                       type_="invalid_request_error")
    assert param in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]},
     "messages"),  # valid, but this chat template refuses the tool role
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
])
def test_chat_invalid_values_name_the_field(client, body, param):
    assert_error(client.post("/v1/chat/completions", json=body), 400, param=param)


def test_service_tier_flex_queues_the_request_in_the_background():
    engine = FakeEngine()
    with app_client(engine) as c:
        for tier, background in (("flex", True), ("default", False), ("auto", False),
                                 (None, False)):
            body = {"prompt": "x", "max_tokens": 1}
            if tier is not None:
                body["service_tier"] = tier
            before = set(engine.added)
            assert c.post("/v1/completions", json=body).status_code == 200
            (new_id,) = set(engine.added) - before
            assert engine.added[new_id] == {"priority": 0, "background": background}, tier
        before = set(engine.added)
        chat = {"messages": MESSAGES, "max_tokens": 1, "service_tier": "flex"}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        (new_id,) = set(engine.added) - before
        assert engine.added[new_id]["background"] is True
        assert_error(c.post("/v1/completions", json={"prompt": "x", "service_tier": "scale"}),
                     400, param="service_tier")


def test_bad_json_and_unknown_fields(client):
    assert_error(client.post("/v1/completions", content=b"{nope"), 400)
    assert_error(client.post("/v1/completions", content=b"[1, 2]"), 400)
    assert_error(client.post("/v1/completions", content=b""), 400)
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "whatever": [1]})
    assert ok.status_code == 200


def test_unknown_model_is_404(client):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        assert_error(client.post(path, json={"model": "gpt-4o", **body}), 404, param="model",
                     code="model_not_found")


def test_prompt_too_long_names_length_and_limit(client):
    err = assert_error(client.post("/v1/completions", json={"prompt": "y" * 300}), 400,
                       param="prompt", code="context_length_exceeded")
    assert err["message"].startswith("This model's maximum context length is 256 tokens. However, "
                                     "you requested 300 tokens in the prompt")


def test_engine_step_error_is_500_and_the_server_keeps_serving():
    engine = FakeEngine()
    with app_client(engine) as c:
        engine.fail_steps = 1
        assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 500,
                     code="engine_error", type_="internal_server_error")
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        # a stream starts with its first output: a failure before it is still an HTTP status
        engine.fail_steps = 1
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert_error(r, 500, code="engine_error")
        assert c.get("/health").status_code == 200


class _FailLaterEngine(FakeEngine):
    """Its step number `fail_at` (1-based) waits for `gate`, then raises."""

    def __init__(self, fail_at: int, **kw):
        super().__init__(**kw)
        self.fail_at = fail_at
        self.gate = threading.Event()

    def step(self, detokenize=True):
        if self.num_steps + 1 == self.fail_at:
            self.gate.wait(TIMEOUT)
            self.num_steps += 1
            raise RuntimeError("injected step failure")
        return super().step(detokenize)


def test_engine_error_after_the_stream_started_is_an_error_event():
    """After the 200 and the first chunks, a failure can only be reported in the stream (as
    OpenAI and vLLM do): an error event, then [DONE]."""
    engine = _FailLaterEngine(fail_at=2)
    with app_client(engine) as c:
        req = {"prompt": "x", "max_tokens": 8, "stream": True, "temperature": 0}
        with c.stream("POST", "/v1/completions", json=req) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            engine.gate.set()  # the stream has started: now the second step fails
            rest = "\n\n".join(line for line in lines if line)
        events = sse_events(first + "\n\n" + rest)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_error"
        assert events[-2]["error"]["type"] == "internal_server_error"
        text = "".join(e["choices"][0]["text"] for e in events[:-2])
        assert text == greedy(TOK.encode("x"), 1)
        assert c.get("/health").status_code == 200


class _RecordingEngine(FakeEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.detokenize_args: list[bool] = []

    def step(self, detokenize=True):
        self.detokenize_args.append(detokenize)
        return super().step(detokenize)


def test_the_server_steps_the_engine_as_in_production():
    """AsyncEngine calls `step(detokenize=False)` and finds stop strings itself: the fake engine
    is driven the same way as LLMEngine, stop strings included."""
    engine = _RecordingEngine()
    with app_client(engine) as c:
        full = greedy(TOK.encode("x"), 20)
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "temperature": 0,
                                                "stop": [full[5:7]], "stream": stream})
            assert r.status_code == 200
    assert engine.detokenize_args and set(engine.detokenize_args) == {False}


# -- security -------------------------------------------------------------------------------------------
def test_api_key():
    with app_client(api_key="s3cret") as c:
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
        anon = {"Authorization": ""}
        err = assert_error(c.post("/v1/completions", json={"prompt": "x"}, headers=anon), 401,
                           code="invalid_api_key")
        assert "s3cret" not in err["message"]
        bad = {"Authorization": "Bearer s3cres"}
        assert_error(c.get("/v1/models", headers=bad), 401)
        assert_error(c.get("/metrics", headers={"Authorization": "Basic s3cret"}), 401)
        assert c.get("/health", headers=anon).status_code == 200


def test_body_size_limit():
    with app_client(max_body_bytes=1000) as c:
        assert_error(c.post("/v1/completions", json={"prompt": "z" * 2000}), 413,
                     code="request_too_large")

        def chunks():  # no Content-Length: the limit holds while reading
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"z" * 100
            yield b'"}'

        assert_error(c.post("/v1/completions", content=chunks()), 413)
        assert c.post("/v1/completions", json={"prompt": "z" * 100, "max_tokens": 1}).status_code == 200



@pytest.mark.anyio
async def test_client_gone_while_the_body_is_read_is_499_not_an_error(caplog):
    app = create_app(AsyncEngine(FakeEngine()), served_model_name=MODEL)
    incoming = [{"type": "http.request", "body": b'{"prompt": "q', "more_body": True},
                {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "root_path": "",
             "server": ("t", 80), "client": ("c", 1)}
    await app(scope, receive, send)
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"]

# -- load shedding ----------------------------------------------------------------------------------------
class _GatedEngine(FakeEngine):
    """Its steps wait for `gate`, so requests stay waiting as long as the test wants."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()

    def step(self, detokenize=True):
        self.gate.wait(TIMEOUT)
        return super().step(detokenize)


@pytest.mark.anyio
async def test_full_waiting_queue_is_503():
    engine = _GatedEngine()
    ae = AsyncEngine(engine, max_waiting=2)
    app = create_app(ae, served_model_name=MODEL)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=TIMEOUT) as c:
        await ae.wait_ready(TIMEOUT)
        body = {"prompt": "q", "max_tokens": 2}
        first = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
        for _ in range(200):
            if ae.num_waiting == 2:
                break
            await asyncio.sleep(0.01)
        assert ae.num_waiting == 2
        r = await c.post("/v1/completions", json=body)
        assert_error(r, 503, code="server_overloaded", type_="service_unavailable_error")
        assert r.headers["retry-after"] == "1"
        # a stream starts only with its first output: a refusal is still an HTTP status
        r = await c.post("/v1/completions", json={**body, "stream": True})
        assert_error(r, 503, code="server_overloaded")
        engine.gate.set()
        for t in first:
            assert (await asyncio.wait_for(t, TIMEOUT)).status_code == 200
        assert (await c.post("/v1/completions", json=body)).status_code == 200
    await ae.shutdown(TIMEOUT)


# -- metrics --------------------------------------------------------------------------------------------------
def test_metrics(client):
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
    text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    for name in ("jaxinfer_num_requests_running", "jaxinfer_num_requests_waiting",
                 "jaxinfer_kv_pages_used", "jaxinfer_prefix_cache_hit_rate",
                 "jaxinfer_preemptions_total", "jaxinfer_compilations_total"):
        assert name in values, name
    assert values["jaxinfer_compilations_total"] == 3
    assert values["jaxinfer_prefix_cache_hit_rate"] == 0.25
    assert values["jaxinfer_generation_tokens_total"] >= 4
    assert values["jaxinfer_prompt_tokens_total"] >= 3
    assert values["jaxinfer_time_to_first_token_seconds_count"] >= 1
    assert values["jaxinfer_time_per_output_token_seconds_count"] >= 1
    assert values['jaxinfer_requests_total{endpoint="completions",outcome="ok"}'] >= 1
    assert values["jaxinfer_ready"] == 1
