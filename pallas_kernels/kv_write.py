"""Write the step's new K/V into their cache slots, in place; the int8 KV format.

`write_kv` is a Pallas kernel whose cache outputs alias its cache inputs (`input_output_aliases`):
under a jit that donates the cache, nothing is copied and only the T new rows are touched.
`write_kv_reference` is the XLA scatter; under donation XLA also updates it in place (tested in
tests/kernels/test_kv_write.py by buffer pointer). `jaxinfer.ops.write_kv` runs this kernel on the
Pallas backend and the scatter on the XLA one.

int8 pages (`quantize_kv`): symmetric, one f32 scale per token and KV head, stored beside the
pages as `[L, N, page_size, Hkv]`; with head_dim 64/128 that is 1 + 4/D bytes per value instead of
2 (bf16): 53% / 52% of the bf16 cache. The format is defined here, with the kernel that writes it;
the attention kernels and the XLA path read it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention import whole_array_spec

INT8_MAX = 127.0
SCALE_DTYPE = jnp.float32  # the attention kernel reads f32 scales


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x[..., D] float -> (int8[..., D], f32[...] scale), symmetric absmax: x ~= int8 * scale.

    |x - int8 * scale| <= scale / 2 = absmax / 254 per element."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.maximum(amax, 1e-30) / INT8_MAX  # all-zero rows: scale ~0, values 0
    q = jnp.clip(jnp.round(x / scale[..., None]), -INT8_MAX, INT8_MAX)
    return q.astype(jnp.int8), scale.astype(SCALE_DTYPE)


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """int8[..., D], f32[...] -> dtype[..., D]."""
    return (q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _validate(k_cache, v_cache, layer, k, v, slot_mapping, k_scale, v_scale):
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{k_cache.shape=} {v_cache.shape=} must be equal [L, N, page_size, Hkv, D]")
    if k.ndim != 3 or v.shape != k.shape or k.shape[1:] != k_cache.shape[3:]:
        raise ValueError(f"{k.shape=} {v.shape=} must be [T, Hkv, D] matching {k_cache.shape=}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"{slot_mapping.shape=} {slot_mapping.dtype=} must be int32[{k.shape[0]}]")
    if jnp.ndim(layer) != 0:
        raise ValueError(f"{layer=} must be a scalar")
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{k_scale is None=} and {v_scale is None=} must be given together")
    if k_scale is not None:
        if k_cache.dtype != jnp.int8:
            raise ValueError(f"{k_cache.dtype=} must be int8 with scales")
        if k_scale.shape != k_cache.shape[:4] or v_scale.shape != k_cache.shape[:4]:
            raise ValueError(f"{k_scale.shape=} {v_scale.shape=} must be {k_cache.shape[:4]=}")
    elif k.dtype != k_cache.dtype:
        raise ValueError(f"{k.dtype=} must equal {k_cache.dtype=}")


def _write_kernel(layer_ref, slots_ref, k_ref, v_ref, *refs, page_size: int, quantized: bool):
    # k_ref/v_ref: [tokens, D] block; the trailing refs are the aliased cache outputs.
    tokens = k_ref.shape[0]
    i, head = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    slots = slots_ref[pl.ds(i * tokens, tokens)]  # i32[tokens]
    pages, offsets = lax.div(slots, page_size), lax.rem(slots, page_size)
    if quantized:
        ks_ref, vs_ref = refs[:2]  # f32[tokens] blocks of the new scales
        k_out, v_out, ks_out, vs_out = refs[-4:]
        ks_out[layer, pages, offsets, head] = ks_ref[...]
        vs_out[layer, pages, offsets, head] = vs_ref[...]
    else:
        k_out, v_out = refs[-2:]
    k_out[layer, pages, offsets, head, :] = k_ref[...]
    v_out[layer, pages, offsets, head, :] = v_ref[...]


@functools.partial(jax.jit, static_argnames=("interpret", "tokens_per_program", "num_warps"))
def write_kv(
    k_cache: jax.Array,  # [L, N, page_size, Hkv, D]
    v_cache: jax.Array,  # [L, N, page_size, Hkv, D]
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, Hkv, D] (float; quantised here when scales are given)
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T] page_id * page_size + offset
    k_scale: jax.Array | None = None,  # f32[L, N, page_size, Hkv] with int8 caches
    v_scale: jax.Array | None = None,
    *,
    interpret: bool | None = None,
    tokens_per_program: int = 16,
    num_warps: int | None = None,
):
    """Returns (k_cache, v_cache) or, with scales, (k_cache, v_cache, k_scale, v_scale).

    Padding tokens must point at the null page (slot 0..page_size-1), as the contract says.
    """
    _validate(k_cache, v_cache, layer, k, v, slot_mapping, k_scale, v_scale)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    quantized = k_scale is not None
    num_tokens, num_kv_heads, head_dim = k.shape
    page_size = k_cache.shape[2]
    if not interpret and head_dim & (head_dim - 1):
        raise NotImplementedError(f"{head_dim=} must be a power of two for Triton")
    tokens = min(_pow2_floor(tokens_per_program), 1 << (num_tokens - 1).bit_length())
    padded = -(-num_tokens // tokens) * tokens
    pad = padded - num_tokens
    slots = jnp.pad(slot_mapping, (0, pad))  # padding -> slot 0 (the null page)
    if quantized:
        k, ks = quantize_kv(k)
        v, vs = quantize_kv(v)
        new = [jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) for x in (k, v, ks, vs)]
        caches = [k_cache, v_cache, k_scale, v_scale]
    else:
        new = [jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (k, v)]
        caches = [k_cache, v_cache]
    row_spec = pl.BlockSpec((tokens, None, head_dim), lambda i, h: (i, h, 0))
    scale_spec = pl.BlockSpec((tokens, None), lambda i, h: (i, h))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    in_specs = [whole_array_spec((1,)), whole_array_spec(slots.shape), row_spec, row_spec]
    in_specs += [scale_spec, scale_spec] if quantized else []
    in_specs += [whole_array_spec(c.shape) for c in caches]
    first_cache = 2 + len(new)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        compiler_params = pl_triton.CompilerParams(num_warps=num_warps or 1, num_stages=1)
    return tuple(pl.pallas_call(
        functools.partial(_write_kernel, page_size=page_size, quantized=quantized),
        grid=(padded // tokens, num_kv_heads),
        in_specs=in_specs,
        out_specs=[whole_array_spec(c.shape) for c in caches],
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={first_cache + j: j for j in range(len(caches))},
        interpret=interpret,
        compiler_params=compiler_params,
        name="write_kv",
    )(layer_arr, slots, *new, *caches))


def write_kv_reference(k_cache, v_cache, layer, k, v, slot_mapping, k_scale=None, v_scale=None):
    """XLA scatter; same returns as write_kv."""
    page_size = k_cache.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    if k_scale is None:
        return (k_cache.at[layer, pages, offsets].set(k.astype(k_cache.dtype)),
                v_cache.at[layer, pages, offsets].set(v.astype(v_cache.dtype)))
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return (k_cache.at[layer, pages, offsets].set(kq), v_cache.at[layer, pages, offsets].set(vq),
            k_scale.at[layer, pages, offsets].set(ks), v_scale.at[layer, pages, offsets].set(vs))
