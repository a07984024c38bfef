"""Structured output on the tiny random model: constrained greedy / sampled output parses (JSON
schema, regex, choice, grammar), the bitmask enters the step as the matcher computes it, mixed
batches, finishing when the grammar is complete, and no compiles after warm-up."""

import json
import re

import numpy as np
import pytest

from jaxinfer import LLM
from jaxinfer.sampling_params import SamplingParams, StructuredOutputs
from jaxinfer.sched.step_input import make_step_input

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def _check_schema(value, schema=SCHEMA):
    try:
        import jsonschema
    except ImportError:
        assert set(value) == set(schema["required"])
        assert isinstance(value["name"], str) and isinstance(value["age"], int)
        assert isinstance(value["ok"], bool)
    else:
        jsonschema.validate(value, schema)


def _gen(llm, prompts, sps):
    return [o.outputs[0] for o in llm.generate(prompts, sps, use_tqdm=False)]


def test_structured_outputs_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_invalid_constraint_refused(tiny_llm):
    with pytest.raises(ValueError, match="structured_outputs.json"):
        _gen(tiny_llm, ["x"], SamplingParams(structured_outputs=StructuredOutputs(
            json={"type": "objec"})))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        _gen(tiny_llm, ["x"], SamplingParams(structured_outputs=StructuredOutputs(regex="(a")))
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses(tiny_llm, temperature):
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=200, top_k=50, top_p=0.9,
                        logprobs=2, structured_outputs=StructuredOutputs(json=SCHEMA))
    for out in _gen(tiny_llm, ["The quick brown fox", "Hello"], [sp, sp]):
        assert out.finish_reason == "stop", out.text
        _check_schema(json.loads(out.text))
        assert len(out.logprobs) == len(out.token_ids)


def test_regex_choice_grammar(tiny_llm):
    regex = r"[a-z]{2,5}-\d{3}"
    choices = ["yes", "no", "maybe later"]
    grammar = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'
    sps = [SamplingParams(temperature=0.0, max_tokens=40,
                          structured_outputs=StructuredOutputs(regex=regex)),
           SamplingParams(temperature=0.8, seed=1, max_tokens=40,
                          structured_outputs=StructuredOutputs(choice=choices)),
           SamplingParams(temperature=0.0, max_tokens=40,
                          structured_outputs=StructuredOutputs(grammar=grammar)),
           SamplingParams(temperature=0.0, max_tokens=40,
                          structured_outputs=StructuredOutputs(json_object=True))]
    outs = _gen(tiny_llm, ["Once upon a time"] * 4, sps)
    assert re.fullmatch(regex, outs[0].text), outs[0].text
    assert outs[1].text in choices
    if outs[2].finish_reason == "stop":
        assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", outs[2].text), outs[2].text
    else:  # a random model may go on adding terms until max_tokens: a valid prefix
        assert re.fullmatch(r"\(\d{1,2}(\+\d{0,2})*", outs[2].text), outs[2].text
    if outs[3].finish_reason == "stop":
        assert isinstance(json.loads(outs[3].text), dict)
    else:
        assert outs[3].text.startswith("{")
    for o in (outs[0], outs[1]):
        assert o.finish_reason == "stop"


def test_mixed_batch_leaves_unconstrained_rows_alone(tiny_llm):
    prompts = ["The quick brown fox", "Hello, world", "JAX is"]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = _gen(tiny_llm, prompts, [free] * 3)
    constrained = SamplingParams(temperature=0.0, max_tokens=200,
                                 structured_outputs=StructuredOutputs(json=SCHEMA))
    mixed = _gen(tiny_llm, prompts, [free, constrained, free])
    assert mixed[0].token_ids == alone[0].token_ids
    assert mixed[2].token_ids == alone[2].token_ids
    _check_schema(json.loads(mixed[1].text))


def test_bitmask_enters_the_step_as_the_matcher_computes_it(tiny_llm):
    engine = tiny_llm.engine
    so = StructuredOutputs(regex=r"[0-9]+x")
    sp = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so)
    engine.add_request("bm-a", "Hello", SamplingParams(temperature=0.0, max_tokens=8))
    engine.add_request("bm-b", "Hello", sp)
    try:
        sched_out = engine.scheduler.schedule()
        si = make_step_input(sched_out, engine.engine_config, engine.max_model_len,
                             buckets=engine.buckets, bitmask_words=engine.bitmask_words)
        reference = engine.grammars.request_grammar(so).bitmask()  # i32[W]
        words = -(-engine.vocab_size // 32)
        assert si.allowed_token_bitmask.shape == (si.seeds.shape[0], words)
        rows = {it.request.request_id: r for r, it in enumerate(sched_out.scheduled)}
        np.testing.assert_array_equal(si.allowed_token_bitmask[rows["bm-b"]], reference)
        assert (si.allowed_token_bitmask[rows["bm-a"]] == -1).all()
        assert (si.allowed_token_bitmask[len(rows):] == -1).all()  # padding rows
        buf, layout = si.pack()
        assert "allowed_token_bitmask" in [f[0] for f in layout]
        allowed = {t for t in range(engine.vocab_size) if reference[t // 32] >> (t % 32) & 1}
        digits = {t for t in allowed if engine.tokenizer.decode([t]).isdigit()}
        assert allowed and allowed == digits
    finally:
        engine.abort_request("bm-a")
        engine.abort_request("bm-b")
    # a step with no constrained request carries an all-ones mask in the same layout (one
    # executable for both); without words to give (no structured output), none
    for rid in ("bm-c", "bm-d"):  # the constrained step's shape: two prompts of "Hello"
        engine.add_request(rid, "Hello", SamplingParams(temperature=0.0, max_tokens=8))
    try:
        sched_out = engine.scheduler.schedule()
        free = make_step_input(sched_out, engine.engine_config, engine.max_model_len,
                               buckets=engine.buckets, bitmask_words=engine.bitmask_words)
        assert free.shape == si.shape
        assert free.allowed_token_bitmask.shape == si.allowed_token_bitmask.shape
        assert (free.allowed_token_bitmask == -1).all()
        assert free.pack()[1] == si.pack()[1]
        bare = make_step_input(sched_out, engine.engine_config, engine.max_model_len,
                               buckets=engine.buckets)
        assert bare.allowed_token_bitmask is None
    finally:
        engine.abort_request("bm-c")
        engine.abort_request("bm-d")


def test_no_compiles_after_warmup(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, warmup=True, num_pages=24, page_size=8, max_num_seqs=4,
              max_num_batched_tokens=16, max_model_len=64)
    n = llm.engine.metrics.num_compilations
    free = SamplingParams(temperature=0.7, seed=0, max_tokens=6)
    constrained = SamplingParams(temperature=0.0, max_tokens=30,
                                 structured_outputs=StructuredOutputs(choice=["alpha", "beta"]))
    _gen(llm, ["Hello"], [free])
    outs = _gen(llm, ["Hello", "The quick brown fox jumps over", "JAX"], [constrained, free,
                                                                         constrained])
    assert outs[0].text in ("alpha", "beta") and outs[2].text in ("alpha", "beta")
    _gen(llm, ["Hello"] * 4, [constrained] * 4)
    assert llm.engine.metrics.num_compilations == n
    assert llm.engine.grammars.num_compiled == 1  # one constraint, compiled once


def test_constrained_requests_speculate_with_ngram(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_pages=48, page_size=8, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=128, speculative_method="ngram", num_speculative_tokens=2)
    engine = llm.engine
    so = StructuredOutputs(regex=r"(ab){1,20}c")
    engine.add_request("c", "ab ab ab ab ab", SamplingParams(temperature=0.0, max_tokens=40,
                                                             structured_outputs=so))
    engine.add_request("f", "ab ab ab ab ab", SamplingParams(temperature=0.0, max_tokens=10))
    assert engine.scheduler.get_request("c").spec_enabled  # drafts cut to what the grammar accepts
    assert engine.scheduler.get_request("f").spec_enabled
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert re.fullmatch(r"(ab){1,20}c", outs["c"].outputs[0].text), outs["c"].outputs[0].text
