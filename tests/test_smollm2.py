"""The real SmolLM2-135M-Instruct GGUF through the engine against transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from jaxinfer import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Q: What is 12 times 7?\nA:",
    "Photosynthesis is the process by which",
    "List three fruits: apple,",
    "In 1969, the first humans",
]


def _hf_greedy(hf, token_ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with transformers' KV cache; EOS is a token like any other
    (`generate(min_new_tokens=...)` would mask EOS instead, which ignore_eos does not do)."""
    _, model = hf
    out = []
    threads = torch.get_num_threads()
    # one thread: these one-token steps are too small to share, and where another process holds
    # a core, torch's threads waiting on each other made them 3x slower
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            r = model(torch.tensor([token_ids]), use_cache=True)
            for _ in range(n):
                nxt = int(r.logits[0, -1].argmax())
                out.append(nxt)
                r = model(torch.tensor([[nxt]]), past_key_values=r.past_key_values, use_cache=True)
    finally:
        torch.set_num_threads(threads)
    return out


def test_greedy_32_tokens_match_transformers(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a primary colour."}],
                                   add_generation_prompt=True)
    prompts = [tok.encode(p) for p in PROMPTS] + [chat]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = smollm2_llm.generate(prompts, sp, use_tqdm=False)  # all in one continuous batch
    mismatches = []
    for ids, out in zip(prompts, outs):
        expected = _hf_greedy(hf_smollm2, ids, 32)
        if out.outputs[0].token_ids != expected:
            mismatches.append((tok.decode(ids), out.outputs[0].text, tok.decode(expected)))
    assert not mismatches, mismatches


def test_tokenizer_matches_transformers(smollm2_llm, hf_smollm2):
    hf_tok, _ = hf_smollm2
    for p in PROMPTS:
        assert smollm2_llm.tokenizer.encode(p) == hf_tok(p)["input_ids"]
    msgs = [{"role": "user", "content": "Hi there"}]
    ours = smollm2_llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    theirs = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
