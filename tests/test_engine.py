"""The engine end to end on the tiny Llama: batching invariance, seeds, stops, preemption, errors."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams


def _prompts(n: int, rng: np.random.Generator, vocab: int = 300) -> list[list[int]]:
    lengths = rng.integers(1, 60, size=n)
    return [rng.integers(3, vocab, size=int(L)).tolist() for L in lengths]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batch_equals_alone_greedy(tiny_llm):
    """16 prompts of different lengths in one batch give each prompt's greedy tokens alone."""
    prompts = _prompts(16, np.random.default_rng(0))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = _tokens(tiny_llm.generate(prompts, sp, use_tqdm=False))
    alone = [_tokens(tiny_llm.generate([p], sp, use_tqdm=False))[0] for p in prompts]
    assert batched == alone
    assert all(len(t) == 12 for t in batched)
    assert tiny_llm.engine.scheduler.pool.num_free_pages == tiny_llm.engine.num_pages - 1


def test_seeded_sampling_independent_of_batch(tiny_llm):
    prompts = _prompts(6, np.random.default_rng(1))
    sp = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
          for i in range(len(prompts))]
    batched = _tokens(tiny_llm.generate(prompts, sp, use_tqdm=False))
    alone = [_tokens(tiny_llm.generate([p], [s], use_tqdm=False))[0] for p, s in zip(prompts, sp)]
    assert batched == alone
    again = _tokens(tiny_llm.generate(prompts, sp, use_tqdm=False))
    assert again == batched
    # different seeds give different samples (10 tokens from a random model: collision ~impossible)
    assert len({tuple(t) for t in batched}) > 1


def test_max_tokens_and_finish_reasons(tiny_llm):
    outs = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                             use_tqdm=False)
    c = outs[0].outputs[0]
    assert len(c.token_ids) == 5 and c.finish_reason == "length"
    assert outs[0].finished


def test_stop_token_ids(tiny_llm):
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    toks = _tokens(tiny_llm.generate([[9, 10, 11, 12]], sp, use_tqdm=False))[0]
    stop_at = toks[4]
    first = toks.index(stop_at)
    outs = tiny_llm.generate([[9, 10, 11, 12]],
                             SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                            stop_token_ids=[stop_at]), use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.token_ids == toks[:first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at


def test_stop_string_truncates_text(tiny_llm):
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = tiny_llm.generate(["Hello, world!"], sp, use_tqdm=False)[0].outputs[0].text
    assert len(full) >= 4
    stop = full[2:4]
    out = tiny_llm.generate(["Hello, world!"],
                            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_small_pool_preempts_and_matches_large_pool(tiny_llama_dir, tiny_llm):
    """A pool far too small for the batch: every request finishes, tokens as with a big pool."""
    prompts = _prompts(12, np.random.default_rng(2))
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = _tokens(tiny_llm.generate(prompts, sp, use_tqdm=False))
    # 16 usable pages of 8 tokens = 128 token slots for 12 requests of up to ~84 tokens each
    small = LLM(tiny_llama_dir, num_pages=17, page_size=8, max_num_seqs=16,
                max_num_batched_tokens=64, max_model_len=128)
    got = _tokens(small.generate(prompts, sp, use_tqdm=False))
    assert got == expected
    assert small.engine.metrics.num_preemptions_total > 0
    assert small.engine.scheduler.pool.num_free_pages == small.engine.num_pages - 1


def test_priority_policy_preempts_for_an_urgent_request(tiny_llama_dir, tiny_llm):
    """scheduling_policy="priority": an urgent request arriving at a full batch preempts the least
    urgent running one, which resumes last; everyone's greedy tokens are as without priorities."""
    prompts = _prompts(3, np.random.default_rng(4))
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = _tokens(tiny_llm.generate(prompts, sp, use_tqdm=False))
    llm = LLM(tiny_llama_dir, num_pages=64, page_size=8, max_num_seqs=2, max_num_batched_tokens=64,
              max_model_len=128, scheduling_policy="priority")
    eng = llm.engine
    eng.add_request("low", prompts[0], sp, priority=5)
    eng.add_request("mid", prompts[1], sp, priority=3)
    finished, order = {}, []
    for _ in range(3):
        eng.step()
    eng.add_request("urgent", prompts[2], sp, priority=0)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
                order.append(out.request_id)
    assert order[-1] == "low"  # preempted for "urgent", resumed when a slot freed
    assert eng.metrics.num_preemptions_total == 1
    assert [finished[r] for r in ("low", "mid", "urgent")] == expected
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1


def test_prefix_cache_hit_gives_same_tokens(tiny_llm):
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 300, size=40).tolist()
    prompts = [prefix + rng.integers(3, 300, size=5).tolist() for _ in range(4)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = tiny_llm.engine.metrics.prefix_cache_hit_tokens
    first = _tokens(tiny_llm.generate(prompts[:1], sp, use_tqdm=False))
    rest = _tokens(tiny_llm.generate(prompts, sp, use_tqdm=False))
    assert tiny_llm.engine.metrics.prefix_cache_hit_tokens - before >= 32 * 3
    assert rest[0] == first[0]
    tiny_llm.engine.scheduler.reset_prefix_cache()
    cold = [_tokens(tiny_llm.generate([p], sp, use_tqdm=False))[0] for p in prompts]
    assert rest == cold


@pytest.mark.parametrize("bad", [
    dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0),
    dict(top_k=-5), dict(min_p=2.0), dict(logprobs=50),
])
def test_invalid_sampling_params(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_prompt_too_long_is_value_error_and_engine_keeps_serving(tiny_llm):
    with pytest.raises(ValueError, match="256"):
        tiny_llm.generate([[5] * 300], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_llm.generate([[10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny_llm.generate([[5]], SamplingParams(stop_token_ids=[2**40]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        tiny_llm.generate([[5]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    out = tiny_llm.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0, top_k=2**40),
                            use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("prompt,match", [
    ([5.9, 6.2, 7], "must be integers"), ([5, "6", 7], "must be integers"),
    ([True, False, 7], "must be integers"), ({"prompt": "hi", "x": 1}, "keys"),
])
def test_prompts_that_are_not_token_ids_are_refused(tiny_llm, prompt, match):
    """Token ids are integers: floats, digit strings and bools are refused, not converted."""
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_prompt_forms(tiny_llm):
    """Token ids as a list, a 1-D numpy array or vLLM's {"prompt_token_ids": ids}; a text as a
    str or {"prompt": text}: the same prompt, the same tokens."""
    import numpy as np

    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = tiny_llm.tokenizer.encode("Hello there")
    want = _tokens(tiny_llm.generate([ids], sp, use_tqdm=False))[0]
    for prompt in (np.array(ids), {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}],
                   {"prompt": "Hello there"}, [{"prompt": "Hello there"}]):
        assert _tokens(tiny_llm.generate(prompt, sp, use_tqdm=False))[0] == want, prompt
    assert "".join(tiny_llm.stream({"prompt": "Hello there"}, sp)) == (
        tiny_llm.generate(["Hello there"], sp, use_tqdm=False)[0].outputs[0].text)


@pytest.mark.parametrize("kwargs,match", [
    (dict(priority=None), "priority=None must be an integer"),
    (dict(priority=1.5), "priority=1.5 must be an integer"),
    (dict(background=None), "background=None must be True or False"),
    (dict(params=SamplingParams(n=3)), "n=3"),
])
def test_engine_requests_refused_leave_nothing_behind(tiny_llm, kwargs, match):
    """A request refused for its priority, background flag or n (the engine runs one completion
    a request; LLM.generate fans n out) is not left queued: the next one, with the same id,
    runs, and no page stays in use."""
    eng = tiny_llm.engine
    with pytest.raises(ValueError, match=match):
        eng.add_request("refused", [5, 6, 7], **kwargs)
    assert not eng.has_unfinished_requests()
    eng.add_request("refused", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1


def test_float32_extremes_keep_their_meaning(tiny_llm):
    """A top_p below float32's smallest normal keeps the most likely token (greedy); a temperature
    whose reciprocal float32 cannot hold samples, with min_tokens' EOS ban (-inf logits) and a
    grammar's mask, instead of turning the logits into NaN (token 0 every step)."""
    from jaxinfer.sampling_params import StructuredOutputs

    prompt = [[5, 6, 7]]
    greedy = _tokens(tiny_llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0,
                                                              ignore_eos=True), use_tqdm=False))
    for top_p in (1e-39, 1e-46):
        sp = SamplingParams(max_tokens=6, top_p=top_p, seed=1, ignore_eos=True)
        assert _tokens(tiny_llm.generate(prompt, sp, use_tqdm=False)) == greedy
    hot = SamplingParams(max_tokens=6, temperature=1e39, min_tokens=3, seed=1)
    toks = _tokens(tiny_llm.generate(prompt, hot, use_tqdm=False))[0]
    assert toks[:3] != [0, 0, 0] and len(set(toks)) > 1
    sp = SamplingParams(max_tokens=6, temperature=1e39, seed=1,
                        structured_outputs=StructuredOutputs(regex="[a-z]+"))
    out = tiny_llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert out.text and all("a" <= ch <= "z" for ch in out.text)


def test_logit_bias_keys_are_token_ids():
    assert SamplingParams(logit_bias={"7": 1.0, 8: -1.0}).logit_bias == {7: 1.0, 8: -1.0}
    for key in (float("inf"), 1.7, "1.5", True, "x"):
        with pytest.raises(ValueError, match="logit_bias key"):
            SamplingParams(logit_bias={key: 1.0})


def test_bad_model_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="not a model"):
        LLM(str(junk))


def test_abort_frees_pages(tiny_llm):
    eng = tiny_llm.engine
    eng.add_request("abort-me", [5, 6, 7, 8] * 5, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.scheduler.pool.num_free_pages < eng.num_pages - 1
    eng.abort_request("abort-me")
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1


def test_stream_yields_the_generated_text(tiny_llm):
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    full = tiny_llm.generate(["Once upon a time"], sp, use_tqdm=False)[0].outputs[0].text
    assert "".join(tiny_llm.stream("Once upon a time", sp)) == full


def test_chat_uses_the_template(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "Hello"}],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    ids = tiny_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}],
                                                 add_generation_prompt=True)
    assert out[0].prompt_token_ids == ids
    assert len(out[0].outputs[0].token_ids) == 4


def test_n_completions_per_prompt(tiny_llm):
    sp = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    (out,) = tiny_llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in seqs}) > 1  # different seeds per completion
    (again,) = tiny_llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == seqs
