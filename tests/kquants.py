"""ggml's Q4_K and Q6_K blocks written from codes and scales, for tests.

The loader dequantizes GGUF tensors with `gguf.quants.dequantize`; checking it against that same
function proves nothing, and gguf-py cannot quantize to K-quants anyway. This module is a separate
reading of the format: it packs chosen integer codes and scales into blocks laid out as llama.cpp's
`block_q4_K` / `block_q6_K` (ggml-common.h, QK_K = 256) and computes the values those blocks stand
for straight from the codes, with the formulas of `dequantize_row_q4_K` / `dequantize_row_q6_K`
(ggml-quants.c). It never unpacks bytes, so a test that compares a loader's output with
`values(...)` fails when the loader reads a byte, nibble or scale from the wrong place.

    Q4_K, 144 bytes per 256 values:  f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
        8 sub-blocks of 32, each with a 6-bit scale sc and 6-bit min m; value = d*sc*q - dmin*m,
        q in 0..15; byte 32c + l of qs holds value 64c + l (low nibble) and 64c + 32 + l (high).
    Q6_K, 210 bytes per 256 values:  u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
        16 sub-blocks of 16, each with an 8-bit signed scale; value = d*sc*(q - 32), q in 0..63.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


class Blocks(NamedTuple):
    """The fields of n blocks of one type, unpacked (what a quantizer chooses)."""

    type_name: str
    d: np.ndarray  # f16[n]
    dmin: np.ndarray | None  # f16[n] (Q4_K), None (Q6_K)
    scales: np.ndarray  # u8[n, 8] (Q4_K, 6 bits) | i8[n, 16] (Q6_K)
    mins: np.ndarray | None  # u8[n, 8] (Q4_K, 6 bits) | None
    codes: np.ndarray  # u8[n, 256]: 0..15 (Q4_K) | 0..63 (Q6_K)


def values(b: Blocks) -> np.ndarray:
    """f32[n, 256]: what the blocks stand for (float32 arithmetic in ggml's order)."""
    n = len(b.d)
    d = b.d.astype(np.float32)[:, None]
    if b.type_name == "Q4_K":
        step = (d * b.scales.astype(np.float32))[:, :, None]  # [n, 8, 1]
        low = (b.dmin.astype(np.float32)[:, None] * b.mins.astype(np.float32))[:, :, None]
        q = b.codes.reshape(n, 8, 32).astype(np.float32)
        return (step * q - low).reshape(n, QK_K)
    step = (d * b.scales.astype(np.float32))[:, :, None]  # [n, 16, 1]
    q = b.codes.reshape(n, 16, 16).astype(np.int8) - np.int8(32)
    return (step * q.astype(np.float32)).reshape(n, QK_K)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def pack(b: Blocks) -> np.ndarray:
    """u8[n, BLOCK_BYTES]: the blocks as a GGUF file stores them."""
    n = len(b.d)
    q = b.codes.astype(np.uint8)
    if b.type_name == "Q4_K":
        sc, m = b.scales.astype(np.uint8), b.mins.astype(np.uint8)
        assert sc.max(initial=0) < 64 and m.max(initial=0) < 64 and q.max(initial=0) < 16
        packed = np.zeros((n, 12), np.uint8)
        # get_scale_min_k4: sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scale) and 4..7
        # (min); sub-blocks 4..7 as a low nibble in bytes 8..11 (scale: low half, min: high half)
        # and their top 2 bits in the top 2 bits of bytes 0..3 (scale) and 4..7 (min)
        packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
        packed[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
        pairs = q.reshape(n, 4, 2, 32)  # 64 values per chunk: 32 low nibbles, 32 high
        qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
        out = np.concatenate([_f16_bytes(b.d), _f16_bytes(b.dmin), packed, qs], axis=1)
    else:
        assert q.max(initial=0) < 64
        v = q.reshape(n, 2, 4, 32)  # per 128-value half: four runs of 32 values
        ql = np.concatenate([(v[:, :, 0] & 15) | ((v[:, :, 2] & 15) << 4),
                             (v[:, :, 1] & 15) | ((v[:, :, 3] & 15) << 4)], axis=2)  # [n, 2, 64]
        qh = ((v[:, :, 0] >> 4) | ((v[:, :, 1] >> 4) << 2) | ((v[:, :, 2] >> 4) << 4)
              | ((v[:, :, 3] >> 4) << 6))  # [n, 2, 32]
        scales = np.ascontiguousarray(b.scales.astype(np.int8)).view(np.uint8)
        out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales, _f16_bytes(b.d)],
                             axis=1)
    assert out.shape == (n, BLOCK_BYTES[b.type_name])
    return out.astype(np.uint8)


def random_blocks(type_name: str, n: int, rng: np.random.Generator) -> Blocks:
    """Blocks with every code and scale drawn at random (every bit of the layout matters)."""
    codes = rng.integers(0, 16 if type_name == "Q4_K" else 64, (n, QK_K), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, n).astype(np.float16)
    if type_name == "Q4_K":
        dmin = rng.uniform(0.001, 0.01, n).astype(np.float16)
        scales, mins = (rng.integers(0, 64, (n, 8), dtype=np.uint8) for _ in range(2))
        return Blocks(type_name, d, dmin, scales, mins, codes)
    return Blocks(type_name, d, None, rng.integers(-128, 128, (n, 16)).astype(np.int8), None, codes)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32),
                     where=b != 0)


def quantize_blocks(x: np.ndarray, type_name: str) -> Blocks:
    """A plain round-to-nearest quantizer (not llama.cpp's search) for f32[n, 256]."""
    x = np.asarray(x, np.float32)
    n = len(x)
    if type_name == "Q4_K":
        sub = x.reshape(n, 8, 32)
        lo = np.minimum(sub.min(-1), 0.0)
        step = (sub.max(-1) - lo) / 15
        d = (step.max(-1) / 63).astype(np.float16)
        dmin = (-lo.min(-1) / 63).astype(np.float16)
        sc = np.clip(np.rint(_div(step, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
        m = np.clip(np.rint(_div(-lo, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
        step_q = d.astype(np.float32)[:, None] * sc
        low_q = dmin.astype(np.float32)[:, None] * m
        q = np.clip(np.rint(_div(sub + low_q[..., None], step_q[..., None])), 0, 15)
        return Blocks(type_name, d, dmin, sc, m, q.astype(np.uint8).reshape(n, QK_K))
    sub = x.reshape(n, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(_div(step, d.astype(np.float32)[:, None])), -128, 127).astype(np.int8)
    step_q = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint(_div(sub, step_q[..., None])) + 32, 0, 63)
    return Blocks(type_name, d, None, sc, None, q.astype(np.uint8).reshape(n, QK_K))


def quantize(w: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(u8[rows, cols / 256 * block bytes] as GGUF stores a [rows, cols] matrix, the f32[rows, cols]
    values it stands for). `cols` must be a multiple of 256."""
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"{w.shape=}: K-quant rows hold a multiple of {QK_K} values")
    blocks = quantize_blocks(np.asarray(w, np.float32).reshape(-1, QK_K), type_name)
    return pack(blocks).reshape(rows, -1), values(blocks).reshape(rows, cols)
