"""ModelConfig from HF config.json dicts and GGUF metadata; EngineConfig validation."""

import dataclasses
import json
import os
import re

import pytest

from jaxinfer.config import EngineConfig, ModelConfig, RopeScaling
from jaxinfer.models.gguf_file import read_model_config
from jaxinfer.models.loader import CONFIGS_DIR, load_model_config

LLAMA3_SCALING = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192)


def hf_dict(name):
    with open(CONFIGS_DIR / f"{name}.json") as f:
        return json.load(f)


def test_llama_3_1_8b():
    c = load_model_config("llama-3.1-8b")
    assert c == ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, max_position_embeddings=131072,
        tie_word_embeddings=False, attention_bias=False, sliding_window=None,
        bos_token_id=128000, eos_token_ids=(128001,))
    assert c.num_queries_per_kv == 4
    hash(c)  # static argument to jit


def test_llama_3_2_1b():
    c = ModelConfig.from_hf_dict(hf_dict("llama-3.2-1b"))
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.head_dim) == (16, 2048, 8192, 64)
    assert c.tie_word_embeddings and c.rope_scaling == dataclasses.replace(LLAMA3_SCALING, factor=32.0)


def test_transformers_5_rope_parameters_layout():
    d = hf_dict("llama-3.1-8b")
    d["rope_parameters"] = {**d.pop("rope_scaling"), "rope_theta": d.pop("rope_theta")}
    assert ModelConfig.from_hf_dict(d) == load_model_config("llama-3.1-8b")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_scaling is None and c.rope_theta == 1234.0


def test_linear_rope_scaling_and_refused_kinds():
    d = hf_dict("llama-3.1-8b")
    d["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf_dict(d).rope_scaling.rope_type == "linear"
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict(d)


def test_mistral_and_qwen2_flags():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    mistral = ModelConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"],
                                        "sliding_window": 4096})
    assert mistral.architecture == "mistral" and mistral.sliding_window == 4096
    assert not mistral.attention_bias
    qwen = ModelConfig.from_hf_dict({**base, "architectures": ["Qwen2ForCausalLM"],
                                     "use_sliding_window": False, "sliding_window": 4096,
                                     "tie_word_embeddings": True, "eos_token_id": [5, 6]})
    assert qwen.attention_bias and qwen.sliding_window is None and qwen.tie_word_embeddings
    assert qwen.eos_token_ids == (5, 6)
    with pytest.raises(ValueError, match="sliding window on only some layers"):
        ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "use_sliding_window": True,
                                  "sliding_window": 8,
                                  "layer_types": ["full_attention", "sliding_attention"]})


def test_errors_name_the_problem():
    d = hf_dict("llama-3.2-1b")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict({**d, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    del d["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_dict(d)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**hf_dict("llama-3.2-1b"), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(load_model_config("llama-3.2-1b"), num_kv_heads=5)
    with pytest.raises(ValueError, match="architecture"):
        dataclasses.replace(load_model_config("llama-3.2-1b"), architecture="gpt2")


def test_from_hf_dir(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_dict("llama-3.2-1b")))
    assert ModelConfig.from_hf_dir(tmp_path) == load_model_config("llama-3.2-1b")


def test_from_gguf_tiny(tmp_path):
    from tests.tiny_models import save_tiny_gguf, save_tiny_model

    hf_dir = save_tiny_model("qwen2", tmp_path / "hf", with_tokenizer=False)
    c = read_model_config(save_tiny_gguf(hf_dir, tmp_path / "q.gguf"))
    assert c.architecture == "qwen2" and c.attention_bias and c.tie_word_embeddings
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert c.vocab_size == 384 and c.bos_token_id == 1 and c.eos_token_ids == (2,)


def test_from_gguf_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_model_config(tmp_path / "x.gguf")


@pytest.mark.slow
def test_from_gguf_smollm2():
    from jaxinfer.models.loader import resolve_model_path

    c = read_model_config(resolve_model_path("smollm2-135m"))
    assert c == ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=c.rms_norm_eps,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        attention_bias=False, bos_token_id=1, eos_token_ids=(2,))
    assert c.rms_norm_eps == pytest.approx(1e-5)


def test_engine_config_validation():
    EngineConfig()
    for bad in (dict(page_size=12), dict(num_pages=1), dict(dtype="int8"),
                dict(attention_backend="cuda"), dict(load_format="pickle")):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            EngineConfig(**bad)


def test_configs_models_files_exist():
    assert {"llama-3.1-8b.json", "llama-3.2-1b.json"} <= set(os.listdir(CONFIGS_DIR))


@pytest.mark.parametrize("bad,message", [
    (dict(num_pages=2.5), "num_pages=2.5 must be an integer or None"),
    (dict(max_model_len=100.5), "max_model_len=100.5 must be an integer or None"),
    (dict(max_num_seqs="4"), "max_num_seqs='4' must be an integer"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens=True must be an integer"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching='no' must be True or False"),
    (dict(background_linger_s=float("nan")), "background_linger_s=nan must be a finite number"),
    (dict(kv_memory_fraction="0.5"), "kv_memory_fraction='0.5' must be a finite number or None"),
    (dict(draft_model=5), "draft_model=5 must be a string or None"),
])
def test_engine_config_fields_of_the_wrong_type_are_named(bad, message):
    """A value of the wrong type is refused naming the field, before it can fail deep in the
    engine's build (2.5 pages) or pass as something else ("no" is truthy)."""
    from jaxinfer.config import EngineConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**bad)


def test_engine_config_numbers_of_any_integral_or_real_kind_pass():
    import numpy as np

    from jaxinfer.config import EngineConfig

    ec = EngineConfig(num_pages=np.int64(64), kv_memory_fraction=1, background_linger_s=0)
    assert ec.num_pages == 64 and ec.kv_memory_fraction == 1
