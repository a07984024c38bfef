"""The engine with the Pallas attention kernel (interpret mode on the CPU) against the XLA path."""

from __future__ import annotations

import warnings

import numpy as np

from jaxinfer import LLM, SamplingParams


def test_pallas_backend_same_greedy_tokens_as_xla(tiny_llama_dir, tiny_llm):
    rng = np.random.default_rng(11)
    # mixed lengths: a prompt longer than the token budget is prefilled in chunks
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in (1, 7, 19, 45)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, sp, use_tqdm=False)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a silent fallback to XLA would make this test vacuous
        llm = LLM(tiny_llama_dir, attention_backend="pallas", num_pages=48, page_size=8,
                  max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert llm.engine.runner.attention_backend == "pallas"
    assert got == expected
