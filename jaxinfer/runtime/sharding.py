"""Tensor parallelism: the model's weights and the paged KV cache placed on a `tp` mesh.

Megatron-style, expressed only as shardings (jax.sharding.NamedSharding) and left to XLA's SPMD
partitioner (GSPMD) to carry out inside the one jitted step; no collective is written by hand.

    weight                           sharded over `tp` along
    qkv_proj, gate_up_proj           output columns (heads / intermediate channels), after the
                                     columns are put in shard-major order (models/tp_layout.py)
    o_proj, down_proj                input rows (XLA sums the partial products: one all-reduce)
    embed_tokens, lm_head            the vocabulary
    norms, biases of row layers      replicated
    KV cache K/V (and int8 scales)   the KV-head axis: each device holds Hkv / tp heads of every
                                     page; the page table and the host-side scheduler see one pool

Quantized weights (quant.QuantizedWeight: values, scales, mins, and the float `dense` copy where
kept) are sharded along the same axes wherever that axis divides by tp (a packed int4 row axis or
a group axis that does not is replicated instead, which is still correct, only less memory-lean).

Attention is the exception to "left to GSPMD": the C++ CPU kernels and the Pallas kernels are
custom calls that GSPMD cannot partition (it would gather the whole cache onto every device), so
with tp > 1 the model hands the mesh to `ops`, which runs the KV write and the attention kernel
once per device on its own heads under `jax.shard_map` (jaxinfer/ops/sharded.py): q and the cache
split by head, the page table and lengths replicated, the output split by query head as o_proj's
rows expect. The XLA backend's attention is plain jnp that GSPMD splits by head by itself.
The quantized-matmul kernels are custom calls too: with tp > 1 a quantized layer on the "cpu" or
"pallas" backend whose split is exact multiplies per device under `jax.shard_map` on its own
share of the codes, in the placement above (ops/sharded_matmul.py: column layers get x
replicated and return their columns, row layers get x split by its columns and psum their
partial products, the layer's one all-reduce); a row-split int4 weight's codes are packed per
device first (models/tp_layout.py). A layer whose split is not exact (groups of K that would
straddle devices, a dimension tp does not divide) runs on the XLA path, which GSPMD splits.
Speculative decoding with a draft model is not supported with tp > 1 (the draft's cache would need
the same treatment); n-gram speculation is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import Embed, QuantizedEmbed, QuantizedLinear
from jaxinfer.models.llama import MLP, Attention
from jaxinfer.models.tp_layout import (gate_up_column_order, int4_rows_packed_per_shard,
                                       qkv_column_order)
from jaxinfer.ops.kv_cache import KVCache, allocate_kv_cache
from jaxinfer.ops.sharded import kv_cache_spec
from jaxinfer.ops.sharded_matmul import COLUMN, ROW, split_problem
from jaxinfer.runtime.mesh import TP_AXIS, tp_size

_WEIGHT_ATTRS = ("weight", "bias", "values", "scales", "mins", "dense", "embedding")
_COLUMN_LAYERS = ("qkv_proj", "gate_up_proj", "lm_head")  # sharded by output column
_ROW_LAYERS = ("o_proj", "down_proj")  # sharded by input row


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """ValueError naming the counts when the model's heads cannot be split over `tp` devices."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp} must be at least 1")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the model's {name}={value} "
                f"(num_heads={config.num_heads}, num_kv_heads={config.num_kv_heads}): each device "
                "holds an equal share of the heads")


def shard_model(model: nnx.Module, config: ModelConfig, mesh: Mesh) -> nnx.Module:
    """Places `model`'s params on `mesh` (in place; returns the model): reorders the fused
    projections for `tp` shards, then device_puts every weight with its NamedSharding (the table
    in the module docstring). Idempotent. Layers are unrolled first where that is faster
    (ops.unrolled_layers_faster), so each layer's weights are placed once, already sharded."""
    tp = tp_size(mesh)
    check_tensor_parallel(config, tp)
    if ops.unrolled_layers_faster():
        model.unroll_layers()
    for path, module in list(nnx.iter_modules(model)):
        if isinstance(module, (Attention, MLP)) and module.tp_shards != tp:
            _reorder_fused_columns(module, config, tp)
    if tp > 1:
        for path, module in nnx.iter_modules(model):
            if isinstance(module, (QuantizedLinear, QuantizedEmbed)) and module.mesh != mesh:
                _split_quantized_matmul(path, module, mesh)
    for path, module in nnx.iter_modules(model):
        for attr in _WEIGHT_ATTRS:
            var = getattr(module, attr, None)
            if isinstance(var, nnx.Variable):
                spec = _weight_spec(path, module, attr, var.value.shape, tp)
                var.value = jax.device_put(var.value, NamedSharding(mesh, spec))
    # anything left (norm weights are caught above; this is for any other variable): replicated
    state = nnx.state(model)
    state = jax.tree.map(lambda x: _replicate_unplaced(x, mesh), state)
    nnx.update(model, state)
    return model


def _replicate_unplaced(x, mesh: Mesh):
    if isinstance(x, jax.Array) and not (isinstance(x.sharding, NamedSharding)
                                         and x.sharding.mesh == mesh):
        return jax.device_put(x, NamedSharding(mesh, P()))
    return x


def _reorder_fused_columns(module: nnx.Module, config: ModelConfig, tp: int) -> None:
    """Puts qkv_proj's / gate_up_proj's columns in shard-major order and records `tp_shards`."""
    if isinstance(module, Attention):
        layer = module.qkv_proj
        order = qkv_column_order(config.num_heads, config.num_kv_heads, config.head_dim, tp)
    else:
        layer = module.gate_up_proj
        order = gate_up_column_order(config.intermediate_size, tp)
    if module.tp_shards != 1:
        raise ValueError(f"{type(module).__name__} is already laid out for {module.tp_shards} "
                         f"shards; cannot re-lay it out for {tp}")
    for attr in _WEIGHT_ATTRS:
        var = getattr(layer, attr, None)
        if isinstance(var, nnx.Variable):
            if var.value.shape[-1] != order.size:  # every layout keeps output columns last
                raise ValueError(f"{type(layer).__name__}.{attr} {var.value.shape} does not end "
                                 f"in the {order.size} fused output columns")
            var.value = jnp.take(var.value, jnp.asarray(order), axis=-1)
    module.tp_shards = tp


def _split_quantized_matmul(path: tuple, module: nnx.Module, mesh: Mesh) -> None:
    """Makes a quantized layer's matmul run per device on its own share of the codes (on the
    kernels' backends: ops/sharded_matmul.py), packing a row-split int4 weight per device; or,
    where that split is not exact, on the XLA path, which GSPMD splits like any jnp op."""
    tp = tp_size(mesh)
    name = path[-1] if path else ""
    split = (ROW if name in _ROW_LAYERS else
             COLUMN if name in _COLUMN_LAYERS or isinstance(module, QuantizedEmbed) else None)
    qw = module.qweight
    problem = "not a split layer" if split is None else \
        split_problem(split, qw.bits, qw.group_size, qw.shape, tp)
    if ops.resolve_backend(module.backend) == "xla" or problem is not None:
        # e.g. int4 groups of 128 over SmolLM2's K=576 (4.5 groups) split in 2: a device's rows
        # would end inside a group, whose scale both would need (the kernels take whole groups)
        module.backend = "xla"
        return
    if module.mesh is not None:
        raise ValueError(f"{name} is already split over {module.mesh}; cannot re-split it")
    if split == ROW and qw.bits == 4:
        module.values.value = int4_rows_packed_per_shard(module.values.value, qw.shape[0], tp)
    module.mesh, module.tp_split = mesh, split


def _weight_spec(path: tuple, module: nnx.Module, attr: str, shape: tuple, tp: int) -> P:
    """The PartitionSpec of one weight leaf (see the module docstring)."""
    name = path[-1] if path else ""
    ndim = len(shape)
    axis = None
    if name in _COLUMN_LAYERS:
        axis = ndim - 1  # [..., K, N] and biases [..., N]: output columns last
    elif name in _ROW_LAYERS and attr != "bias":
        axis = ndim - 2  # [..., K, N]: K (values: packed K rows; scales/mins: groups of K)
    elif isinstance(module, QuantizedEmbed):
        axis = 0 if attr == "dense" else ndim - 1  # dense [V, H]; codes [H, V] (LM-head layout)
    elif isinstance(module, Embed) and attr == "embedding":
        axis = 0  # [V, H]
    if axis is None or shape[axis] % tp:
        return P()
    return P(*([None] * axis + [TP_AXIS] + [None] * (ndim - axis - 1)))


def allocate_sharded_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype, *,
                              head_major: bool, mesh: Mesh) -> KVCache:
    """`allocate_kv_cache`, each device allocating only its own KV heads (never the whole pool
    on one device first)."""

    def allocate():
        return allocate_kv_cache(config, num_pages, page_size, dtype, head_major=head_major)

    shapes = jax.eval_shape(allocate)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, kv_cache_spec(len(s.shape), head_major)), shapes)
    return jax.jit(allocate, out_shardings=shardings)()
