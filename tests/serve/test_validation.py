"""Strict, OpenAI-shaped validation of every JSON route (serve/schemas.py, serve/errors.py): each
bad body is a 400 whose `param` is the exact path of the bad field; values of the right JSON type
pass; requests that can never fit the context are 400s with the numbers; n and best_of have
their documented bounds."""

from __future__ import annotations

import pytest

from serve.schemas import MAX_BEST_OF, MAX_N
from tests.serve.conftest import app_client
from tests.serve.fake_engine import GREEDY_TEXT, FakeTokenizer

TOK = FakeTokenizer()
USER = {"role": "user", "content": "hello"}
CHAT = {"messages": [USER]}
COMPLETION = {"prompt": "hello"}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def client():
    with app_client() as c:
        yield c


def assert_400(r, param, code):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["code"] == code, err
    return err


# -- types are never coerced ------------------------------------------------------------------------
SHARED_BAD_TYPES = [
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"n": 1.5}, "n"),
    ({"n": "2"}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": "1"}, "top_p"),
    ({"seed": "1"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 5]}, "stop.1"),
    ({"stream_options": "x"}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"user": 5}, "user"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"model": 5}, "model"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"top_k": 2.5}, "top_k"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids.0"),
]

CHAT_BAD_TYPES = SHARED_BAD_TYPES + [
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 1.5}, "top_logprobs"),
    ({"max_completion_tokens": "8"}, "max_completion_tokens"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages.0"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages.0.name"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"tool_choice": ["auto"]}, "tool_choice"),
]

COMPLETION_BAD_TYPES = SHARED_BAD_TYPES + [
    ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"best_of": 1.5}, "best_of"),
    ({"suffix": 5}, "suffix"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt.1"),
    ({"prompt": [1.5]}, "prompt.0"),
    ({"prompt": ["a", 1]}, "prompt.1"),
    ({"prompt": [[1], ["a"]]}, "prompt.1.0"),
]


@pytest.mark.parametrize("extra,param", CHAT_BAD_TYPES)
def test_chat_wrong_json_type_is_400_naming_the_field(client, extra, param):
    err = assert_400(client.post("/v1/chat/completions", json={**CHAT, **extra}), param,
                     "invalid_type")
    assert err["message"].startswith(f"Invalid type for '{param}': expected ")


@pytest.mark.parametrize("extra,param", COMPLETION_BAD_TYPES)
def test_completion_wrong_json_type_is_400_naming_the_field(client, extra, param):
    err = assert_400(client.post("/v1/completions", json={**COMPLETION, **extra}), param,
                     "invalid_type")
    assert err["message"].startswith(f"Invalid type for '{param}': expected ")


def test_type_error_says_what_was_expected_and_what_came(client):
    err = assert_400(client.post("/v1/chat/completions", json={**CHAT, "stream": "yes"}),
                     "stream", "invalid_type")
    assert err["message"] == ("Invalid type for 'stream': expected a boolean, but got a string "
                              "instead.")
    err = assert_400(client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2.5}),
                     "max_tokens", "invalid_type")
    assert err["message"] == ("Invalid type for 'max_tokens': expected an integer, but got a "
                              "decimal number instead.")


# -- message shapes (OpenAI's rules by role) --------------------------------------------------------
@pytest.mark.parametrize("messages,param,code", [
    ([], "messages", "invalid_value"),
    ([{"role": "wizard", "content": "x"}], "messages.0.role", "invalid_value"),
    ([{"content": "x"}], "messages.0.role", "missing_required_parameter"),
    ([USER, {"role": 5, "content": "x"}], "messages.1.role", "invalid_value"),
    ([{"role": "user"}], "messages.0.content", "missing_required_parameter"),
    ([{"role": "system"}], "messages.0.content", "missing_required_parameter"),
    ([{"role": "developer"}], "messages.0.content", "missing_required_parameter"),
    ([{"role": "user", "content": []}], "messages.0.content", "invalid_value"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.0.content.0.type", "invalid_value"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text",
     "missing_required_parameter"),
    ([USER, {"role": "assistant"}], "messages.1.content", "invalid_value"),
    ([USER, {"role": "assistant", "content": None}], "messages.1.content", "invalid_value"),
    ([USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}],
     "messages.1.tool_calls.0.function", "missing_required_parameter"),
    ([USER, {"role": "assistant", "tool_calls": []}], "messages.1.tool_calls", "invalid_value"),
    ([USER, {"role": "tool", "content": "42"}], "messages.1.tool_call_id",
     "missing_required_parameter"),
    ([USER, {"role": "tool", "tool_call_id": "c"}], "messages.1.content",
     "missing_required_parameter"),
])
def test_message_shapes(client, messages, param, code):
    err = assert_400(client.post("/v1/chat/completions", json={"messages": messages}), param, code)
    assert f"'{param}'" in err["message"]


def test_unknown_role_lists_the_roles(client):
    err = assert_400(client.post("/v1/chat/completions", json={
        "messages": [{"role": "wizard", "content": "x"}]}), "messages.0.role", "invalid_value")
    for role in ("system", "developer", "user", "assistant", "tool"):
        assert repr(role) in err["message"]


@pytest.mark.parametrize("messages", [
    [{"role": "developer", "content": "be brief"}, USER],
    [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}, USER],
    [USER, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}],
    [USER, {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}, USER],
    [{"role": "user", "content": "x", "name": "ann"}],
])
def test_valid_message_shapes_pass(client, messages):
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


# -- what JSON allows passes --------------------------------------------------------------------------
def test_integral_numbers_are_integers(client):
    """JSON Schema's integer (and OpenAI's): 3.0 is one."""
    body = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 3.0, "n": 2.0,
                                                "temperature": 0}).json()
    assert [len(c["text"]) for c in body["choices"]] == [3, 3]


def test_an_integer_is_a_number(client):
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2, "temperature": 0,
                                             "top_p": 1, "presence_penalty": 0})
    assert r.status_code == 200, r.text


def test_null_means_not_given(client):
    body = {**COMPLETION, "max_tokens": 4, "temperature": 0, "n": None, "stream": None,
            "logprobs": None, "stop": None, "seed": None, "echo": None, "best_of": None,
            "stream_options": None, "user": None}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = TOK.encode(COMPLETION["prompt"])
    want = "".join(GREEDY_TEXT[(sum(ids) + i) % len(GREEDY_TEXT)] for i in range(4))
    assert choice["text"] == want and choice["logprobs"] is None


def test_nan_and_infinity_are_not_json(client):
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        r = client.post("/v1/completions", content=b'{"prompt": "x", "temperature": ' + literal
                        + b"}", headers={"content-type": "application/json"})
        assert_400(r, None, None)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_nested_too_deeply_is_a_400(client, path):
    r = client.post(path, content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert_400(r, None, None)
    assert "nests its arrays or objects too deeply" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200


# -- the other JSON routes ----------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param,code", [
    ("/tokenize", {"prompt": 5}, "prompt", "invalid_type"),
    ("/tokenize", {"messages": [{"role": "x", "content": "y"}]}, "messages.0.role",
     "invalid_value"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": "no"}, "add_generation_prompt",
     "invalid_type"),
    ("/detokenize", {"tokens": ["a"]}, "tokens.0", "invalid_type"),
    ("/detokenize", {"tokens": [1.5]}, "tokens.0", "invalid_type"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0", "invalid_value"),
    ("/detokenize", {}, "tokens", "missing_required_parameter"),
])
def test_tokenize_routes_are_strict_too(client, path, body, param, code):
    assert_400(client.post(path, json=body), param, code)


# -- requests that can never fit ---------------------------------------------------------------------
def test_max_tokens_beyond_the_context_is_400_with_the_numbers(client):
    """The fake engine's context is 256 tokens; its tokenizer is one token per byte."""
    err = assert_400(client.post("/v1/completions", json={"prompt": "y" * 100,
                                                           "max_tokens": 200}),
                     "max_tokens", "context_length_exceeded")
    assert err["message"] == (
        "This model's maximum context length is 256 tokens. However, you requested 300 tokens "
        "(100 in the prompt, 200 in the completion). Please reduce the length of the prompt or "
        "completion.")


def test_chat_max_completion_tokens_beyond_the_context(client):
    n = len(TOK.apply_chat_template([USER], add_generation_prompt=True))
    err = assert_400(client.post("/v1/chat/completions", json={**CHAT,
                                                               "max_completion_tokens": 250}),
                     "max_completion_tokens", "context_length_exceeded")
    assert err["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested {n + 250} "
        f"tokens ({n} in the messages, 250 in the completion). Please reduce the length of the "
        "messages or completion.")
    assert_400(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 250}),
               "max_tokens", "context_length_exceeded")
    fits = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 256 - n})
    assert fits.status_code == 200, fits.text


def test_prompt_alone_beyond_the_context(client):
    err = assert_400(client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "y" * 300}]}), "messages", "context_length_exceeded")
    assert "maximum context length is 256 tokens" in err["message"]
    assert "in the messages" in err["message"]


def test_min_tokens_beyond_the_context_is_400(client):
    """With no max_tokens (chat: up to the context) a min_tokens the context cannot hold could
    never be honoured."""
    n = len(TOK.apply_chat_template([USER], add_generation_prompt=True))
    err = assert_400(client.post("/v1/chat/completions", json={**CHAT, "min_tokens": 300}),
                     "min_tokens", "context_length_exceeded")
    assert err["message"].startswith(
        f"This model's maximum context length is 256 tokens. However, you requested at least "
        f"{n + 300} tokens ({n} in the messages, min_tokens=300 in the completion).")


# -- n and best_of --------------------------------------------------------------------------------------
def test_n_over_the_limit_is_400(client):
    err = assert_400(client.post("/v1/completions", json={**COMPLETION, "n": MAX_N + 1}), "n",
                     "invalid_value")
    assert str(MAX_N) in err["message"]
    assert_400(client.post("/v1/chat/completions", json={**CHAT, "n": MAX_N + 1}), "n",
               "invalid_value")
    assert_400(client.post("/v1/chat/completions", json={**CHAT, "n": 0}), "n", "invalid_value")


def test_best_of_bounds(client):
    err = assert_400(client.post("/v1/completions", json={**COMPLETION, "best_of": MAX_BEST_OF + 1}),
                     "best_of", "invalid_value")
    assert str(MAX_BEST_OF) in err["message"]
    body = client.post("/v1/completions", json={**COMPLETION, "n": 2, "best_of": 2,
                                                "max_tokens": 1}).json()
    assert len(body["choices"]) == 2


def test_choices_beyond_max_waiting_are_400():
    with app_client(max_waiting=4) as c:
        err = assert_400(c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2}), "n",
                         "invalid_value")
        assert "6 completions" in err["message"] and "at most 4" in err["message"]


def test_chat_logprobs_bytes_are_each_tokens_own():
    """A reply whose characters span tokens: each token's `bytes` is its own part of the UTF-8
    (they join into the content's), where the token's text alone is U+FFFD."""
    from types import SimpleNamespace

    from serve.responses import chat_logprobs
    from serve.state import TokenTexts
    from tests.serve.fake_engine import FakeTokenizer

    tok = FakeTokenizer()  # one token a byte
    reply = "é😀"
    ids = tok.encode(reply)
    entries = [SimpleNamespace(token_id=i, logprob=-0.5, top_token_ids=[i], top_logprobs=[-0.5])
               for i in ids]
    content = chat_logprobs(entries, TokenTexts(tok), 1)["content"]
    assert len(content) == 6 and {c["token"] for c in content} == {"\ufffd"}
    assert bytes(b for c in content for b in c["bytes"]) == reply.encode()
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]
