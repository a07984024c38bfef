"""The app over the real engine (the session's tiny random Llama), in process: what the HTTP API
returns must equal what the Python API (`LLM.generate`) gives for the same request."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from jaxinfer import SamplingParams
from jaxinfer.engine import EngineClient
from jaxinfer.engine.async_engine import AsyncEngine
from serve.app import create_app
from tests.serve.conftest import sse_events, wait_healthy

MODEL = "tiny"
PROMPT = "Hello, world!"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def refs(tiny_llm):
    """Reference outputs from the Python API, computed before the server owns the engine."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    chat_ids = tiny_llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (5, 6)]
    long_text = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0,
                                                           ignore_eos=True), use_tqdm=False)
    long_text = long_text[0].outputs[0].text
    stop = long_text[len(long_text) // 2:len(long_text) // 2 + 3]  # completes mid-output
    stopped = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    return {
        "stop": stop,
        "stopped": tiny_llm.generate([PROMPT], stopped, use_tqdm=False)[0],
        "completion": tiny_llm.generate([PROMPT], greedy, use_tqdm=False)[0],
        "scored": tiny_llm.generate([PROMPT], SamplingParams(
            max_tokens=2, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1),
            use_tqdm=False)[0],
        "chat": tiny_llm.generate([chat_ids], greedy, use_tqdm=False)[0],
        "seeded": [o.outputs[0].text for o in tiny_llm.generate([PROMPT, PROMPT], seeded,
                                                                use_tqdm=False)],
    }


@pytest.fixture(scope="module")
def client(tiny_llm, refs):
    engine = tiny_llm.engine
    ae = AsyncEngine(engine, warmup=False)  # owns the engine until the module ends
    with TestClient(create_app(ae, served_model_name=MODEL)) as c:
        wait_healthy(c)
        yield c
    assert not engine.has_unfinished_requests()


def test_llm_engine_is_an_engine_client(tiny_llm):
    assert isinstance(tiny_llm.engine, EngineClient)


def test_completion_equals_python_api(client, refs):
    ref = refs["completion"].outputs[0]
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                "temperature": 0, "ignore_eos": True,
                                                "logprobs": 2}).json()
    choice = body["choices"][0]
    assert choice["text"] == ref.text
    assert body["usage"]["completion_tokens"] == len(ref.token_ids) == 8
    assert body["usage"]["prompt_tokens"] == len(refs["completion"].prompt_token_ids)
    got = choice["logprobs"]["token_logprobs"]
    assert got == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert len(choice["logprobs"]["top_logprobs"]) == len(ref.logprobs) == 8
    for top, e in zip(choice["logprobs"]["top_logprobs"], ref.logprobs):
        # keyed by token text: ids that decode alike (byte pieces -> U+FFFD) share an entry
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(max(e.top_logprobs), abs=1e-5)

    events = sse_events(client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ref.text


def test_echo_logprobs_equal_prompt_logprobs(client, refs):
    """echo + logprobs: the prompt's logprobs are the Python API's `prompt_logprobs`."""
    ref = refs["scored"]
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "echo": True,
                                                "logprobs": 1, "temperature": 0,
                                                "ignore_eos": True}).json()
    lp = body["choices"][0]["logprobs"]
    n = len(ref.prompt_token_ids)
    assert body["choices"][0]["text"] == PROMPT + ref.outputs[0].text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx(
        [e.logprob for e in ref.prompt_logprobs[1:]], abs=1e-5)
    assert lp["token_logprobs"][n:] == pytest.approx(
        [e.logprob for e in ref.outputs[0].logprobs], abs=1e-5)


def test_stop_string_equals_python_api(client, refs):
    """The server detokenizes off the engine thread (AsyncEngine + TextTracker): a stop string
    ends the output at the same text and token count as LLM.generate, streaming or not."""
    ref = refs["stopped"].outputs[0]
    assert ref.finish_reason == "stop" and ref.stop_reason == refs["stop"]
    assert len(ref.token_ids) < 24
    req = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
           "stop": [refs["stop"]]}
    body = client.post("/v1/completions", json=req).json()
    choice = body["choices"][0]
    assert choice["text"] == ref.text
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == refs["stop"]
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    events = sse_events(client.post("/v1/completions", json={**req, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ref.text
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_chat_equals_python_api(client, refs):
    ref = refs["chat"].outputs[0]
    req = {"messages": MESSAGES, "max_completion_tokens": 8, "temperature": 0, "ignore_eos": True,
           "logprobs": True, "top_logprobs": 2}
    body = client.post("/v1/chat/completions", json=req).json()
    assert body["choices"][0]["message"]["content"] == ref.text
    assert body["usage"]["prompt_tokens"] == len(refs["chat"].prompt_token_ids)
    lps = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
    assert lps == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    events = sse_events(client.post("/v1/chat/completions", json={**req, "stream": True}).text)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == ref.text


def test_n_with_seed_equals_seeds_s_and_s_plus_1(client, refs):
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "n": 2,
                                                "seed": 5, "temperature": 1.0,
                                                "ignore_eos": True}).json()
    assert [c["text"] for c in body["choices"]] == refs["seeded"]


def test_prompt_too_long(client):
    r = client.post("/v1/completions", json={"prompt": [5] * 300})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "256" in r.json()["error"]["message"]


def test_tokenize_matches_the_tokenizer(client, tiny_llm):
    ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert ids == tiny_llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert client.post("/detokenize", json={"tokens": tiny_llm.tokenizer.encode(PROMPT)}).json() == {
        "prompt": PROMPT}


def test_metrics_read_from_the_engine(client):
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["jaxinfer_compilations_total"] >= 1
    assert values["jaxinfer_kv_pages_used"] == 0
    assert values["jaxinfer_kv_pages_total"] == 95
    assert values["jaxinfer_num_requests_running"] == 0


@pytest.mark.parametrize("extra,status", [
    ({"top_k": 2**40}, 400),  # beyond int32: the schema's bound
    ({"seed": 2**70}, 400),  # beyond int64 (OpenAI's and vLLM's seed range)
    ({"seed": -5}, 200),
    ({"stop_token_ids": [2**40]}, 400),  # outside the vocabulary: the engine refuses it
    ({"min_tokens": 2**40}, 400),  # beyond int32
    ({"repetition_penalty": 1e30}, 200),
    ({"temperature": 1e-30}, 200),
    ({"top_p": 1e-30}, 200),
    ({"min_p": 1.0}, 200),
    ({"logit_bias": {"5": 100, "6": -100}}, 200),
    ({"presence_penalty": 2, "frequency_penalty": -2}, 200),
    ({"max_tokens": 2**40}, 400),  # beyond the context
    ({"stop": ["a" * 10_000]}, 200),
    ({"n": 3, "seed": 2**32 - 2}, 200),  # seeds 2**32 - 2 .. 2**32: wrap, as seeds do
])
def test_odd_values_never_break_the_batch(client, extra, status):
    """Each request gets the one status OpenAI/vLLM give it; none makes an engine step fail
    (that would fail everyone)."""
    before = _step_errors(client)
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 1.0,
                                             **extra})
    assert r.status_code == status, r.text
    assert _step_errors(client) == before
    if "stop_token_ids" in extra:  # the engine's refusal names the field
        assert r.json()["error"]["param"] == "stop_token_ids"


@pytest.mark.parametrize("extra,status,param", [
    ({"min_tokens": 2**31 - 1}, 400, "min_tokens"),  # no max_tokens: the context cannot hold it
    ({"top_k": 2**31 - 1, "max_tokens": 3}, 200, None),  # top_k >= vocabulary: off
    ({"max_completion_tokens": 2**31 - 1}, 400, "max_completion_tokens"),
])
def test_odd_chat_values_never_break_the_batch(client, extra, status, param):
    before = _step_errors(client)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 1.0,
                                                  **extra})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == param
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert _step_errors(client) == before


def _step_errors(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("jaxinfer_engine_step_errors_total "):
            return float(line.split()[1])
    raise AssertionError("no step error counter")


def test_spec_decode_field_reaches_the_engine(client):
    """The `spec_decode` extension is passed on: this engine has no speculative method, so asking
    for it is a 400 naming the field; asking for no speculation is fine."""
    req = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = client.post("/v1/completions", json={**req, "spec_decode": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "spec_decode"
    assert client.post("/v1/completions", json={**req, "spec_decode": False}).status_code == 200
