"""Structured output and tool calling over HTTP on the tiny random Llama (in process): response_format
and vLLM's structured_outputs on chat and completions, 400s naming the field, tool_choice
"required" / named returning tool_calls whose arguments match the schema, a streamed call that
reassembles to the same, and the Hermes-style parser of "auto"."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
from starlette.testclient import TestClient

from jaxinfer.engine.async_engine import AsyncEngine
from serve.app import create_app
from serve.tools import ToolPlan, parse_hermes
from tests.serve.conftest import sse_events, wait_healthy

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "noop", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_llm):
    with contextlib.ExitStack() as stack:
        ae = AsyncEngine(tiny_llm.engine, warmup=False)
        c = stack.enter_context(TestClient(create_app(ae, served_model_name="tiny")))
        wait_healthy(c)
        yield c


def _check(value, schema=SCHEMA):
    try:
        import jsonschema
    except ImportError:
        assert set(value) == set(schema["required"])
    else:
        jsonschema.validate(value, schema)


def test_response_format_json_schema_chat_and_completions(client):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": rf,
                                                   "max_tokens": 100, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    _check(json.loads(choice["message"]["content"]))
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 100,
                                              "response_format": rf, "temperature": 0.9,
                                              "seed": 5})
    assert r.status_code == 200, r.text
    _check(json.loads(r.json()["choices"][0]["text"]))
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 60,
                                              "response_format": {"type": "json_object"}})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"].startswith("{")


def test_structured_outputs_extension(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "temperature": 0,
                                              "structured_outputs": {"regex": r"[A-C]{3}\d"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"[A-C]{3}\d", r.json()["choices"][0]["text"])
    r = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 20,
        "structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert r.json()["choices"][0]["message"]["content"] in ("sunny", "rainy")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_constraints_are_400(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def _tool_body(tool_choice, **kw):
    return {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 150,
            "temperature": 0, **kw}


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(client, tool_choice):
    r = client.post("/v1/chat/completions", json=_tool_body(tool_choice))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            _check(args)
        else:
            assert call["function"]["name"] == "noop" and args == {}
    if isinstance(tool_choice, dict):
        assert [c["function"]["name"] for c in calls] == ["get_weather"]


def _reassemble(events):
    calls, finish = {}, None
    for e in events:
        if not isinstance(e, dict):
            continue
        for ch in e["choices"]:
            finish = ch["finish_reason"] or finish
            for tc in ch["delta"].get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["name"] = fn.get("name") or call["name"]
                call["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_reassembles(client, tool_choice):
    whole = client.post("/v1/chat/completions", json=_tool_body(tool_choice)).json()
    r = client.post("/v1/chat/completions", json=_tool_body(tool_choice, stream=True))
    assert r.status_code == 200
    calls, finish = _reassemble(sse_events(r.text))
    assert finish == "tool_calls"
    expected = whole["choices"][0]["message"]["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected]
    assert all(c["id"] for c in calls)


def test_tool_choice_none_is_plain_text(client):
    r = client.post("/v1/chat/completions", json=_tool_body("none", max_tokens=8))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)


def test_hermes_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 2}}\n</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]
    assert parse_hermes("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])
    assert parse_hermes("plain") == ("plain", [])


def test_auto_stream_holds_back_a_call_and_passes_text():
    from serve.tools import ToolStream

    plan = ToolPlan("auto", tuple(TOOLS))
    s = ToolStream(plan)
    out = [d for piece in ["<tool", "_call>", '{"name": "noop", "arguments": {}}', "</tool_call>"]
           for d in s.feed(piece, False)] + s.feed("", True)
    assert s.num_calls == 1 and out[0]["tool_calls"][0]["function"]["name"] == "noop"
    s = ToolStream(plan)
    assert s.feed("<t", False) == [] and s.feed("hat", False) == [{"content": "<that"}]
    assert s.feed(" more", True) == [{"content": " more"}]


@pytest.mark.parametrize("text", [
    'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n',
    'A <tool_call>{"name": "noop", "arguments": {}}</tool_call> B <tool_call>'
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>.',
    'Text <tool_call>not json</tool_call> and <tool_call>{"name": "noop", "arguments": {}}'
    '</tool_call>',
    'No call here, only a <tool_ mention and <tool_call> never closed',
    'Plain text with trailing space  \n',
    '<tool_call>{"name": "noop"}</tool_call><tool_call>{"name": 5}</tool_call>',
])
def test_auto_stream_adds_up_to_the_non_streamed_answer(text):
    """However the text arrives (one piece, every character alone, random pieces), the streamed
    deltas of "auto" carry the content and the calls of the non-streamed answer: a call after
    some text is a call streamed too, and text that is not a call stays content."""
    import random

    from serve.tools import ToolStream

    plan = ToolPlan("auto", tuple(TOOLS))
    want_content, want_calls = parse_hermes(text)
    rng = random.Random(0)
    cuts = [[len(text)], list(range(1, len(text) + 1))] + [
        sorted(rng.sample(range(1, len(text)), 5)) + [len(text)] for _ in range(20)]
    for ends in cuts:
        s, deltas, last = ToolStream(plan), [], 0
        for i, end in enumerate(ends):
            deltas += s.feed(text[last:end], False)
            last = end
        deltas += s.feed("", True)
        content = "".join(d.get("content", "") for d in deltas)
        calls: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                call = calls.setdefault(c["index"], {"name": None, "arguments": ""})
                if "id" in c:
                    assert c["type"] == "function" and call["name"] is None
                    call["name"] = c["function"]["name"]
                call["arguments"] += c["function"]["arguments"]
        assert sorted(calls) == list(range(len(calls))) and s.num_calls == len(calls)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want_calls]
        assert (content or None) == want_content, ends


def test_past_calls_are_written_as_blocks_where_the_template_ignores_them(tiny_llm):
    """Multi-turn tool use on a template that ignores `tool_calls` (the tiny model's ChatML, as
    SmolLM2's): the assistant turn that called a tool shows the call as the Hermes block the model
    writes, not as an empty turn; a template that renders the calls keeps its own rendering."""
    import asyncio

    from pydantic import TypeAdapter

    from serve.prompts import _with_calls_as_text, chat_prompt
    from serve.schemas import Message

    tok = tiny_llm.engine.tokenizer
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    raw = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [call]},
           {"role": "tool", "tool_call_id": "call_1", "content": "22C and sunny"}]
    msgs = [TypeAdapter(Message).validate_python(m) for m in raw]
    prompt = asyncio.run(chat_prompt(tok, msgs, True, TOOLS, describe_tools=True))
    text = tok.decode(prompt.token_ids, skip_special_tokens=False)
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert turn == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    "</tool_call>")
    assert parse_hermes(turn)[1][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert "22C and sunny" in text.split(turn)[1]

    class RendersCalls:  # a template that writes tool_calls itself
        def render_chat_template(self, conversation, add_generation_prompt):
            return repr(conversation)

    conversation = [m.template_message() for m in msgs]
    assert _with_calls_as_text(RendersCalls(), conversation, True) == conversation


def test_tools_described_when_the_template_ignores_them(tiny_llm):
    import asyncio

    from serve.prompts import chat_prompt
    from serve.schemas import UserMessage

    tok = tiny_llm.engine.tokenizer  # the tiny ChatML template has no tools block
    msgs = [UserMessage(role="user", content="hi")]
    plain = asyncio.run(chat_prompt(tok, msgs, True))
    with_tools = asyncio.run(chat_prompt(tok, msgs, True, TOOLS, describe_tools=True))
    text = tok.decode(with_tools.token_ids, skip_special_tokens=False)
    assert with_tools.token_ids != plain.token_ids
    assert "<tools>" in text and "get_weather" in text and "<tool_call>" in text
