"""Tiny random HF checkpoints (Llama / Mistral / Qwen2, float32, safetensors) for tests.

    path = save_tiny_model("llama", tmp_path / "llama")          # config.json, model.safetensors,
    path = save_tiny_model("mistral", d, sliding_window=6)        # tokenizer files (ChatML template)
    gguf = save_tiny_gguf(path, tmp_path / "llama.gguf", "Q8_0")  # the same weights as llama.cpp's
                                                                  # converter would write them
    wide = save_tiny_model("llama", d, hidden_size=256, intermediate_size=512)
    gguf = save_tiny_gguf(wide, tmp_path / "k.gguf", "Q4_K")      # K-quant rows: 256-value blocks
The tokenizer is a byte-level BPE trained on a few sentences (TINY_TOKENIZER_VOCAB tokens, ids
0/1/2 = <|endoftext|>/<|im_start|>/<|im_end|>, bos=1, eos=2), so any text encodes. The models use
vocab_size TINY_VOCAB >= that, so every token id is valid. Needs torch + transformers (test-only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tests import kquants

TINY_VOCAB = 384
TINY_TOKENIZER_VOCAB = 320
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "JAX is a library for array computing and program transformation.",
    "Paged attention keeps the KV cache in fixed-size pages.",
    "Once upon a time there was a tiny language model that could count: 1, 2, 3, 4, 5.",
    "def main():\n    print('hello')\n",
]

_BASE = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)
ARCH_DEFAULTS = {
    "llama": dict(rope_theta=10000.0),
    "mistral": dict(rope_theta=10000.0, sliding_window=6),
    "qwen2": dict(rope_theta=10000.0, tie_word_embeddings=True),  # Qwen2: q/k/v carry biases
}


def tiny_hf_config(arch: str, **overrides):
    """A transformers config of a tiny model of `arch` ("llama" | "mistral" | "qwen2")."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[arch]
    kwargs = {**_BASE, **ARCH_DEFAULTS[arch], **overrides}
    rope_theta = kwargs.pop("rope_theta")
    rope = {"rope_type": "default", "rope_theta": rope_theta, **kwargs.pop("rope_parameters", {})}
    config = cls(**kwargs, rope_parameters=rope)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


def make_tokenizer():
    """A transformers PreTrainedTokenizerFast (byte-level BPE, ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def save_tiny_model(arch: str, path: str | os.PathLike, *, seed: int = 0,
                    with_tokenizer: bool = True, **overrides) -> str:
    """Build a random float32 HF model of `arch` and save it as a safetensors checkpoint dir."""
    import torch
    import transformers

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    cls = getattr(transformers, config.architectures[0])
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():  # HF starts norms at 1 and biases at 0: make them matter in comparisons
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(0.2 * torch.randn_like(param))
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        make_tokenizer().save_pretrained(path)
    return str(path)


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q_proj / k_proj rows (HF -> GGUF)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def save_tiny_gguf(hf_dir: str | os.PathLike, path: str | os.PathLike,
                   tensor_type: str = "F32") -> str:
    """Write the weights of a tiny llama / qwen2 HF dir as a GGUF file the way llama.cpp would.

    2-D weights are stored as `tensor_type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1: quantized by gguf-py;
    Q4_K, Q6_K: by tests/kquants.py, for rows of whole 256-value blocks), norms and biases as F32.
    Returns the file path.
    """
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = cfg["model_type"]
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{arch=} must be llama or qwen2")
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    num_heads, num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    rope = cfg.get("rope_parameters") or {}

    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])

    qtype = gguf.GGMLQuantizationType[tensor_type]
    renames = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
    layer_renames = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, array in tensors.items():
        if name.startswith("model.layers."):
            layer, suffix = name[len("model.layers."):].split(".", 1)
            out_name = f"blk.{layer}.{layer_renames[suffix]}"
        else:
            out_name = renames[name]
        array = np.asarray(array, np.float32)
        if arch == "llama" and suffix_is(name, "q_proj"):
            array = _llama_cpp_permute(array, num_heads)
        elif arch == "llama" and suffix_is(name, "k_proj"):
            array = _llama_cpp_permute(array, num_kv_heads)
        if array.ndim == 2 and tensor_type in kquants.BLOCK_BYTES:
            writer.add_tensor(out_name, kquants.quantize(array, tensor_type)[0], raw_dtype=qtype)
        elif array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(out_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(out_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def suffix_is(name: str, proj: str) -> bool:
    return f".self_attn.{proj}." in name


def gguf_roundtrip(array: np.ndarray, tensor_type: str) -> np.ndarray:
    """What a float32 matrix becomes after quantizing to `tensor_type` and dequantizing back (for
    K-quants: the values tests/kquants.py's blocks stand for, computed without gguf-py)."""
    import gguf

    if tensor_type in kquants.BLOCK_BYTES:
        return kquants.quantize(array, tensor_type)[1]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.asarray(array, np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(np.asarray(array, np.float32), qtype), qtype)


def paged_batch(seqs, *, page_size: int, num_tokens: int, num_seqs: int, pages_per_seq: int):
    """One padded step of a flat ragged batch, as the engine's step input would lay it out.

    seqs: list of (new_token_ids, num_computed_tokens, page_ids) per sequence; token i of sequence s
    sits at position num_computed + i and is written to slot page_ids[pos // ps] * ps + pos % ps.
    Padding tokens write into the null page 0 at position 0; padding sequences have q_len 0.
    Returns (input_ids i32[T], positions i32[T], AttentionMetadata), as jnp arrays.
    """
    import jax.numpy as jnp

    from jaxinfer.ops.kv_cache import AttentionMetadata

    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.arange(num_tokens, dtype=np.int32) % page_size  # padding: the null page
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_indices = np.zeros((num_seqs, pages_per_seq), np.int32)
    t = 0
    for s, (token_ids, num_computed, page_ids) in enumerate(seqs):
        assert len(page_ids) <= pages_per_seq and 0 not in page_ids
        for i, token in enumerate(token_ids):
            pos = num_computed + i
            input_ids[t], positions[t] = token, pos
            slots[t] = page_ids[pos // page_size] * page_size + pos % page_size
            t += 1
        cu_q_lens[s + 1] = t
        kv_lens[s] = num_computed + len(token_ids)
        page_indices[s, :len(page_ids)] = page_ids
    assert t <= num_tokens
    cu_q_lens[len(seqs) + 1:] = t
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots), cu_q_lens=jnp.asarray(cu_q_lens),
                           kv_lens=jnp.asarray(kv_lens), page_indices=jnp.asarray(page_indices),
                           num_seqs=jnp.asarray([len(seqs)], jnp.int32))
    return jnp.asarray(input_ids), jnp.asarray(positions), md
