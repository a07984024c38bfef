"""Weight-only quantization: int8 (per output channel or group-wise) and int4 group-wise (packed).

A weight is used as `x @ w` with `w: [K, N]` (K = in features, contracted; N = out features).
Groups run along K (the contraction axis), one scale per (group, output channel), like GGUF blocks.

Storage (`QuantizedWeight`; array leaves may carry leading stacked dims, e.g. `[L, ...]` for
layers under `lax.scan`):

- bits=8: `values` i8[..., K, N]; w = values * scale. Per channel when group_size == K (the
  scale is applied after the dot), group-wise otherwise (GGUF Q8_0 is group size 32).
- bits=4: `values` u8[..., Kh, N] with Kh = ceil(K / 2): the low nibble of row i holds row i and
  the high nibble holds row Kh + i (the two halves of K), so unpacking is a shift by an iota over
  [2, Kh, N] and a free reshape to [K, N]: one elementwise fusion, no concatenate (XLA CPU emits a
  concatenate inside a fusion element by element, 5-10x slower; and the Pallas kernel reads the
  two halves as two x column ranges). Nibbles are unsigned q in 0..15; symmetric:
  w = (q - 8) * scale (GGUF Q4_0), asymmetric: w = q * scale + min (GGUF Q4_1).
- `scales` (and `mins`) f16/f32[..., G, N], G = ceil(K / group_size); the last group may be
  partial (SmolLM2's K=576 is 4.5 groups of 128).

Matmul on XLA (`quantized_matmul`): dequantise inside the jitted function, then one dot. XLA
CPU (jax 0.10.2) compiles that to one loop fusion (u8/i8 + f16 scales -> f32[K, N]) and the dot:
a per-call temp of one matrix (3.5 MB for 576x1536), never a resident float copy of the model.
Measured on the 2-core CPU (benchmarks/quant.py --matmul): faster than f32 once the weights do
not sit in cache (30 stacked layers, batch 1: int8 and int4 ~2-3x faster than f32), slower for
one cache-resident matrix; a per-group batched dot (scales after the dot) was slower at batch 32
and no faster at batch 1, and jnp.int4 storage dequantised the same way was 2-4x slower. XLA GPU
fuses such converts into its GEMM fusions; not measured here (no GPU in this session).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

INT4_GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized `[K, N]` weight (a pytree: values/scales/mins are leaves, the rest static)."""

    values: jax.Array  # i8[..., K, N] (bits=8) | u8[..., ceil(K/2), N] (bits=4, halves packed)
    scales: jax.Array  # f16|f32[..., G, N], G = ceil(K / group_size)
    mins: jax.Array | None  # like scales (asymmetric int4), None when symmetric
    bits: int
    group_size: int  # == K for per-channel int8
    shape: tuple[int, int]  # logical (K, N) of the trailing two dims

    @property
    def num_groups(self) -> int:
        return math.ceil(self.shape[0] / self.group_size)

    @property
    def symmetric(self) -> bool:
        return self.mins is None

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.values, self.scales, self.mins) if a is not None)

    def __repr__(self):
        kind = "sym" if self.symmetric else "asym"
        lead = tuple(self.values.shape[:-2])
        return (f"QuantizedWeight(int{self.bits} {kind} g{self.group_size}, "
                f"shape={lead + self.shape}, scales={self.scales.dtype})")


jax.tree_util.register_dataclass(
    QuantizedWeight,
    data_fields=["values", "scales", "mins"],
    meta_fields=["bits", "group_size", "shape"],
)


def _check_weight(w) -> tuple[int, int]:
    if w.ndim < 2:
        raise ValueError(f"{w.shape=} must have at least 2 dims [..., K, N]")
    return int(w.shape[-2]), int(w.shape[-1])


def _grouped(w: jax.Array, group_size: int) -> jax.Array:
    """f32[..., K, N] -> f32[..., G, group_size, N]; the partial last group is padded with NaN."""
    k, n = w.shape[-2:]
    num_groups = math.ceil(k / group_size)
    pad = num_groups * group_size - k
    if pad:
        widths = [(0, 0)] * (w.ndim - 2) + [(0, pad), (0, 0)]
        w = jnp.pad(w, widths, constant_values=jnp.nan)
    return w.reshape(*w.shape[:-2], num_groups, group_size, n)


def _ungrouped(q: jax.Array, k: int) -> jax.Array:
    """[..., G, group_size, N] -> [..., K, N] (drops the padding of the last group)."""
    return q.reshape(*q.shape[:-3], -1, q.shape[-1])[..., :k, :]


def _safe_inverse(d: jax.Array) -> jax.Array:
    return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))


def quantize_int8(w, group_size: int | None = None, scale_dtype=jnp.float32) -> QuantizedWeight:
    """Symmetric int8: per output channel (group_size None) or group-wise along K.

    w: f32[..., K, N]; w ~= q * scale, q in -127..127, |error| <= scale / 2.
    """
    k, n = _check_weight(w)
    group_size = k if group_size is None else int(group_size)
    if group_size <= 0:
        raise ValueError(f"{group_size=} must be positive")
    return _quantize_int8(jnp.asarray(w, jnp.float32), group_size, jnp.dtype(scale_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_int8(w, group_size, scale_dtype):
    k, n = w.shape[-2:]
    g = _grouped(w, group_size)  # [..., G, gs, N]
    absmax = jnp.nanmax(jnp.abs(g), axis=-2)  # [..., G, N]
    scales = (absmax / 127.0).astype(scale_dtype)
    inv = _safe_inverse(scales.astype(jnp.float32))
    q = jnp.clip(jnp.round(g * inv[..., None, :]), -127, 127)
    q = jnp.nan_to_num(q).astype(jnp.int8)
    return QuantizedWeight(_ungrouped(q, k), scales, None, 8, group_size, (k, n))


def pack_int4(q: jax.Array) -> jax.Array:
    """u8[..., K, N] nibbles (0..15) -> u8[..., ceil(K/2), N]: row i low, row Kh + i high."""
    k = q.shape[-2]
    kh = (k + 1) // 2
    q = q.astype(jnp.uint8)
    lo, hi = q[..., :kh, :], q[..., kh:, :]
    if hi.shape[-2] < kh:  # odd K: the last high nibble is padding
        widths = [(0, 0)] * (q.ndim - 2) + [(0, kh - hi.shape[-2]), (0, 0)]
        hi = jnp.pad(hi, widths)
    return lo | (hi << 4)


def _unpacked_int4(values: jax.Array, k: int) -> jax.Array:
    """u8[..., Kh, N] -> nibbles u8[..., K, N]. For even K as one elementwise fusion (a shift by
    an iota over the two halves, then a free reshape): XLA CPU emits a concatenate inside a
    fusion element by element, 5-10x slower, so it is used only for odd K."""
    kh, n = values.shape[-2:]
    if k % 2:
        lo, hi = unpack_int4(values, k)
        return jnp.concatenate([lo, hi], axis=-2)
    half = jax.lax.broadcasted_iota(jnp.uint8, (2, kh, n), 0)
    q = (values[..., None, :, :] >> (half * 4)) & 15  # u8[..., 2, Kh, N]
    return q.reshape(*values.shape[:-2], k, n)


def unpack_int4(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """u8[..., Kh, N] -> (lo u8[..., Kh, N] = rows 0..Kh-1, hi u8[..., K - Kh, N] = rows Kh..K-1)."""
    kh = values.shape[-2]
    return values & 15, (values >> 4)[..., : k - kh, :]


def quantize_int4(w, group_size: int = 32, symmetric: bool = True,
                  scale_dtype=jnp.float16) -> QuantizedWeight:
    """Group-wise int4 along K, packed two per byte.

    Symmetric (Q4_0 style): scale = (the group's value of largest magnitude) / -8, so that value
    maps to q = 0 exactly; w ~= (q - 8) * scale, |error| <= |scale| (<= |scale|/2 except for a
    value of the opposite sign and the same magnitude, clipped to q = 15).
    Asymmetric (Q4_1 style): scale = (max - min) / 15, w ~= q * scale + min, |error| <= scale / 2
    (plus the rounding of scale and min to scale_dtype).
    """
    _check_weight(w)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{group_size=} must be one of {INT4_GROUP_SIZES}")
    return _quantize_int4(jnp.asarray(w, jnp.float32), group_size, bool(symmetric),
                          jnp.dtype(scale_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_int4(w, group_size, symmetric, scale_dtype):
    k, n = w.shape[-2:]
    g = _grouped(w, group_size)  # [..., G, gs, N]
    filled = jnp.nan_to_num(g, nan=0.0)
    if symmetric:
        idx = jnp.argmax(jnp.abs(filled), axis=-2, keepdims=True)
        extreme = jnp.take_along_axis(filled, idx, axis=-2)[..., 0, :]  # [..., G, N]
        scales = (extreme / -8.0).astype(scale_dtype)
        inv = _safe_inverse(scales.astype(jnp.float32))
        q = jnp.clip(jnp.round(g * inv[..., None, :]) + 8, 0, 15)
        mins = None
    else:
        lo = jnp.nanmin(g, axis=-2)
        hi = jnp.nanmax(g, axis=-2)
        mins = lo.astype(scale_dtype)
        scales = ((hi - mins.astype(jnp.float32)) / 15.0).astype(scale_dtype)
        inv = _safe_inverse(scales.astype(jnp.float32))
        q = jnp.clip(jnp.round((g - mins.astype(jnp.float32)[..., None, :]) * inv[..., None, :]), 0, 15)
    q = jnp.nan_to_num(q).astype(jnp.uint8)
    return QuantizedWeight(pack_int4(_ungrouped(q, k)), scales, mins, 4, group_size, (k, n))


def _row_params(a: jax.Array, group_size: int, start: int, stop: int, dtype) -> jax.Array:
    """Per-group [..., G, N] -> per-row [..., stop - start, N] for rows start..stop-1 of K."""
    *lead, num_groups, n = a.shape
    rows = jnp.broadcast_to(a.astype(dtype)[..., None, :], (*lead, num_groups, group_size, n))
    return rows.reshape(*lead, num_groups * group_size, n)[..., start:stop, :]  # fuses (no gather)


def _dequantize_rows(qw: QuantizedWeight, q: jax.Array, start: int, stop: int, dtype) -> jax.Array:
    """Integer rows start..stop-1 of K ([..., stop-start, N]) -> float rows of the weight."""
    gs = qw.group_size
    scale = _row_params(qw.scales, gs, start, stop, dtype)
    if qw.bits == 8:
        return q.astype(dtype) * scale
    if qw.mins is None:
        return (q.astype(jnp.int8) - 8).astype(dtype) * scale
    return q.astype(dtype) * scale + _row_params(qw.mins, gs, start, stop, dtype)


def dequantize(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """QuantizedWeight -> dtype[..., K, N]. In float32 this equals gguf.quants.dequantize
    bit-exactly for weights imported from Q8_0 / Q4_0 / Q4_1."""
    return _dequantize(qw, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(qw: QuantizedWeight, dtype) -> jax.Array:
    k, _ = qw.shape
    q = qw.values if qw.bits == 8 else _unpacked_int4(qw.values, k)
    return _dequantize_rows(qw, q, 0, k, dtype)


# A matrix larger than _CHUNKED_ABOVE weights (the LM head: 576 x 49152) is multiplied in column
# chunks of about _CHUNK_WEIGHTS, so the dequantised temp is a few MB that stays in cache rather
# than a 113 MB buffer written and read back every step (measured on XLA CPU: 116 ms -> 7 ms for
# the SmolLM2 head at batch 1).
_CHUNK_WEIGHTS = 1 << 20
_CHUNKED_ABOVE = 4 << 20


def _num_column_chunks(k: int, n: int) -> int:
    if k * n <= _CHUNKED_ABOVE:
        return 1
    wanted = -(-k * n // _CHUNK_WEIGHTS)
    return next((c for c in range(wanted, n + 1) if n % c == 0), 1)


def quantized_matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """x: [..., K] @ the [K, N] weight -> [..., N] in x.dtype (XLA path; use under jax.jit).

    The weight must be a single matrix (no stacked leading dims: slice the layer first)."""
    k, n = qw.shape
    if qw.values.ndim != 2:
        raise ValueError(f"{qw.values.shape=} must be 2-D (slice stacked layers before the matmul)")
    if x.shape[-1] != k:
        raise ValueError(f"{x.shape=} must end in K={k}")
    num_chunks = _num_column_chunks(k, n)
    if num_chunks == 1:
        return _matmul(x, qw)
    width = n // num_chunks

    def chunk(c):  # columns c * width ... (c + 1) * width - 1
        cols = lambda a: None if a is None else jax.lax.dynamic_slice_in_dim(  # noqa: E731
            a, c * width, width, axis=-1)
        part = QuantizedWeight(cols(qw.values), cols(qw.scales), cols(qw.mins), qw.bits,
                               qw.group_size, (k, width))
        return _matmul(x, part)  # [..., width]

    y = jax.lax.map(chunk, jnp.arange(num_chunks))  # [C, ..., width]
    return jnp.moveaxis(y, 0, -2).reshape(*x.shape[:-1], n)


def _matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    k, _ = qw.shape
    dtype = x.dtype
    if qw.bits == 8 and qw.group_size >= k:  # per channel: scale after the dot
        return (x @ qw.values.astype(dtype)) * qw.scales[0].astype(dtype)
    if qw.bits == 8:
        return x @ _dequantize_rows(qw, qw.values, 0, k, dtype)
    return x @ _dequantize_rows(qw, _unpacked_int4(qw.values, k), 0, k, dtype)


def quantized_embedding(qw: QuantizedWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows of the transposed weight: for a tied embedding stored as the LM head ([hidden, vocab]),
    ids: i32[T] -> dtype[T, hidden]. Gathers the columns, then dequantises only those."""
    if qw.values.ndim != 2:
        raise ValueError(f"{qw.values.shape=} must be 2-D")
    cols = QuantizedWeight(
        jnp.take(qw.values, ids, axis=-1), jnp.take(qw.scales, ids, axis=-1),
        None if qw.mins is None else jnp.take(qw.mins, ids, axis=-1),
        qw.bits, qw.group_size, (qw.shape[0], int(ids.shape[0])))
    return dequantize(cols, dtype).T


def permute_output_channels(qw: QuantizedWeight, perm) -> QuantizedWeight:
    """Reorder the N (output) axis: per-channel quantization commutes with a row permutation of
    the [N, K] matrix (e.g. undoing llama.cpp's Q/K head permutation)."""
    perm = np.asarray(perm)
    if sorted(perm.tolist()) != list(range(qw.shape[1])):
        raise ValueError(f"perm must be a permutation of range({qw.shape[1]})")
    take = lambda a: None if a is None else jnp.take(a, perm, axis=-1)  # noqa: E731
    return dataclasses.replace(qw, values=take(qw.values), scales=take(qw.scales), mins=take(qw.mins))


def stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Per-layer weights -> one QuantizedWeight with a leading [L] axis (for lax.scan)."""
    first = weights[0]
    for w in weights[1:]:
        if (w.bits, w.group_size, w.shape, w.mins is None) != (
                first.bits, first.group_size, first.shape, first.mins is None):
            raise ValueError(f"cannot stack {w!r} with {first!r}")
    return jax.tree.map(lambda *a: jnp.stack(a), *weights)


def quantize(w, method: str, group_size: int = 32, symmetric: bool = True) -> QuantizedWeight:
    """method: "int8" (per channel) | "int4" (group-wise, packed)."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, group_size, symmetric)
    raise ValueError(f"{method=} must be int8 or int4")


# ---------------------------------------------------------------------------------------------
# GGUF import: Q8_0 / Q4_0 / Q4_1 blocks -> QuantizedWeight, integer ops only (no float round trip)

GGUF_QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
_GGUF_BLOCK = 32


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Raw GGUF bytes of a 2-D tensor -> the `[K, N]` (transposed) QuantizedWeight.

    data: u8[N, K / 32 * bytes_per_block] as `gguf.GGUFReader` gives it (rows = output channels);
    type_name: "Q8_0" | "Q4_0" | "Q4_1"; shape: (N, K), the numpy shape of the float tensor
    (GGUF's `tensor.shape` reversed). Scales and minimums keep their f16 storage.
    """
    if type_name not in GGUF_QUANT_TYPES:
        raise ValueError(f"{type_name=} must be one of {GGUF_QUANT_TYPES}")
    n, k = (int(s) for s in shape)
    if k % _GGUF_BLOCK:
        raise ValueError(f"{shape=}: K must be a multiple of {_GGUF_BLOCK}")
    num_groups = k // _GGUF_BLOCK
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, num_groups, -1)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]  # f16[N, G]
    if type_name == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)  # i8[N, K]
        return QuantizedWeight(jnp.asarray(q.T), jnp.asarray(scales.T), None, 8, _GGUF_BLOCK, (k, n))
    mins = None
    qs = blocks[..., 2:]
    if type_name == "Q4_1":
        mins = jnp.asarray(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].T)
        qs = blocks[..., 4:]
    # a GGUF block holds elements j (low nibble) and j + 16 (high nibble) in byte j
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)  # u8[N, K] nibbles
    values = pack_int4(jnp.asarray(q.T))
    return QuantizedWeight(values, jnp.asarray(scales.T), mins, 4, _GGUF_BLOCK, (k, n))


def from_gguf_tensor(tensor) -> QuantizedWeight:
    """A `gguf.GGUFReader` tensor (ReaderTensor) of type Q8_0 / Q4_0 / Q4_1 -> QuantizedWeight."""
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    if len(shape) != 2:
        raise ValueError(f"{tensor.name}: {shape=} must be 2-D")
    return from_gguf(tensor.data, tensor.tensor_type.name, shape)


def concat_output_channels(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Fuse projections along N (e.g. q, k, v -> qkv); all must share bits/group_size/symmetry."""
    first = weights[0]
    for w in weights[1:]:
        if (w.bits, w.group_size, w.shape[0], w.mins is None) != (
                first.bits, first.group_size, first.shape[0], first.mins is None):
            raise ValueError(f"cannot fuse {w!r} with {first!r}")
    cat = lambda *a: None if a[0] is None else jnp.concatenate(a, axis=-1)  # noqa: E731
    return QuantizedWeight(
        cat(*[w.values for w in weights]), cat(*[w.scales for w in weights]),
        cat(*[w.mins for w in weights]), first.bits, first.group_size,
        (first.shape[0], sum(w.shape[1] for w in weights)))


# ---------------------------------------------------------------------------------------------
# Quantizing a model: every layers.Linear of the decoder (and optionally the LM head)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """method: int8 (per output channel) | int4 (group-wise along K, packed).

    int4 re-quantization is asymmetric (Q4_1 style: scale and minimum per group) unless
    symmetric=True (Q4_0 style). The LM head (for tied models: the shared embedding table) is
    quantized only when quantize_lm_head, as lm_head_method: int8 by default, like llama.cpp's
    Q4 files keep token_embd at Q8_0 (on SmolLM2 an int4-g32 head cost +7.5% perplexity, an
    int8 one nothing measurable). GGUF tensors are kept as stored when their type is the
    requested kind (Q8_0 for int8; Q4_0 / Q4_1 for int4 with group 32).
    """

    method: str
    group_size: int = 32
    symmetric: bool = False
    quantize_lm_head: bool = False
    lm_head_method: str = "int8"

    def __post_init__(self):
        for name in ("method", "lm_head_method"):
            if getattr(self, name) not in ("int8", "int4"):
                raise ValueError(f"{name}={getattr(self, name)!r} must be int8 or int4")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size} must be one of {INT4_GROUP_SIZES}")

    @classmethod
    def from_engine_config(cls, ec) -> "QuantConfig | None":
        if ec.quantization is None:
            return None
        return cls(ec.quantization, group_size=ec.quant_group_size,
                   quantize_lm_head=ec.quantize_lm_head)

    def quantize(self, w) -> QuantizedWeight:
        if self.method == "int8":
            return quantize_int8(w)
        return quantize_int4(w, self.group_size, self.symmetric)

    def accepts_gguf(self, type_name: str) -> bool:
        """A GGUF tensor type loaded as it is (no float round trip) under this config."""
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


def quantize_model(model, qconfig: QuantConfig, gguf_tensors=None):
    """Replace the model's float Linear (and, if asked, the LM head / tied embedding) by quantized
    ones, in place; returns the model. Float weights are quantized on the device; with
    `gguf_tensors` (models.gguf_file.GGUFTensors) Q8_0 / Q4_0 / Q4_1 tensors that fit `qconfig`
    are taken as they are stored (bit-exact with the file), the rest are re-quantized."""
    from flax import nnx

    from jaxinfer.models.layers import Embed, Linear, QuantizedEmbed, QuantizedLinear

    num_layers = model.config.num_layers
    head_config = dataclasses.replace(qconfig, method=qconfig.lm_head_method)
    for path, module in list(nnx.iter_modules(model)):
        if not path:
            continue
        parent = model
        for key in path[:-1]:
            parent = getattr(parent, key)
        is_head = path == ("lm_head",)
        if type(module) is Linear and (not is_head or qconfig.quantize_lm_head):
            qw = None
            if gguf_tensors is not None and path[0] == "layers" and path[1:] in _LAYER_LINEAR_SOURCES:
                names = [tuple(f"model.layers.{i}.{n}" for n in _LAYER_LINEAR_SOURCES[path[1:]])
                         for i in range(num_layers)]
                qw = _gguf_linear(gguf_tensors, names, qconfig)
            elif gguf_tensors is not None and is_head:
                qw = _gguf_linear(gguf_tensors, [("lm_head.weight",)], head_config)
            if qw is None:
                qw = (head_config if is_head else qconfig).quantize(module.weight[...])
            setattr(parent, path[-1], QuantizedLinear(qw, module.bias, dtype=module.dtype))
        elif (type(module) is Embed and path == ("embed_tokens",) and qconfig.quantize_lm_head
              and model.lm_head is None):  # tied: the table is the LM head
            qw = None
            if gguf_tensors is not None:
                qw = _gguf_linear(gguf_tensors, [("model.embed_tokens.weight",)], head_config)
            if qw is None:
                qw = head_config.quantize(module.embedding[...].T)
            setattr(parent, path[-1], QuantizedEmbed(qw, dtype=module.dtype))
    return model
