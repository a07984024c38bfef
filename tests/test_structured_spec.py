"""Structured output with n-gram speculation on the tiny random Llama: drafts are cut to what the
grammar accepts, each verified position gets the mask after the drafts before it, greedy output is
token-identical to decoding without speculation (JSON schema, regex, mixed batches), so is seeded
sampled output (and it stays grammar-valid), and warm-up compiles every layout constrained verification takes."""

import dataclasses
import json
import re

import numpy as np
import pytest

from jaxinfer import LLM
from jaxinfer.sampling_params import SamplingParams, StructuredOutputs
from jaxinfer.sched.step_input import make_step_input, warmup_step_inputs
from jaxinfer.structured import bitmask_words
from tests.test_structured_output import SCHEMA, _check_schema

REGEX = r"(ab|cd){2,12}x"
# n-gram food: the prompts hold text of the shape the grammar forces
JSON_PROMPTS = ['{"name": "ab", "age": 12, "ok": true} {"name": "cd", "age": 7, "ok": false} ',
                'Reply in JSON: {"name": "x", "age": 3, "ok": true}',
                '{"name": "', 'ok ok ok {"age": 1']
REGEX_PROMPTS = ["abababcdcdabx abcdx ab", "cdcdcdcd abab x", "x y z abab"]


@pytest.fixture(scope="module")
def ngram_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_pages=128, page_size=8, max_num_seqs=8,
               max_num_batched_tokens=256, max_model_len=160, enable_prefix_caching=False,
               speculative_method="ngram", ngram_min=1, ngram_max=3, num_speculative_tokens=3)


def _run(llm, prompts, sps):
    """Outputs, and the drafts verified and accepted meanwhile."""
    m0 = llm.engine.metrics
    outs = [o.outputs[0] for o in llm.generate(prompts, sps, use_tqdm=False)]
    m1 = llm.engine.metrics
    return (outs, m1.num_draft_tokens_total - m0.num_draft_tokens_total,
            m1.num_accepted_tokens_total - m0.num_accepted_tokens_total)


def _grammar(engine, regex):
    return engine.grammars.request_grammar(StructuredOutputs(regex=regex))


def test_drafts_cut_and_masks_per_position(ngram_llm):
    engine = ngram_llm.engine
    tok = engine.tokenizer.hf_tokenizer
    g = _grammar(engine, REGEX)
    start = g.bitmask()
    ab, cd, x = (tok.encode(s, add_special_tokens=False) for s in ("ab", "cd", "x"))
    good = ab + cd + ab
    assert g.num_valid_drafts(good + tok.encode("zz", add_special_tokens=False)) == len(good)
    assert g.num_valid_drafts(tok.encode("zz", add_special_tokens=False)) == 0
    assert g.num_valid_drafts([]) == 0
    done = ab + cd + x  # complete: drafts after it would be wasted (EOS included)
    assert g.num_valid_drafts(done + ab) == len(done)
    assert g.num_valid_drafts(done + list(engine.tokenizer.eos_token_ids)) == len(done)
    np.testing.assert_array_equal(g.bitmask(), start)  # the matcher did not move
    rows = np.zeros((len(good) + 1, g.num_words), np.int32)
    g.fill_draft_bitmasks(rows, good)
    np.testing.assert_array_equal(g.bitmask(), start)
    ref = _grammar(engine, REGEX)
    for j in range(len(good) + 1):  # row j: the mask after the drafts before j
        np.testing.assert_array_equal(rows[j], ref.bitmask())
        if j < len(good):
            assert not ref.advance(good[j])


def test_step_input_rows_get_the_masks_after_the_drafts_before_them(ngram_llm):
    engine = ngram_llm.engine
    tok = engine.tokenizer.hf_tokenizer
    so = StructuredOutputs(regex=REGEX)
    engine.add_request("sv-c", "abab", SamplingParams(temperature=0.0, max_tokens=20,
                                                       structured_outputs=so))
    engine.add_request("sv-f", "abab", SamplingParams(temperature=0.0, max_tokens=20))
    try:
        engine.step()  # the prefills (drafts for the next step are proposed now)
        g = engine.scheduler.get_request("sv-c").grammar
        candidates = [tok.encode(s, add_special_tokens=False) for s in ("cdab", "bcdab", "dabcd")]
        drafts = max((c[:g.num_valid_drafts(c)] for c in candidates), key=len)[:3]
        assert len(drafts) >= 2
        for rid in ("sv-c", "sv-f"):
            engine.scheduler.get_request(rid).spec_token_ids = list(drafts)
        sched_out = engine.scheduler.schedule()
        si = make_step_input(sched_out, engine.engine_config, engine.max_model_len,
                             buckets=engine.buckets)
        req = engine.scheduler.get_request("sv-c")
        ref = _grammar(engine, REGEX)
        for t in req.output_token_ids:
            assert not ref.advance(t)
        row = 0
        for item in sched_out.scheduled:
            n = item.num_rows
            assert n == 1 + len(drafts)
            block = si.allowed_token_bitmask[row:row + n]
            if item.request.request_id == "sv-f":
                assert (block == -1).all()
            else:
                for j in range(n):
                    np.testing.assert_array_equal(block[j], ref.bitmask())
                    if j < len(drafts):
                        ref.advance(drafts[j])
            row += n
        assert (si.allowed_token_bitmask[row:] == -1).all()
        assert si.spec_row_ids is not None
    finally:
        engine.abort_request("sv-c")
        engine.abort_request("sv-f")


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_greedy_identical_with_and_without_speculation(ngram_llm, kind):
    if kind == "json":
        prompts, so, check = JSON_PROMPTS, StructuredOutputs(json=SCHEMA), \
            lambda text: _check_schema(json.loads(text))
    else:
        prompts, so = REGEX_PROMPTS, StructuredOutputs(regex=REGEX)

        def check(text):
            assert re.fullmatch(REGEX, text), text
    base = {"temperature": 0.0, "max_tokens": 120, "structured_outputs": so}
    off, num_off, _ = _run(ngram_llm, prompts,
                           [SamplingParams(**base, spec_decode=False)] * len(prompts))
    on, num_draft, num_accepted = _run(ngram_llm, prompts, [SamplingParams(**base)] * len(prompts))
    assert num_off == 0 and num_draft > 0 and num_accepted > 0, (num_draft, num_accepted)
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason == "stop", a.text
        check(a.text)


def test_sampled_with_speculation_same_tokens_and_valid(ngram_llm):
    """Seeded sampling: a verified row keeps its own draw from the masked distribution, so the
    tokens are those of constrained decoding without speculation, and valid."""
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, top_p=0.95,
                          structured_outputs=StructuredOutputs(json=SCHEMA)) for s in range(4)]
    sps += [SamplingParams(temperature=0.8, seed=s, max_tokens=60,
                           structured_outputs=StructuredOutputs(regex=REGEX)) for s in range(3)]
    off, _, _ = _run(ngram_llm, JSON_PROMPTS + REGEX_PROMPTS,
                     [dataclasses.replace(sp, spec_decode=False) for sp in sps])
    outs, num_draft, _ = _run(ngram_llm, JSON_PROMPTS + REGEX_PROMPTS, sps)
    assert num_draft > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    for out in outs[:4]:
        assert out.finish_reason == "stop", out.text
        _check_schema(json.loads(out.text))
    for out in outs[4:]:
        if out.finish_reason == "stop":
            assert re.fullmatch(REGEX, out.text), out.text
        else:  # max_tokens: a valid prefix
            assert re.fullmatch(r"(ab|cd)*(a|c)?", out.text), out.text


def test_mixed_batch_same_greedy_tokens(ngram_llm):
    prompts = [JSON_PROMPTS[0], REGEX_PROMPTS[0], "ab ab ab ab ab ab", JSON_PROMPTS[1]]
    sps = [SamplingParams(temperature=0.0, max_tokens=120,
                          structured_outputs=StructuredOutputs(json=SCHEMA)),
           SamplingParams(temperature=0.0, max_tokens=60,
                          structured_outputs=StructuredOutputs(regex=REGEX)),
           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    off, _, _ = _run(ngram_llm, prompts,
                     [dataclasses.replace(sp, spec_decode=False) for sp in sps])
    on, num_draft, _ = _run(ngram_llm, prompts, sps)
    assert num_draft > 0
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    _check_schema(json.loads(on[0].text))
    assert re.fullmatch(REGEX, on[1].text), on[1].text


def test_warmup_covers_constrained_verifying_layouts(ngram_llm, monkeypatch):
    """Every step layout of constrained requests speculating beside free ones is one warm-up
    compiles (the masked verifying layouts), so no step compiles after warm-up."""
    engine = ngram_llm.engine
    warm = {si.pack()[1] for si in warmup_step_inputs(
        engine.engine_config, engine.max_model_len, buckets=engine.buckets,
        bitmask_words=bitmask_words(engine.vocab_size))}
    seen = []
    dispatch = engine.runner.dispatch

    def recording(si):
        seen.append(si.pack()[1])
        return dispatch(si)

    monkeypatch.setattr(engine.runner, "dispatch", recording)
    so = StructuredOutputs(regex=REGEX)
    _, num_draft, _ = _run(ngram_llm, REGEX_PROMPTS + [JSON_PROMPTS[0]],
                           [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so),
                            SamplingParams(temperature=0.7, seed=0, max_tokens=40,
                                           structured_outputs=so),
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            SamplingParams(temperature=0.0, max_tokens=60,
                                           structured_outputs=StructuredOutputs(json=SCHEMA))])
    assert num_draft > 0
    names = [{f.name for f in layout} for layout in seen]
    assert any({"allowed_token_bitmask", "spec_row_ids"} <= n for n in names)
    assert set(seen) <= warm, set(seen) - warm


def test_no_compiles_after_warmup_when_constrained_requests_speculate(tiny_llama_dir):
    """The compile counter, end to end, on the smallest speculating engine (one sequence, few
    buckets: warm-up is the test's cost). Its speculation budget is set, not calibrated from
    timed steps, so a loaded machine cannot talk it out of drafting."""
    llm = LLM(tiny_llama_dir, warmup=True, num_pages=8, page_size=8, max_num_seqs=1,
              max_num_batched_tokens=4, max_model_len=24, speculative_method="ngram",
              num_speculative_tokens=2, ngram_min=1, ngram_max=3, spec_max_batched_tokens=4)
    n = llm.engine.metrics.num_compilations
    so = StructuredOutputs(regex=r"(ab|cd){2,8}x")
    for sp in [SamplingParams(temperature=0.0, max_tokens=14, structured_outputs=so),
               SamplingParams(temperature=0.7, seed=0, max_tokens=14, structured_outputs=so)]:
        _, num_draft, _ = _run(llm, ["abab"], [sp])
        assert num_draft > 0
    assert llm.engine.metrics.num_compilations == n


def test_draft_model_engines_give_constrained_requests_no_drafts(tiny_llama_dir):
    """A draft model samples its drafts on the device from an unmasked q: constrained requests
    do not speculate there (runtime/spec_decode.py says why)."""
    llm = LLM(tiny_llama_dir, num_pages=24, page_size=8, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, speculative_method="draft", draft_model=tiny_llama_dir)
    engine = llm.engine
    engine.add_request("d-c", "ab", SamplingParams(structured_outputs=StructuredOutputs(regex="a")))
    engine.add_request("d-f", "ab", SamplingParams())
    try:
        assert not engine.scheduler.get_request("d-c").spec_enabled
        assert engine.scheduler.get_request("d-f").spec_enabled
    finally:
        engine.abort_request("d-c")
        engine.abort_request("d-f")
