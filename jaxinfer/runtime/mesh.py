"""The device mesh of one engine (a `tp` axis) and the free memory its KV pool is sized from.

An engine runs on a group of devices: the first `tensor_parallel_size` devices, or the group a
data-parallel replica was given (jaxinfer/engine/replicas.py). Its weights and KV cache are placed
on a `jax.sharding.Mesh` with one axis, `tp`, over that group (jaxinfer/runtime/sharding.py), and
XLA's SPMD partitioner (GSPMD) splits the jitted step over it, except for the attention kernels,
which run once per device on its own heads (jaxinfer/ops/sharded.py), and the quantized-matmul
kernels, on its own share of the codes (jaxinfer/ops/sharded_matmul.py): no communication code
of our own beyond their psum.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxinfer.ops.sharded import TP_AXIS  # the axis the per-device attention kernels name


def device_group(tensor_parallel_size: int, replica: int = 0) -> list[jax.Device]:
    """The `replica`-th group of `tensor_parallel_size` consecutive devices of `jax.devices()`."""
    devices = jax.devices()
    lo, hi = replica * tensor_parallel_size, (replica + 1) * tensor_parallel_size
    if hi > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x {replica + 1} replica(s) needs {hi} "
            f"devices; {len(devices)} are visible ({jax.default_backend()}). On a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={hi} before jax is imported")
    return list(devices[lo:hi])


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis mesh (`tp`) over `devices`, in that order."""
    return Mesh(np.asarray(list(devices), dtype=object), (TP_AXIS,))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[TP_AXIS])


def smallest_free_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The free memory of the group's emptiest device (what each device's share of the KV pool
    must fit in). Devices without memory stats (the CPU, fake devices included) share the host's
    available RAM: each visible device is given an equal part of it, so engines on disjoint
    groups (data-parallel replicas) never count the same RAM twice. With several processes, the
    smallest over all of them (each process measures its own devices). None when nothing is
    known."""
    local = _local_smallest_free_bytes([d for d in devices if d.process_index == jax.process_index()])
    if jax.process_count() == 1:
        return local
    # several processes: every one must size the same pool, so all take the smallest (in MiB:
    # int32 on the wire, as JAX keeps 64-bit values off by default)
    mib = np.array(-1 if local is None else local // 2**20, np.int32)
    known = [int(v) for v in np.asarray(multihost_utils.process_allgather(mib)).reshape(-1)
             if v >= 0]
    return min(known) * 2**20 if known else None


def _local_smallest_free_bytes(devices: Sequence[jax.Device]) -> int | None:
    frees = []
    for dev in devices:
        try:
            stats = dev.memory_stats()
        except Exception:  # noqa: BLE001 - not every backend implements it
            stats = None
        if stats and "bytes_limit" in stats:
            frees.append(int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    if len(frees) == len(devices) and frees:
        return min(frees)
    ram = available_ram()
    return None if ram is None else ram // max(len(jax.local_devices()), 1)


def available_ram() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def engine_mesh(tensor_parallel_size: int,
                devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """The mesh an engine places its state on: over `devices` when given (a data-parallel
    replica's group, whose size must be `tensor_parallel_size`), else over the first
    `tensor_parallel_size` devices; None for one device and no group (the default device)."""
    if devices is None:
        if tensor_parallel_size == 1:
            return None
        devices = device_group(tensor_parallel_size)
    if len(devices) != tensor_parallel_size:
        raise ValueError(f"{len(devices)} devices given for tensor_parallel_size="
                         f"{tensor_parallel_size}")
    return make_mesh(devices)
