"""Quantized matmuls under tensor parallelism: each device multiplies by its own share of the weight.

The C++ CPU kernel and the Pallas kernel are custom calls that XLA's SPMD partitioner cannot
split: left to it, every device would gather the whole weight and multiply by all of it. With a
`tp` mesh a layer whose split is exact (`split_problem` returns None) runs instead under
`jax.shard_map`, once per device on its local codes, in the placement runtime/sharding.py gives
the weight (so nothing is gathered):

    split     layers                       x [M, K]            weight [K, N]       output [M, N]
    COLUMN    qkv_proj, gate_up_proj,      replicated          its N / tp columns  its columns
              lm_head (by vocabulary)                                              (no collective)
    ROW       o_proj, down_proj            its K / tp columns  its K / tp rows     partial sums,
                                                                                   psum over "tp"

A row split's psum inside the shard_map is the layer's one all-reduce, the one GSPMD would insert
after a float o_proj / down_proj: still 2 all-reduces per decoder layer. Each device's rows must
be a quantized matrix of their own: groups (of K) may not straddle devices, and for int4 the
device's rows must be packed on their own, low and high halves of its K / tp rows
(models/tp_layout.py repacks a row-split int4 weight so at load time; the natural packing pairs
row i with row K/2 + i, which live on different devices). Inside the shard_map the local product
is `ops.quantized_matmul` on one device, so a local layout a kernel does not take runs on the
XLA path there, still on the device's own share.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxinfer.ops.sharded import TP_AXIS
from jaxinfer.quant import QuantizedWeight

COLUMN, ROW = "column", "row"
SPLITS = (COLUMN, ROW)


def split_problem(split: str, bits: int, group_size: int, shape: tuple[int, int],
                  shards: int) -> str | None:
    """Why the [K, N] weight (`bits`, `group_size` rows of K per scale) cannot run per device
    split `split` over `shards` devices exactly; None when it can."""
    k, n = shape
    if split == COLUMN:
        return None if n % shards == 0 else f"N={n} is not a multiple of tp={shards}"
    if split != ROW:
        raise ValueError(f"{split=} must be one of {SPLITS}")
    rows = k // shards
    if k % shards or (bits == 4 and rows % 2):
        return f"K={k} does not split into tp={shards} {'even ' if bits == 4 else ''}row blocks"
    per_channel = bits == 8 and group_size >= k  # one scale per column: the blocks share it
    if not per_channel and rows % group_size:
        return f"a block of K / tp = {rows} rows is not whole groups of {group_size}"
    return None


def local_weight(qweight: QuantizedWeight, split: str, shards: int) -> tuple[int, int, int]:
    """(K, N, group_size) of one device's share of a weight split `split` over `shards`."""
    k, n = qweight.shape
    if split == COLUMN:
        return k, n // shards, qweight.group_size
    rows = k // shards
    return rows, n, rows if qweight.group_size >= k else qweight.group_size


def _row_specs(qweight: QuantizedWeight) -> tuple[P, P]:
    """(codes, scales) of a row split: codes by (packed) row, scales by group; a per-channel
    int8 weight's one row of scales is replicated (placed so: 1 group does not divide)."""
    return P(TP_AXIS, None), (P(TP_AXIS, None) if qweight.num_groups > 1 else P())


def matmul_per_shard(matmul: Callable[..., jax.Array], mesh: Mesh, x: jax.Array,
                     qweight: QuantizedWeight, dense: jax.Array | None,
                     split: str) -> jax.Array:
    """`matmul(x, qweight, dense)` on each device's share (the table in the module docstring).
    x: [..., K]; qweight: [K, N], placed split by `split` (int4 rows repacked per device for
    ROW); dense: the float weight [K, N] placed like the codes, or None. -> [..., N], split by
    column (COLUMN) or replicated (ROW)."""
    shards = int(mesh.shape[TP_AXIS])
    problem = split_problem(split, qweight.bits, qweight.group_size, qweight.shape, shards)
    if problem is not None:
        raise ValueError(f"{qweight!r} cannot run split by {split} over tp={shards}: {problem}")
    if qweight.values.ndim != 2:
        raise ValueError(f"{qweight.values.shape=} must be 2-D (slice stacked layers first)")
    k, n, group_size = local_weight(qweight, split, shards)
    lead = (None,) * (x.ndim - 1)
    if split == COLUMN:
        x_spec, codes, scales, out_spec = P(), P(None, TP_AXIS), P(None, TP_AXIS), \
            P(*lead, TP_AXIS)
    else:
        (codes, scales), x_spec, out_spec = _row_specs(qweight), P(*lead, TP_AXIS), P()

    def local(x, values, scales, mins, dense):
        # x: [..., k]; values: i8[k, n] | u8[k / 2, n]; scales, mins: [ceil(k / gs), n]
        w = QuantizedWeight(values, scales, mins, qweight.bits, group_size, (k, n))
        y = matmul(x, w, dense)  # [..., n]
        return jax.lax.psum(y, TP_AXIS) if split == ROW else y

    in_specs = (x_spec, codes, scales, scales, codes)  # mins like scales, dense like codes
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                         check_vma=False)(x, qweight.values, qweight.scales, qweight.mins, dense)
