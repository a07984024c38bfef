"""The column order of the fused projections under tensor parallelism, and the split that reads it.

`qkv_proj` ([hidden, (Hq + 2 Hkv) D]) and `gate_up_proj` ([hidden, 2 I]) are fused: one matmul
each. Their natural column order is [q | k | v] and [gate | up]. Tensor parallelism over `s`
devices shards these weights by output column in `s` contiguous blocks, so each block must hold
one device's own heads: the columns are reordered shard-major, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
and [gate_0 up_0 | gate_1 up_1 | ...], where block i holds query heads i Hq/s .. (i+1) Hq/s - 1,
KV heads i Hkv/s .. (i+1) Hkv/s - 1 (the KV heads those query heads read under GQA) and
intermediate channels i I/s .. (i+1) I/s - 1 (the rows of `down_proj` device i holds).

`qkv_column_order` / `gate_up_column_order` give the permutation (applied once to the weights,
jaxinfer/runtime/sharding.py); `split_qkv` / `split_gate_up` undo it on the activations inside
the step. With s = 1 both are the natural order and the splits are plain slices.

An int4 weight split by row (o_proj, down_proj) over `s` devices whose quantized matmul runs per
device (ops/sharded_matmul.py) needs each device's K / s rows packed as a matrix of their own:
the natural packing pairs row i with row K/2 + i (quant/format.py), two rows on different
devices. `int4_rows_packed_per_shard` repacks the codes once (the scales, per group of K, keep
their order), so device j's packed rows j K/2s .. (j+1) K/2s - 1 hold its rows j K/s .. in the
natural packing of a [K/s, N] matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.format import pack_int4, unpacked_int4


def qkv_column_order(num_heads: int, num_kv_heads: int, head_dim: int, shards: int) -> np.ndarray:
    """i32[(Hq + 2 Hkv) D]: new column j reads old column order[j] (shard-major q, k, v)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = np.arange(q_size).reshape(shards, -1)  # [s, Hq/s D]
    k = q_size + np.arange(kv_size).reshape(shards, -1)  # [s, Hkv/s D]
    v = q_size + kv_size + np.arange(kv_size).reshape(shards, -1)
    return np.concatenate([q, k, v], axis=1).reshape(-1).astype(np.int32)


def gate_up_column_order(intermediate_size: int, shards: int) -> np.ndarray:
    """i32[2 I]: new column j reads old column order[j] (shard-major gate, up)."""
    gate = np.arange(intermediate_size).reshape(shards, -1)  # [s, I/s]
    up = intermediate_size + gate
    return np.concatenate([gate, up], axis=1).reshape(-1).astype(np.int32)


def split_qkv(qkv: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int,
              shards: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[T, (Hq + 2 Hkv) D] in `qkv_column_order(.., shards)` -> q [T, Hq, D], k, v [T, Hkv, D]."""
    t = qkv.shape[0]
    hq, hkv = num_heads // shards, num_kv_heads // shards
    blocks = qkv.reshape(t, shards, (hq + 2 * hkv) * head_dim)  # [T, s, (Hq/s + 2 Hkv/s) D]
    q = blocks[:, :, :hq * head_dim].reshape(t, num_heads, head_dim)
    k = blocks[:, :, hq * head_dim:(hq + hkv) * head_dim].reshape(t, num_kv_heads, head_dim)
    v = blocks[:, :, (hq + hkv) * head_dim:].reshape(t, num_kv_heads, head_dim)
    return q, k, v


def split_gate_up(gate_up: jax.Array, intermediate_size: int,
                  shards: int) -> tuple[jax.Array, jax.Array]:
    """[T, 2 I] in `gate_up_column_order(.., shards)` -> gate, up [T, I]."""
    t = gate_up.shape[0]
    blocks = gate_up.reshape(t, shards, 2, intermediate_size // shards)  # [T, s, 2, I/s]
    return (blocks[:, :, 0].reshape(t, intermediate_size),
            blocks[:, :, 1].reshape(t, intermediate_size))


def int4_rows_packed_per_shard(values: jax.Array, k: int, shards: int) -> jax.Array:
    """u8[..., K/2, N] naturally packed -> u8[..., K/2, N] whose `shards` blocks of K/2s packed
    rows are each the natural packing of the block's own K/s rows (K a multiple of 2 shards)."""
    if k % (2 * shards):
        raise ValueError(f"K={k} must be a multiple of 2 x {shards} shards")
    q = unpacked_int4(values, k)  # u8[..., K, N] nibbles
    rows = k // shards
    blocks = [pack_int4(q[..., j * rows:(j + 1) * rows, :]) for j in range(shards)]
    return jnp.concatenate(blocks, axis=-2)  # u8[..., K/2, N]
