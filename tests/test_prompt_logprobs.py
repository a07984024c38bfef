"""SamplingParams.prompt_logprobs on the tiny Llama: each prompt token's logprob (and top-k) equal
transformers' log-softmax over the same prompt, across prefill chunks, in a mixed batch, after a
prefix-cache hit and through preemption."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32).eval()


def _reference(hf_model, prompt: list[int]) -> np.ndarray:
    """f32[P-1, V]: log-softmax of the logits at positions 0..P-2 (scoring tokens 1..P-1)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check(entries, prompt: list[int], ref: np.ndarray, k: int) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for i, e in enumerate(entries[1:]):
        assert e.token_id == prompt[i + 1]
        np.testing.assert_allclose(e.logprob, ref[i, prompt[i + 1]], atol=2e-4, err_msg=f"{i=}")
        assert len(e.top_token_ids) == k
        np.testing.assert_allclose(e.top_logprobs, np.sort(ref[i])[::-1][:k], atol=2e-4)
        # ties aside, the ids are the reference's best
        assert ref[i, e.top_token_ids].tolist() == pytest.approx(e.top_logprobs, abs=2e-4)


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 300, size=n).tolist()


def test_prompt_logprobs_across_chunks_match_transformers(tiny_llm, hf_tiny):
    """A 150-token prompt is prefilled in 3 chunks (64-token budget), beside other requests."""
    rng = np.random.default_rng(11)
    long_prompt, short_prompt = _prompt(rng, 150), _prompt(rng, 9)
    others = [_prompt(rng, int(n)) for n in (30, 70)]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True)
    outs = tiny_llm.generate([long_prompt, others[0], short_prompt, others[1]],
                             [sp, plain, sp, plain], use_tqdm=False)
    for out, prompt in ((outs[0], long_prompt), (outs[2], short_prompt)):
        _check(out.prompt_logprobs, prompt, _reference(hf_tiny, prompt), 3)
    assert outs[1].prompt_logprobs is None and outs[3].prompt_logprobs is None
    # asking for prompt logprobs changes nothing else
    alone = tiny_llm.generate([long_prompt, others[0]],
                              [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), plain],
                              use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == alone[1].outputs[0].token_ids


def test_prompt_logprobs_after_a_prefix_cache_hit(tiny_llm, hf_tiny):
    """A cached prefix is recomputed for scoring: the logprobs are complete and the same; a
    request without prompt logprobs still hits the cache."""
    rng = np.random.default_rng(12)
    prompt = _prompt(rng, 45)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    tiny_llm.generate([prompt], greedy, use_tqdm=False)  # caches the prompt's full pages
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)
    (out,) = tiny_llm.generate([prompt], sp, use_tqdm=False)
    _check(out.prompt_logprobs, prompt, _reference(hf_tiny, prompt), 0)
    before = tiny_llm.engine.metrics.prefix_cache_hit_tokens
    tiny_llm.generate([prompt], greedy, use_tqdm=False)
    assert tiny_llm.engine.metrics.prefix_cache_hit_tokens - before == 40


def test_prompt_logprobs_of_a_one_token_prompt(tiny_llm):
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    (out,) = tiny_llm.generate([[17]], sp, use_tqdm=False)
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_survive_preemption(tiny_llama_dir, hf_tiny):
    """A pool too small for the batch: requests are preempted mid-prompt and after it; each
    prompt is scored once, completely, as transformers does."""
    rng = np.random.default_rng(13)
    prompts = [_prompt(rng, int(n)) for n in rng.integers(20, 60, size=8)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=1)
    small = LLM(tiny_llama_dir, num_pages=17, page_size=8, max_num_seqs=16,
                max_num_batched_tokens=32, max_model_len=128)
    outs = small.generate(prompts, sp, use_tqdm=False)
    assert small.engine.metrics.num_preemptions_total > 0
    for out, prompt in zip(outs, prompts):
        _check(out.prompt_logprobs, prompt, _reference(hf_tiny, prompt), 1)
    assert small.engine.scheduler.pool.num_free_pages == small.engine.num_pages - 1


@pytest.mark.parametrize("bad", [-1, 21, 1.5])
def test_invalid_prompt_logprobs(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
