"""HF-named checkpoint tensors -> the param tree of `LlamaForCausalLM` (fused, transposed, stacked).

`tensors` is any read-only mapping from transformers parameter names to numpy arrays (a safetensors
directory, or a GGUF file seen through `gguf_file.GGUFTensors`). Shapes are checked against the
config; a missing or mis-shaped tensor is a ValueError naming it.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from jaxinfer.config import ModelConfig


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name suffix -> shape, for the per-layer tensors."""
    hidden, q_size = config.hidden_size, config.num_heads * config.head_dim
    kv_size, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_size, hidden),
        "self_attn.k_proj.weight": (kv_size, hidden),
        "self_attn.v_proj.weight": (kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, q_size),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q_size,), "self_attn.k_proj.bias": (kv_size,),
                       "self_attn.v_proj.bias": (kv_size,)})
    return shapes


class _Reader:
    def __init__(self, tensors: Mapping[str, np.ndarray], config: ModelConfig, dtype):
        self.tensors = tensors
        self.dtype = dtype
        self.layer_shapes = _expected_shapes(config)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        array = np.asarray(self.tensors[name])
        if tuple(array.shape) != tuple(shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(array.shape)}; the config expects {tuple(shape)}")
        return array

    def layer(self, i: int, suffix: str) -> np.ndarray:
        return self.get(f"model.layers.{i}.{suffix}", self.layer_shapes[suffix])

    def stacked(self, num_layers: int, build: Callable[[int], np.ndarray]) -> np.ndarray:
        """[num_layers, ...] in the param dtype, converting one layer at a time."""
        first = np.asarray(build(0), dtype=self.dtype)
        out = np.empty((num_layers,) + first.shape, dtype=self.dtype)
        out[0] = first
        for i in range(1, num_layers):
            out[i] = build(i)
        return out


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype) -> dict:
    """The pure param dict (`nnx.to_pure_dict` layout) of LlamaForCausalLM, as numpy in `dtype`."""
    r = _Reader(tensors, config, dtype)
    num_layers, hidden = config.num_layers, config.hidden_size

    def cat(i, names, axis=0):
        return np.concatenate([r.layer(i, n) for n in names], axis=axis)

    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    qkv_proj = {"weight": r.stacked(num_layers, lambda i: cat(i, [f"{n}.weight" for n in qkv]).T)}
    if config.attention_bias:
        qkv_proj["bias"] = r.stacked(num_layers, lambda i: cat(i, [f"{n}.bias" for n in qkv]))
    layers = {
        "input_layernorm": {"weight": r.stacked(num_layers,
                                                lambda i: r.layer(i, "input_layernorm.weight"))},
        "post_attention_layernorm": {"weight": r.stacked(
            num_layers, lambda i: r.layer(i, "post_attention_layernorm.weight"))},
        "self_attn": {
            "qkv_proj": qkv_proj,
            "o_proj": {"weight": r.stacked(num_layers,
                                           lambda i: r.layer(i, "self_attn.o_proj.weight").T)},
        },
        "mlp": {
            "gate_up_proj": {"weight": r.stacked(
                num_layers, lambda i: cat(i, ["mlp.gate_proj.weight", "mlp.up_proj.weight"]).T)},
            "down_proj": {"weight": r.stacked(num_layers,
                                              lambda i: r.layer(i, "mlp.down_proj.weight").T)},
        },
    }
    embed = r.get("model.embed_tokens.weight", (config.vocab_size, hidden))
    params = {
        "embed_tokens": {"embedding": np.asarray(embed, dtype)},
        "layers": layers,
        "norm": {"weight": np.asarray(r.get("model.norm.weight", (hidden,)), dtype)},
    }
    if not config.tie_word_embeddings:
        lm_head = r.get("lm_head.weight", (config.vocab_size, hidden))
        params["lm_head"] = {"weight": np.ascontiguousarray(np.asarray(lm_head, dtype).T)}
    return params
