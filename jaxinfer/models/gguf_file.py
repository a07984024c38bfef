"""GGUF files: open, read metadata, dequantize tensors under their HF (transformers) names.

Uses the `gguf` package (llama.cpp's own reader and dequantizers); nothing here imports JAX.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from jaxinfer.config import ModelConfig, RopeScaling

_MISSING = object()
_REQUIRED = object()
GGUF_ARCHITECTURES = ("llama", "qwen2")  # general.architecture values we read

# The tensor types we test and promise. Any other type gguf.quants can dequantize (Q5_0, Q5_K, ...)
# loads too; one it cannot is refused with a ValueError naming the tensor and its type.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_IGNORED = ("rope_freqs.weight",)  # read into ModelConfig.rope_freq_factors
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path` (memory-mapped); ValueError when it is not a GGUF file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path!r} is not a GGUF file (magic bytes {magic!r})")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on truncated/corrupt files
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def gguf_field(reader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata field `key` (scalars as Python values, arrays as lists)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no key {key!r}")
        return default
    return field.contents()


def gguf_tensor_f32(reader, name: str) -> np.ndarray:
    """Tensor `name` dequantized to float32, in numpy (row-major, HF) axis order."""

    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise ValueError(f"GGUF file has no tensor {name!r}")
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        type_name = GGMLQuantizationType(tensor.tensor_type).name
        raise ValueError(f"tensor {name!r} has type {type_name}, which cannot be dequantized; "
                         f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
    return np.asarray(array, dtype=np.float32).reshape(shape)


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permutation of attn_q / attn_k rows.

    The converter reorders each head's rows from HF's rotate-half layout [x0..x_{d/2}, y0..] to
    llama.cpp's interleaved pairs [x0, y0, x1, y1, ...]; this maps them back. Works for biases too.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """The transformers parameter name of a GGUF tensor name (None: not a weight we load)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _IGNORED:
        return None
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not a known Llama/Qwen2 weight")


class RawTensor(NamedTuple):
    """A tensor's stored bytes, for loaders that keep GGUF's quantized types (jaxinfer.quant)."""

    data: np.ndarray  # u8[rows, bytes per row] as the file stores it
    type_name: str  # "Q4_1", "Q8_0", ...
    shape: tuple[int, ...]  # numpy (HF) shape of the float tensor: (rows, cols)
    row_perm: np.ndarray | None  # i64[rows]: rows to take to undo llama.cpp's Q/K reordering


class GGUFTensors:
    """Read-only mapping HF name -> float32 numpy array over a GGUF file (dequantized lazily)."""

    def __init__(self, reader, architecture: str, num_heads: int, num_kv_heads: int):
        self._reader = reader
        self._permuted = architecture == "llama"  # qwen2's converter does not permute
        self._num_heads = num_heads
        self._num_kv_heads = num_kv_heads
        self._gguf_names = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._gguf_names[name] = t.name

    def __contains__(self, name: str) -> bool:
        return name in self._gguf_names

    def __iter__(self) -> Iterator[str]:
        return iter(self._gguf_names)

    def raw(self, name: str) -> RawTensor | None:
        """Tensor `name` as stored (not dequantized); None if the file has no such tensor."""
        gguf_name = self._gguf_names.get(name)
        tensor = next((t for t in self._reader.tensors if t.name == gguf_name), None)
        if tensor is None:
            return None
        shape = tuple(int(n) for n in reversed(tensor.shape))
        row_perm = None
        if self._permuted and ".self_attn.q_proj." in name:
            row_perm = unpermute_rotary_rows(np.arange(shape[0]), self._num_heads)
        elif self._permuted and ".self_attn.k_proj." in name:
            row_perm = unpermute_rotary_rows(np.arange(shape[0]), self._num_kv_heads)
        return RawTensor(tensor.data, tensor.tensor_type.name, shape, row_perm)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._gguf_names:
            raise KeyError(name)
        array = gguf_tensor_f32(self._reader, self._gguf_names[name])
        if self._permuted and ".self_attn.q_proj." in name:
            array = unpermute_rotary_rows(array, self._num_heads)
        elif self._permuted and ".self_attn.k_proj." in name:
            array = unpermute_rotary_rows(array, self._num_kv_heads)
        return array


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig in the metadata of a .gguf file (llama and qwen2 architectures)."""
    return model_config_from_gguf(open_gguf(path))


def model_config_from_gguf(reader) -> ModelConfig:
    """From an open `gguf.GGUFReader` (so a loader parses the file once)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"architecture={arch!r} is not supported in GGUF files; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}")

    def key(name, default=_REQUIRED):
        value = gguf_field(reader, f"{arch}.{name}", None)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"GGUF metadata is missing the key {arch}.{name!r}")
            return default
        return value

    tensor_names = {t.name for t in reader.tensors}
    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts (some converters): must agree
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"per-layer head_count_kv={num_kv_heads} is not supported")
        num_kv_heads = num_kv_heads[0]
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    rotary_dim = int(key("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary embedding ({rotary_dim=}, {head_dim=}) is not supported")

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens.data)
    elif key("vocab_size", None) is not None:
        vocab_size = int(key("vocab_size"))
    else:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ValueError("GGUF file has neither a token list nor token_embd.weight")
        vocab_size = int(embd.shape[-1])

    rope_scaling = None
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = RopeScaling(rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise ValueError(f"rope scaling type {scaling_type!r} is not supported")
    rope_freq_factors = None
    if "rope_freqs.weight" in tensor_names:
        factors = gguf_tensor_f32(reader, "rope_freqs.weight").reshape(-1)
        rope_freq_factors = tuple(float(x) for x in factors)

    eos_ids = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = gguf_field(reader, f"tokenizer.ggml.{name}", None)
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id", None)
    sliding = key("attention.sliding_window", None)
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos_ids),
        rope_freq_factors=rope_freq_factors,
    )
