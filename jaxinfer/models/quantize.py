"""Quantizing a model: every `layers.Linear` of the decoder (and optionally the LM head) replaced
by a quantized one, the GGUF's own quantized tensors taken as stored where they fit."""

from __future__ import annotations

import dataclasses

from flax import nnx

from jaxinfer import ops
from jaxinfer.models.calibration import calibration_tokens, final_hidden_hessian
from jaxinfer.models.layers import Embed, Linear, QuantizedEmbed, QuantizedLinear
from jaxinfer.quant import (INT4_GROUP_SIZES, QuantizedWeight, concat_output_channels, from_gguf,
                            gptq_int4, permute_output_channels, quantize_int4, quantize_int8,
                            stack)



@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """method: int8 (per output channel) | int4 (group-wise along K, packed) | stored (a GGUF
    file's Q8_0 / Q4_0 / Q4_1 tensors kept exactly as stored, every other weight left in float).

    int4 re-quantization is asymmetric (Q4_1 style: scale and minimum per group) unless
    symmetric=True (Q4_0 style); with search (the default) each group's parameters are chosen by
    the error-minimising grid search of llama.cpp's k-quants instead of the group's min/max.
    GGUF tensors are kept as stored when their type is the requested kind (Q8_0 for int8; Q4_0 /
    Q4_1 for int4 with group 32).

    The LM head (for tied models: the shared embedding table) is quantized only when
    quantize_lm_head, as lm_head_method (None: the same as method). An int4 head is re-quantized
    with GPTQ (lm_head_gptq) against the covariance of the final hidden states of the
    (already quantized) model over `calibration_num_tokens` random token ids: the hidden states
    have a few outlier dimensions that plain rounding ignores (docs/quantization.md).
    """

    method: str
    group_size: int = 32
    symmetric: bool = False
    quantize_lm_head: bool = False
    lm_head_method: str | None = None
    search: bool = True
    lm_head_gptq: bool = True
    calibration_num_tokens: int = 1024
    calibration_seed: int = 0
    matmul_backend: str = "auto"  # QuantizedLinear / QuantizedEmbed: see ops.quantized_matmul
    keep_dense: bool = False  # keep each float weight beside its codes (ops.quantized_matmul)

    def __post_init__(self):
        if self.method not in ("int8", "int4", "stored"):
            raise ValueError(f"method={self.method!r} must be int8, int4 or stored")
        if self.lm_head_method not in (None, "int8", "int4"):
            raise ValueError(f"lm_head_method={self.lm_head_method!r} must be None, int8 or int4")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size} must be one of {INT4_GROUP_SIZES}")
        if self.calibration_num_tokens < 1:
            raise ValueError(f"calibration_num_tokens={self.calibration_num_tokens} must be >= 1")
        if self.matmul_backend not in ops.BACKENDS:
            raise ValueError(f"matmul_backend={self.matmul_backend!r} must be one of {ops.BACKENDS}")

    @classmethod
    def from_engine_config(cls, ec, *, gguf: bool) -> "QuantConfig | None":
        """The engine's quantization fields for a model from a GGUF file (`gguf`) or not; the
        quantized matmul follows attention_backend. "auto" keeps a GGUF file's quantized tensors
        as stored where the CPU kernels run them, and is "none" otherwise."""
        method = ec.quantization
        if method == "auto":
            method = "stored" if gguf and ops.resolve_backend(ec.attention_backend) == "cpu" \
                else "none"
        if method == "none":
            return None
        return cls(method, group_size=ec.quant_group_size,
                   quantize_lm_head=ec.quantize_lm_head or method == "stored",
                   matmul_backend=ec.attention_backend, keep_dense=ec.quantization == "auto" and ops.cpu_keeps_dense_copy())

    @property
    def head_method(self) -> str:
        return self.lm_head_method or self.method

    def quantize(self, w) -> QuantizedWeight | None:
        """A float weight quantized under this config; None for "stored" (it stays float)."""
        if self.method == "int8":
            return quantize_int8(w)
        if self.method == "int4":
            return quantize_int4(w, self.group_size, self.symmetric, search=self.search)
        return None

    def accepts_gguf(self, type_name: str) -> bool:
        """A GGUF tensor type loaded as it is (no float round trip) under this config."""
        if self.method == "stored":
            return type_name in ("Q8_0", "Q4_0", "Q4_1")
        if type_name == "Q8_0":
            return self.method == "int8"  # int8, group-wise (32) rather than per channel
        return type_name in ("Q4_0", "Q4_1") and self.method == "int4" and self.group_size == 32


# Decoder Linear (path under model.layers) -> the HF tensors fused along its output axis
# (mirrors models/weights.py, which builds the float params the same way).
_LAYER_LINEAR_SOURCES = {
    ("self_attn", "qkv_proj"): ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                "self_attn.v_proj.weight"),
    ("self_attn", "o_proj"): ("self_attn.o_proj.weight",),
    ("mlp", "gate_up_proj"): ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp", "down_proj"): ("mlp.down_proj.weight",),
}


def _gguf_weight(tensors, name: str, qconfig: QuantConfig) -> QuantizedWeight | None:
    """One GGUF tensor as a [K, N] QuantizedWeight, or None when it must go through float."""
    raw = tensors.raw(name)
    if raw is None or not qconfig.accepts_gguf(raw.type_name):
        return None
    qw = from_gguf(raw.data, raw.type_name, raw.shape)
    return qw if raw.row_perm is None else permute_output_channels(qw, raw.row_perm)


def _gguf_linear(tensors, names_per_layer: list[tuple[str, ...]], qconfig) -> QuantizedWeight | None:
    layers = []
    for names in names_per_layer:
        parts = [_gguf_weight(tensors, n, qconfig) for n in names]
        if any(p is None for p in parts):
            return None
        try:
            layers.append(parts[0] if len(parts) == 1 else concat_output_channels(parts))
        except ValueError:  # mixed types inside one fused projection
            return None
    if len(layers) == 1:
        return layers[0]
    try:
        return stack(layers)
    except ValueError:  # mixed types across layers
        return None


def quantize_model(model, qconfig: QuantConfig, gguf_tensors=None, *,
                   calibration_token_ids=None):
    """Replace the model's float Linear (and, if asked, the LM head / tied embedding) by quantized
    ones, in place; returns the model. Float weights are quantized on the device; with
    `gguf_tensors` (models.gguf_file.GGUFTensors) Q8_0 / Q4_0 / Q4_1 tensors that fit `qconfig`
    are taken as they are stored (bit-exact with the file), the rest are re-quantized.

    The head goes last: an int4 head re-quantized with GPTQ needs the final hidden states of the
    model whose decoder is already quantized, over `calibration_token_ids` (i32[n]; default
    `qconfig.calibration_num_tokens` random ids drawn with `qconfig.calibration_seed`)."""
    num_layers = model.config.num_layers
    head_config = dataclasses.replace(qconfig, method=qconfig.head_method)
    backend = qconfig.matmul_backend
    head = None  # (parent, name, module) of the head to quantize after the decoder
    for path, module in list(nnx.iter_modules(model)):
        if not path:
            continue
        parent = model
        for key in path[:-1]:
            parent = getattr(parent, key)
        is_head = path == ("lm_head",)
        tied_table = (type(module) is Embed and path == ("embed_tokens",)
                      and model.lm_head is None)
        if (is_head and type(module) is Linear) or tied_table:
            head = (parent, path[-1], module)
        elif type(module) is Linear:
            qw = None
            if gguf_tensors is not None and path[0] == "layers" and path[1:] in _LAYER_LINEAR_SOURCES:
                names = [tuple(f"model.layers.{i}.{n}" for n in _LAYER_LINEAR_SOURCES[path[1:]])
                         for i in range(num_layers)]
                qw = _gguf_linear(gguf_tensors, names, qconfig)
            if qw is None:
                qw = qconfig.quantize(module.weight[...])
            if qw is not None:  # None: "stored" and not quantized in the file: stays float
                dense = module.weight[...] if qconfig.keep_dense else None
                setattr(parent, path[-1], QuantizedLinear(qw, module.bias, dtype=module.dtype,
                                                          backend=backend, dense=dense))
    if head is None or not qconfig.quantize_lm_head:
        return model
    parent, name, module = head
    tied = type(module) is Embed
    qw = None
    if gguf_tensors is not None:
        gguf_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        qw = _gguf_linear(gguf_tensors, [(gguf_name,)], head_config)
    if qw is None:
        w = module.embedding[...].T if tied else module.weight[...]  # [hidden, vocab]
        if head_config.method == "int4" and qconfig.lm_head_gptq:
            if calibration_token_ids is None:
                calibration_token_ids = calibration_tokens(
                    model.config, qconfig.calibration_num_tokens, qconfig.calibration_seed)
            hessian = final_hidden_hessian(model, calibration_token_ids)
            qw = gptq_int4(w, hessian, qconfig.group_size, qconfig.symmetric)
        else:
            qw = head_config.quantize(w)
    if qw is None:
        return model
    if tied:
        dense = module.embedding[...] if qconfig.keep_dense else None
        setattr(parent, name, QuantizedEmbed(qw, dtype=module.dtype, backend=backend, dense=dense))
    else:
        dense = module.weight[...] if qconfig.keep_dense else None
        setattr(parent, name, QuantizedLinear(qw, module.bias, dtype=module.dtype,
                                              backend=backend, dense=dense))
    return model

