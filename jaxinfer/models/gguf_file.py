"""GGUF files: open, read metadata, dequantize tensors under their HF (transformers) names.

Uses the `gguf` package (llama.cpp's own reader and dequantizers); nothing here imports JAX.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, NamedTuple

import numpy as np

_MISSING = object()

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
    from gguf import GGUFReader

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
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

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
