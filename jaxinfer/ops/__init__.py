"""The dispatch seam between the model and its kernels: which implementation runs each op.

    write_kv                 the step's new K/V into the paged cache (in place under donation)
    ragged_paged_attention   the step's attention over the paged cache
    quantized_matmul         x @ an int8 / int4 `QuantizedWeight`

`backend` is "pallas" (pallas_kernels/, interpreted off the GPU), "cpu" (cpu_kernels/: C++ kernels
compiled on first use, the production path on a CPU), "xla" (plain jnp, everywhere) or "auto",
resolved by `resolve_backend` alone: Pallas on a GPU, the C++ kernels on a CPU where they build,
XLA otherwise. A kernel that cannot handle a case raises NotImplementedError and the op runs on the
XLA path with a warning, so every platform runs everything. Ops without a kernel for a backend
(writing the cache on "cpu") run on the XLA path, which is what that
backend wants there. The implementations live beside this module (`xla_attention.py`,
`kv_cache.py`) and in `pallas_kernels/`, `cpu_kernels/` and `jaxinfer/quant/xla.py`.

With a tensor-parallel `mesh` (tp > 1), `write_kv` and `ragged_paged_attention` on "cpu" and
"pallas" run once per device on its own heads under `jax.shard_map` (`sharded.py`): the kernels
are custom calls XLA's partitioner cannot split (the "cpu" cache write, an XLA scatter, goes
with them and stays local). On "xla" the partitioner splits both by head itself. So does
`quantized_matmul` for a layer placed split by column or row (`sharded_matmul.py`): each device
multiplies by its own share of the codes.
"""

from __future__ import annotations

import functools
import typing
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.config import Backend
from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache, quantize_kv
from jaxinfer.ops.sharded import attention_per_shard, num_shards, write_kv_per_shard
from jaxinfer.ops.sharded_matmul import matmul_per_shard
from jaxinfer.ops.xla_attention import ragged_paged_attention_xla
from jaxinfer.quant import QuantizedWeight
from jaxinfer.quant import quantized_matmul as quantized_matmul_xla
from cpu_kernels import quant_matmul as cpu_quant
from cpu_kernels import ragged_paged_attention as cpu_attention
from pallas_kernels.kv_write import write_kv as write_kv_pallas
from pallas_kernels.kv_write import write_kv_reference as write_kv_xla
from pallas_kernels.quant_matmul import quant_matmul as quant_matmul_pallas
from pallas_kernels.ragged_paged_attention import \
    ragged_paged_attention as ragged_paged_attention_pallas

BACKENDS: tuple[str, ...] = typing.get_args(Backend)
# A quantized matmul on the "cpu" backend reads the packed weight in the C++ kernel; without
# AVX-512 only up to this many rows of x (a memory-bound product of a decode step), or
# cpu_quant.dense_faster_above_rows() where that is more, above which the weight is dequantized
# for XLA's dense matmul, or its float copy used where the layer keeps one (docs/performance.md).
CPU_QUANT_KERNEL_MAX_ROWS = 64


def cpu_keeps_dense_copy() -> bool:
    """Whether a layer quantized for the "cpu" backend should keep its float weight beside the
    codes: only where a dense matmul beats the C++ kernel for many rows (no AVX-512)."""
    return cpu_quant.dense_faster_above_rows() is not None


def cpu_code_stride(qweight: QuantizedWeight) -> int:
    """The row stride (columns) at which the "cpu" backend's int8-activation kernel reads a
    weight fastest (`QuantizedWeight.padded`): N, or N + 64 where N / 64 is even
    (cpu_quant.padded_stride); N for an int4 layout the kernels do not take (its product runs
    on the XLA path)."""
    k, n = qweight.shape
    takes = cpu_quant.takes_layout(k, qweight.bits, qweight.group_size)
    return cpu_quant.padded_stride(n) if takes else n


def cpu_int8_activations_fast() -> bool:
    """Whether this CPU multiplies int8 activations faster than float ones (cpu_quant)."""
    return cpu_quant.int8_activations_fast()


def resolve_backend(backend: str) -> str:
    """"pallas", "cpu" or "xla" for a backend setting ("auto": Pallas on a GPU, the C++ kernels
    on a CPU when they build there, else XLA)."""
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} must be one of {BACKENDS}")
    if backend == "auto":
        platform = jax.default_backend()
        if platform == "gpu":
            return "pallas"
        return "cpu" if platform == "cpu" and cpu_attention.available() else "xla"
    if backend == "cpu" and not cpu_attention.available():
        raise ValueError("backend='cpu' needs the CPU kernels, which do not build here (a C++ "
                         "compiler and a CPU platform); use 'xla'")
    return backend


def head_major_cache(backend: str) -> bool:
    """Whether a step on this backend keeps its KV cache head-major (ops.kv_cache.KVCache): the
    CPU kernels read it so, the XLA path and the Pallas kernels token-major."""
    return resolve_backend(backend) == "cpu"


def cache_page_size(cache: KVCache, backend: str) -> int:
    """Tokens per page of a cache the step on `backend` reads (its layout: `head_major_cache`)."""
    return cache.k.shape[4] if head_major_cache(backend) else cache.k.shape[2]


def register_cpu_kernels() -> None:
    """Registers the C++ kernels' custom-call handlers (on a CPU, where they build), as tracing a
    step that uses one does: an executable loaded from disk was never traced in this process and
    would otherwise find no handler for its custom calls."""
    if jax.default_backend() == "cpu":
        cpu_attention.available()
        cpu_quant.available()


def unrolled_layers_faster() -> bool:
    """Whether a step should run the decoder layers unrolled (`LlamaForCausalLM.unroll_layers`):
    on the CPU, where a layer scan copies every layer's weights out of the stacked arrays before
    its matmuls, i.e. the whole model once per step. Elsewhere the scan stays (one traced body:
    faster compiles)."""
    return jax.default_backend() == "cpu"


def _interpret() -> bool:
    """Pallas kernels run compiled on a GPU and in interpret mode everywhere else."""
    return jax.default_backend() != "gpu"


def _fall_back(op: str, e: NotImplementedError) -> None:
    warnings.warn(f"pallas {op} unavailable for this case ({e}); using the XLA path", stacklevel=3)


def write_kv(cache: KVCache, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
             backend: str = "auto", mesh: Mesh | None = None) -> KVCache:
    """Writes this step's K/V at [layer, slot // page_size, slot % page_size] (in place under
    donation). layer: i32[] (may be traced); k, v: [T, Hkv, D]; slot_mapping: i32[T]. An int8
    cache gets each token's K/V quantized per head and its scales written at the same place.
    `mesh`: the tensor-parallel mesh the cache is split over by KV head (None: one device)."""
    if not cache.quantized:
        k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    backend = resolve_backend(backend)
    write = functools.partial(_write_kv_local, backend=backend)
    if backend != "xla" and num_shards(mesh) > 1:
        return write_kv_per_shard(write, mesh, cache, layer, k, v, slot_mapping,
                                  head_major=head_major_cache(backend))
    return write(cache, layer, k, v, slot_mapping)


def _write_kv_local(cache: KVCache, layer, k, v, slot_mapping, *, backend: str) -> KVCache:
    if backend == "cpu":
        return _write_kv_head_major(cache, layer, k, v, slot_mapping)
    args = (cache.k, cache.v, layer, k, v, slot_mapping)
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    if backend == "pallas":
        try:
            return KVCache(*write_kv_pallas(*args, **scales, interpret=_interpret()))
        except NotImplementedError as e:
            _fall_back("write_kv", e)
    return KVCache(*write_kv_xla(*args, **scales))


def _write_kv_head_major(cache: KVCache, layer, k, v, slot_mapping) -> KVCache:
    """The XLA scatter into a head-major cache (K [L, N, Hkv, D, ps], V [L, N, Hkv, ps, D])."""
    page_size = cache.k.shape[4]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size  # i32[T]
    if not cache.quantized:  # k, v: [T, Hkv, D]; the indexed dims come first: [T, Hkv, D] both
        return KVCache(k=cache.k.at[layer, pages, :, :, offsets].set(k),
                       v=cache.v.at[layer, pages, :, offsets, :].set(v))
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)  # int8[T, Hkv, D], f32[T, Hkv]
    return KVCache(k=cache.k.at[layer, pages, :, :, offsets].set(kq),
                   v=cache.v.at[layer, pages, :, offsets, :].set(vq),
                   k_scale=cache.k_scale.at[layer, pages, :, offsets].set(ks),
                   v_scale=cache.v_scale.at[layer, pages, :, offsets].set(vs))


def ragged_paged_attention(q, k_cache, v_cache, layer, md: AttentionMetadata, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           backend: str = "auto", k_scale=None, v_scale=None,
                           mesh: Mesh | None = None) -> jax.Array:
    """Causal attention of a flat ragged batch of new tokens over the paged cache.

    q: [T, Hq, D]; k_cache, v_cache: the whole stacked cache, token-major [L, N, ps, Hkv, D], or
    head-major on the "cpu" backend (KVCache); layer: i32[]; returns [T, Hq, D] in q.dtype.
    k_scale, v_scale: exactly when the caches are int8. Rows of padding tokens (past
    cu_q_lens[-1]) are zero. `mesh`: the tensor-parallel mesh q and the cache are split over by
    head (None: one device); the result is split the same way.
    """
    if (k_scale is None) != (v_scale is None) or (k_scale is None) != (k_cache.dtype != "int8"):
        raise ValueError(f"{k_cache.dtype=}: k_scale and v_scale must be given exactly for int8 "
                         f"caches ({k_scale is None=}, {v_scale is None=})")
    backend = resolve_backend(backend)
    attend = functools.partial(_attention_local, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, backend=backend)
    if backend != "xla" and num_shards(mesh) > 1:
        return attention_per_shard(attend, mesh, q, k_cache, v_cache, layer, md, k_scale, v_scale,
                                   head_major=head_major_cache(backend))
    return attend(q, k_cache, v_cache, layer, md, k_scale, v_scale)


def _attention_local(q, k_cache, v_cache, layer, md: AttentionMetadata, k_scale, v_scale, *,
                     sm_scale: float, sliding_window: int | None, soft_cap: float | None,
                     backend: str) -> jax.Array:
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                   k_scale=k_scale, v_scale=v_scale)
    if backend == "cpu":  # a head-major cache: no XLA fallback reads it
        return cpu_attention.ragged_paged_attention(
            q, k_cache, v_cache, layer, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            **options)
    if backend == "pallas":
        try:
            return ragged_paged_attention_pallas(
                q, k_cache, v_cache, layer, md.kv_lens, md.page_indices, md.cu_q_lens,
                md.num_seqs, interpret=_interpret(), **options)
        except NotImplementedError as e:
            _fall_back("ragged_paged_attention", e)
    return ragged_paged_attention_xla(q, k_cache, v_cache, layer, md, **options)


def quantized_matmul(x: jax.Array, qweight: QuantizedWeight, *, backend: str = "auto",
                     dense: jax.Array | None = None, mesh: Mesh | None = None,
                     split: str | None = None, int8_activations: bool = False,
                     num_rows: jax.Array | None = None) -> jax.Array:
    """x: [..., K] @ a QuantizedWeight [K, N] (int8 / int4, one matrix) -> [..., N] in x.dtype.
    "pallas": the Pallas kernel; "cpu": the C++ kernel for a few rows, else the weight
    dequantized by the C++ kernel and XLA's matmul; "xla": dequantized inside the jit. A layout a
    kernel does not take (e.g. int4 g128 with K/2 not a multiple of 128) runs on the XLA path.
    `dense` (the same weight in float, [K, N]): on "cpu", products of more rows than
    cpu_quant.dense_faster_above_rows() use it instead of the codes. `mesh`, `split`: the
    tensor-parallel mesh the weight is placed on and how ("column" / "row",
    sharded_matmul.py); on "cpu" and "pallas" each device then multiplies by its own share
    (a "column" result is split by column, a "row" result summed over the devices).
    `int8_activations` (the "cpu" backend): x rounded to int8 per group and integer products at
    every row count (cpu_quant.quant_matmul_q8_reference); other backends ignore it.
    `num_rows` (i32[], traced): x's rows (flattened to [M, K]) beyond the first num_rows are a
    step's padding; the "cpu" kernels then multiply only the real ones and give zero rows for
    the rest (on one device; other paths compute every row, and nothing reads those rows)."""
    backend = resolve_backend(backend)
    matmul = functools.partial(_quantized_matmul_local, backend=backend,
                               int8_activations=int8_activations)
    if backend != "xla" and split is not None and num_shards(mesh) > 1:
        return matmul_per_shard(matmul, mesh, x, qweight, dense, split)
    return matmul(x, qweight, dense, num_rows=num_rows)


def _quantized_matmul_local(x: jax.Array, qweight: QuantizedWeight, dense: jax.Array | None, *,
                            backend: str, int8_activations: bool = False,
                            num_rows: jax.Array | None = None) -> jax.Array:
    k, n = qweight.shape
    rows = x.reshape(-1, k) if x.shape[-1] == k else None  # [M, K]
    if int8_activations and backend == "cpu" and qweight.values.ndim == 2 and rows is not None:
        q = qweight  # every row count through the same kernel: a row's result never depends on M
        try:
            y = cpu_quant.quant_matmul(rows, q.values, q.scales, q.mins, bits=q.bits,
                                       group_size=q.group_size, int8_activations=True,
                                       num_rows=num_rows, columns=n)
            return y.reshape(*x.shape[:-1], n)
        except NotImplementedError as e:  # this layout: x stays float (the kernel below)
            warnings.warn(f"int8 activations unavailable for this weight ({e}); x stays float32 "
                          "for it", stacklevel=3)
    dense_above = cpu_quant.dense_faster_above_rows() if backend == "cpu" else None
    if dense is not None and dense_above is not None and rows is not None and \
            rows.shape[0] > dense_above:
        return jnp.dot(rows, dense.astype(rows.dtype)).reshape(*x.shape[:-1], n)
    if backend == "cpu" and qweight.values.ndim == 2 and rows is not None:
        q = qweight
        try:
            if dense_above is None or rows.shape[0] <= max(CPU_QUANT_KERNEL_MAX_ROWS, dense_above):
                y = cpu_quant.quant_matmul(rows, q.values, q.scales, q.mins, bits=q.bits,
                                           group_size=q.group_size, num_rows=num_rows, columns=n)
            else:
                w = cpu_quant.dequantize(q.values, q.scales, q.mins, bits=q.bits,
                                         group_size=q.group_size, k=k, columns=n)  # f32[K, N]
                y = jnp.dot(rows, w.astype(rows.dtype))
            return y.reshape(*x.shape[:-1], n)
        except NotImplementedError as e:
            _fall_back("quant_matmul (cpu)", e)
    qweight = qweight.unpadded()  # the paths below take rows of exactly N columns
    if backend == "pallas" and qweight.values.ndim == 2 and rows is not None:
        try:
            y = quant_matmul_pallas(rows, qweight.values, qweight.scales, qweight.mins,
                                    bits=qweight.bits, group_size=qweight.group_size,
                                    interpret=_interpret())  # [M, N]
            return y.reshape(*x.shape[:-1], n)
        except NotImplementedError as e:
            _fall_back("quant_matmul", e)
    return quantized_matmul_xla(x, qweight)


__all__ = ["BACKENDS", "AttentionMetadata", "KVCache", "quantized_matmul", "ragged_paged_attention",
           "cpu_keeps_dense_copy", "resolve_backend", "unrolled_layers_faster", "write_kv"]
