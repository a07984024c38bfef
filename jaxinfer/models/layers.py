"""Building blocks: Linear (the one place a projection reads its weight), Embed, RMSNorm, RoPE."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.quant import QuantizedWeight, quantized_embedding

_INIT_STD = 0.02


class Linear(nnx.Module):
    """y = x @ W (+ b), W stored [in_features, out_features].

    Every projection of the model goes through this class. `matmul` is the only method that reads
    the weight: a quantized variant subclasses Linear, holds its own params and overrides `matmul`.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.weight = nnx.Param(
            _INIT_STD * jax.random.normal(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def matmul(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        # x: [..., in_features] -> [..., out_features]; num_rows: see __call__ (a float weight
        # multiplies every row)
        return jnp.dot(x.astype(self.dtype), self.weight[...].astype(self.dtype))

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """`num_rows` (i32[], traced): x's rows beyond the first num_rows are a step's padding,
        whose results nothing reads; a quantized weight's CPU kernels skip them (zero rows)."""
        y = self.matmul(x, num_rows)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class Embed(nnx.Module):
    """Token embedding [vocab, hidden]; `attend` is the tied LM head."""

    def __init__(self, num_embeddings: int, features: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embedding = nnx.Param(
            _INIT_STD * jax.random.normal(rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        # ids: i32[T] -> [T, features]
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        # x: [R, features] -> f32[R, num_embeddings]; num_rows: as Linear's (unused here)
        return jnp.dot(x.astype(self.dtype), self.embedding[...].astype(self.dtype).T,
                       preferred_element_type=jnp.float32)


def row_sum_fixed_order(x: jax.Array) -> jax.Array:
    """x: f32[R, H] -> f32[R], each row summed in one fixed order (halves added elementwise until
    one column is left), whatever R is and whatever XLA fuses around it. A reduce leaves the order
    to XLA, and XLA:CPU picks it by shape and fusion context: a row's sum of squares then differed
    in its last bits between a one-token step and an eight-token one, which speculative
    verification (and int8 activations above all) turns into different greedy tokens."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        pairs = x[:, :half] + x[:, half:2 * half]  # [R, n // 2]
        if n % 2:  # the odd column joins the first
            pairs = jnp.concatenate([pairs[:, :1] + x[:, 2 * half:], pairs[:, 1:]], axis=-1)
        x = pairs
    return x[:, 0]


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in float32 (as transformers does), returned in `dtype`.
    A row's result does not depend on how many rows x has (`row_sum_fixed_order`)."""

    def __init__(self, features: int, *, eps: float, dtype=jnp.float32, param_dtype=jnp.float32):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((features,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        squares = (x32 * x32).reshape(-1, x.shape[-1])  # [R, H]
        mean = (row_sum_fixed_order(squares) / x.shape[-1]).reshape(*x.shape[:-1], 1)
        x32 = x32 * jax.lax.rsqrt(mean + self.eps)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """f32[head_dim // 2] rotary inverse frequencies, with llama3 / linear scaling applied.

    Computed in float32 the way transformers computes them, so positions rotate identically.
    """
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / np.float32(scaling.factor)
    elif scaling is not None and scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, np.float32)
    return inv_freq.astype(np.float32)


def _angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    # positions: i32[T] -> cos, sin: f32[T, head_dim // 2]
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin: f32[T, head_dim // 2] of positions i32[T], computed once for every layer.

    On the CPU they are computed in a conditional on a runtime predicate whose two branches are
    the same: XLA:CPU would otherwise fuse them into every layer's rope and evaluate them per
    element of q and k (layers x [T, Hq + Hkv, D] transcendentals); it removes optimization
    barriers before fusing, but does not fuse across a conditional. Not on a GPU, where a
    conditional waits for its predicate on the host."""
    if jax.default_backend() == "cpu":
        return jax.lax.cond(positions[0] >= 0, _angles, _angles, positions, inv_freq)
    return _angles(positions, inv_freq)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the HF layout). x: [T, H, D]; cos/sin: f32[T, D // 2]."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class QuantizedLinear(Linear):
    """Linear over a `quant.QuantizedWeight` (int8 / int4): params values, scales (, mins) [, bias].

    Built from a float Linear by `jaxinfer.models.quantize.quantize_model`; leading stacked dims
    ([L, ...]) are allowed, the scan over layers slices them before `matmul` runs. `backend`
    (static): how `ops.quantized_matmul` multiplies (quantize_model sets it from the engine's
    attention_backend). `dense`: the same weight in float, kept beside the codes when many-row
    products should run as dense matmuls (ops.quantized_matmul says when). `mesh`, `tp_split`
    (static): the tensor-parallel mesh the weight is placed on and its split ("column" /
    "row"), where each device multiplies by its own share (set by runtime/sharding.py, which
    also packs a row-split int4 weight's codes per device: models/tp_layout.py); None
    otherwise.
    """

    def __init__(self, qweight, bias: nnx.Param | None = None, *, dtype=jnp.float32,
                 backend: str = "auto", dense: jax.Array | None = None):
        self.in_features, self.out_features = qweight.shape
        self.dtype = dtype
        self.backend = backend
        self.mesh, self.tp_split = None, None
        self.bits, self.group_size = qweight.bits, qweight.group_size
        self.values = nnx.Param(qweight.values)
        self.scales = nnx.Param(qweight.scales)
        self.mins = None if qweight.mins is None else nnx.Param(qweight.mins)
        self.dense = None if dense is None else nnx.Param(dense)  # [..., K, N]
        self.bias = bias
        self.int8_activations = False  # static: see ops.quantized_matmul

    @property
    def qweight(self):
        return QuantizedWeight(self.values[...], self.scales[...],
                               None if self.mins is None else self.mins[...], self.bits,
                               self.group_size, (self.in_features, self.out_features))

    def matmul(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        return ops.quantized_matmul(x.astype(self.dtype), self.qweight, backend=self.backend,
                                    dense=None if self.dense is None else self.dense[...],
                                    mesh=self.mesh, split=self.tp_split,
                                    int8_activations=self.int8_activations, num_rows=num_rows)


class QuantizedEmbed(Embed):
    """Embed over a `quant.QuantizedWeight` stored in LM-head layout [features, num_embeddings],
    so the tied head is a plain quantized matmul and a lookup dequantizes only its columns.
    `dense`: the float table [num_embeddings, features] kept beside the codes (see
    QuantizedLinear); lookups then read it. `mesh`, `tp_split`: as QuantizedLinear's, for
    the tied head (split by vocabulary: "column")."""

    def __init__(self, qweight, *, dtype=jnp.float32, backend: str = "auto",
                 dense: jax.Array | None = None):
        self.dtype = dtype
        self.backend = backend
        self.mesh, self.tp_split = None, None
        self.bits, self.group_size = qweight.bits, qweight.group_size
        self.features, self.num_embeddings = qweight.shape
        self.values = nnx.Param(qweight.values)
        self.scales = nnx.Param(qweight.scales)
        self.mins = None if qweight.mins is None else nnx.Param(qweight.mins)
        self.dense = None if dense is None else nnx.Param(dense)  # [num_embeddings, features]
        self.int8_activations = False  # static: see ops.quantized_matmul

    @property
    def qweight(self):
        return QuantizedWeight(self.values[...], self.scales[...],
                               None if self.mins is None else self.mins[...], self.bits,
                               self.group_size, (self.features, self.num_embeddings))

    def __call__(self, ids: jax.Array) -> jax.Array:
        if self.dense is not None:
            return jnp.take(self.dense[...], ids, axis=0).astype(self.dtype)
        return quantized_embedding(self.qweight, ids, self.dtype)

    def attend(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        dense = None if self.dense is None else self.dense[...].T  # [features, num_embeddings]
        return ops.quantized_matmul(x.astype(self.dtype), self.qweight, backend=self.backend,
                                    dense=dense, mesh=self.mesh, split=self.tp_split,
                                    int8_activations=self.int8_activations,
                                    num_rows=num_rows).astype(jnp.float32)


def set_quantized_matmul_backend(model: nnx.Module, backend: str, *,
                                 int8_activations: bool = False) -> nnx.Module:
    """Point every QuantizedLinear / QuantizedEmbed of `model` at `backend` (in place), e.g.
    for a model restored from a pre-quantized checkpoint, with x rounded to int8 or not (see
    ops.quantized_matmul; with int8, a float copy kept beside the codes is dropped); returns the
    model."""
    if backend not in ops.BACKENDS:
        raise ValueError(f"{backend=} must be one of {ops.BACKENDS}")
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (QuantizedLinear, QuantizedEmbed)):
            module.backend = backend
            module.int8_activations = int8_activations
            if int8_activations:  # every row count then takes the codes: a float copy is unused
                module.dense = None
    return model


def pad_code_strides(model: nnx.Module) -> int:
    """Give every quantized weight that the "cpu" backend multiplies with int8 activations on one
    device the row stride that kernel reads fastest (`ops.cpu_code_stride`; in place); returns
    how many were padded. The products are unchanged bit for bit (columns are independent and
    the padding is never read); the weights take up to 64 columns more each. Weights multiplied
    with float x keep their rows: the float kernel's one-row path reads each row's columns as
    runs of 4 KiB, which a padded stride misaligns (a single stream decoded ~5% slower so;
    docs/performance.md, item 25)."""
    padded = 0
    for _, module in nnx.iter_modules(model):
        if not isinstance(module, (QuantizedLinear, QuantizedEmbed)) or module.mesh is not None \
                or not module.int8_activations:
            continue
        qw = module.qweight
        if ops.resolve_backend(module.backend) != "cpu" or qw.values.ndim != 2:
            continue
        stride = ops.cpu_code_stride(qw)
        if stride == qw.stride:
            continue
        qw = qw.padded(stride)
        module.values.set_value(qw.values)
        module.scales.set_value(qw.scales)
        if module.mins is not None:
            module.mins.set_value(qw.mins)
        padded += 1
    return padded
