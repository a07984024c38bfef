"""The attention kernels under tensor parallelism: each device runs them on its own heads.

The C++ CPU kernels and the Pallas kernels are custom calls that XLA's SPMD partitioner (GSPMD)
cannot split: left to it, every device would gather the whole KV cache and run the kernel over all
heads. With a `tp` mesh they run instead under `jax.shard_map`, once per device on its local
heads, which is exact because attention never mixes heads:

    argument                        inside each device's call
    q [T, Hq, D]                    its Hq / tp query heads (P(None, "tp", None))
    K/V cache (and int8 scales)     its Hkv / tp KV heads of every page (`kv_cache_spec`, the
                                    placement runtime/sharding.py gives the cache)
    layer, AttentionMetadata        replicated (the page table and lengths are the same for all)
    new k, v [T, Hkv, D]            its KV heads
    output [T, Hq, D]               its query heads: o_proj's rows, sharded the same way, take it
                                    as it is (one all-reduce after o_proj, as without kernels)

Query heads stay with the KV heads they read under GQA because both are split into `tp`
contiguous blocks (models/tp_layout.py puts qkv_proj's columns in that order). The XLA path is not
wrapped: GSPMD splits plain jnp attention by head by itself.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache

TP_AXIS = "tp"  # the mesh axis of tensor parallelism (runtime/mesh.py builds meshes with it)


def num_shards(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[TP_AXIS])


def kv_cache_spec(ndim: int, head_major: bool) -> P:
    """K/V [L, N, ps, Hkv, D] or head-major [L, N, Hkv, D|ps, ps|D], scales one dim less:
    the KV-head axis over `tp`."""
    axis = 2 if head_major else 3
    return _on_axis(ndim, axis)


def _on_axis(ndim: int, axis: int) -> P:
    return P(*([None] * axis + [TP_AXIS] + [None] * (ndim - axis - 1)))


def _cache_specs(cache: KVCache, head_major: bool) -> KVCache:
    return jax.tree.map(lambda x: kv_cache_spec(x.ndim, head_major), cache)  # None scales stay


def write_kv_per_shard(write: Callable[..., KVCache], mesh: Mesh, cache: KVCache, layer,
                       k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
                       head_major: bool) -> KVCache:
    """`write(cache, layer, k, v, slot_mapping)` on each device's KV heads. cache: sharded by KV
    head; layer: i32[]; k, v: [T, Hkv, D]; slot_mapping: i32[T]."""
    specs = _cache_specs(cache, head_major)
    heads = _on_axis(3, 1)
    return jax.shard_map(write, mesh=mesh, in_specs=(specs, P(), heads, heads, P()),
                         out_specs=specs, check_vma=False)(cache, layer, k, v, slot_mapping)


def attention_per_shard(attend: Callable[..., jax.Array], mesh: Mesh, q: jax.Array,
                        k_cache: jax.Array, v_cache: jax.Array, layer, md: AttentionMetadata,
                        k_scale: jax.Array | None, v_scale: jax.Array | None, *,
                        head_major: bool) -> jax.Array:
    """`attend(q, k_cache, v_cache, layer, md, k_scale, v_scale)` -> [T, Hq, D] on each
    device's heads; the result is sharded by query head."""
    cache = KVCache(k_cache, v_cache, k_scale, v_scale)
    heads = _on_axis(3, 1)

    def local(q, cache, layer, md):
        return attend(q, cache.k, cache.v, layer, md, cache.k_scale, cache.v_scale)

    in_specs = (heads, _cache_specs(cache, head_major), P(), P())
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=heads,
                         check_vma=False)(q, cache, layer, md)
