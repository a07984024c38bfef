"""GGUF import: Q8_0 / Q4_0 / Q4_1 blocks -> `QuantizedWeight`, integer ops only (no float round trip)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.format import QuantizedWeight, pack_int4


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

