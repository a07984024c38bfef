"""EngineClient (jaxinfer/engine/client.py): the fake engine of the server tests and LLMEngine both
implement all of it, with the protocol's parameters, so AsyncEngine calls them without probing."""

from __future__ import annotations

import inspect

import pytest

from jaxinfer.engine import EngineClient, LLMEngine
from jaxinfer.sampling_params import SamplingParams
from tests.serve.fake_engine import GREEDY_TEXT, FakeEngine, FakeTokenizer

DATA_MEMBERS = set(EngineClient.__annotations__)  # set by __init__: tokenizer, max_model_len
CLASS_MEMBERS = {name for name in vars(EngineClient)
                 if not name.startswith("_") and name not in DATA_MEMBERS}


def test_members_are_known():
    assert DATA_MEMBERS == {"tokenizer", "max_model_len"}
    assert {"vocab_size", "metrics", "add_request", "abort_request", "finish_request",
            "has_unfinished_requests", "step", "warmup"} <= CLASS_MEMBERS


def test_the_fake_engine_is_an_engine_client():
    assert isinstance(FakeEngine(), EngineClient)


@pytest.mark.parametrize("cls", [FakeEngine, LLMEngine])
def test_methods_take_the_protocols_parameters(cls):
    for name in CLASS_MEMBERS:
        want = getattr(EngineClient, name)
        have = getattr(cls, name)
        if isinstance(want, property):
            assert isinstance(have, property), f"{cls.__name__}.{name}"
            continue
        want_params = list(inspect.signature(want).parameters)
        have_params = list(inspect.signature(have).parameters)
        assert have_params[:len(want_params)] == want_params, f"{cls.__name__}.{name}"


def test_step_without_detokenize_leaves_stop_strings_to_the_caller():
    """As LLMEngine: token-only outputs, no stop-string check; with detokenize the engine stops."""
    prompt = FakeTokenizer().encode("x")
    start = sum(prompt) % len(GREEDY_TEXT)
    stop = (GREEDY_TEXT * 2)[start + 3:start + 5]
    params = SamplingParams(max_tokens=8, temperature=0, stop=[stop])
    for detokenize in (False, True):
        engine = FakeEngine()
        engine.add_request("r", prompt, params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step(detokenize=detokenize)
        last = outs[-1].outputs[0]
        if detokenize:
            assert last.finish_reason == "stop" and last.stop_reason == stop
            assert last.text == (GREEDY_TEXT * 2)[start:start + 3]
        else:
            assert all(o.outputs[0].text == "" for o in outs)
            assert last.finish_reason == "length" and len(last.token_ids) == 8
