"""The CPU attention kernel on decode steps: 30 layers of SmolLM2-135M's attention in one call.

    JAX_PLATFORMS=cpu python benchmarks/cpu_attention.py                   # 16 x 512, f16 and f32
    JAX_PLATFORMS=cpu python benchmarks/cpu_attention.py --shapes 16x512,64x512 --dtypes int8
    git show REV:cpu_kernels/ragged_paged_attention.cc > /tmp/old.cc
    JAX_PLATFORMS=cpu python benchmarks/cpu_attention.py --against /tmp/old.cc

One jitted call runs the kernel on one decode token of each of S sequences with C tokens of context
(SxC+K: 1 + K tokens each, the last at position C - 1, as in a speculative verification), for each
of SmolLM2-135M's 30 layers (9 query heads, 3 KV heads, head_dim 64, page size 16; `--heads 14,2`
gives Qwen2.5-0.5B's heads, a GQA group of 7; `--heads 12,2 --head-dim 128` Qwen2.5-1.5B's, and
`--heads 32,8 --head-dim 128` Llama 3 8B's), each layer's output feeding the next layer's queries
so that XLA cannot overlap them. The pages of the sequences are a random permutation of the pool (as
a long-running engine's are). With --against, the kernel built from another source file runs too,
interleaved round after round with this checkout's, the best round of each kept, so load from other
users of a shared machine hits both alike. GB/s counts the K and V bytes the call reads.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cpu_kernels import build  # noqa: E402

LAYERS, HQ, HKV, D, PS = 30, 9, 3, 64, 16
SYMBOL = "JaxinferRaggedPagedAttention"


def layers_fn(target: str, head_dim: int = D):
    """30 layers' decode attention in one jitted call, layer l's output the queries of l + 1."""
    def run(q, k, v, k_scale, v_scale, kv_lens, page_indices, cu_q_lens, num_seqs):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        for layer in range(LAYERS):
            q = call(q, k, v, k_scale, v_scale, jnp.full((1,), layer, jnp.int32), kv_lens,
                     page_indices, cu_q_lens, num_seqs, sm_scale=np.float32(head_dim ** -0.5),
                     sliding_window=np.int64(0), soft_cap=np.float32(0.0)) + 0.01
        return q
    return jax.jit(run)


def decode_batch(seqs: int, context: int, dtype, rng, drafts: int = 0,
                 heads: tuple[int, int] = (HQ, HKV), head_dim: int = D):
    hq, hkv = heads
    pages = -(-context // PS)
    num_pages = 1 + seqs * pages
    if dtype == np.int8:  # codes and one f32 scale per (layer, page, KV head, slot)
        k = rng.integers(-127, 128, (LAYERS, num_pages, hkv, head_dim, PS), dtype=np.int8)
        v = rng.integers(-127, 128, (LAYERS, num_pages, hkv, PS, head_dim), dtype=np.int8)
        k_scale, v_scale = (rng.random((LAYERS, num_pages, hkv, PS), np.float32) / 127
                            for _ in range(2))
    else:
        k = rng.standard_normal((LAYERS, num_pages, hkv, head_dim, PS), np.float32).astype(dtype)
        v = rng.standard_normal((LAYERS, num_pages, hkv, PS, head_dim), np.float32).astype(dtype)
        k_scale = v_scale = np.zeros((1,), np.float32)
    page_indices = rng.permutation(np.arange(1, num_pages)).reshape(seqs, pages).astype(np.int32)
    kv_lens = np.full(seqs, context, np.int32)
    cu_q_lens = np.arange(seqs + 1, dtype=np.int32) * (1 + drafts)
    q = rng.standard_normal((seqs * (1 + drafts), hq, head_dim)).astype(np.float32)
    nbytes = 2 * LAYERS * seqs * context * hkv * (head_dim * np.dtype(dtype).itemsize
                                                  + (4 if dtype == np.int8 else 0))
    arrays = (q, k, v, k_scale, v_scale, kv_lens, page_indices, cu_q_lens,
              np.array([seqs], np.int32))
    return tuple(jnp.asarray(a) for a in arrays), nbytes


def parse_shape(text: str) -> tuple[int, int, int]:
    """'SxC' or 'SxC+K' -> (S, C, K), K = 0 without drafts."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:\+(\d+))?", text)
    if m is None:
        raise ValueError(f"shape {text!r}: expected SEQSxCONTEXT or SEQSxCONTEXT+DRAFTS")
    return tuple(int(x) for x in m.groups("0"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x512", help="SEQSxCONTEXT[+DRAFTS],...")
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--against", type=Path, help="another version of the kernel's source")
    ap.add_argument("--heads", default=f"{HQ},{HKV}",
                    help="query heads,KV heads (SmolLM2-135M's 9,3; Qwen2.5-0.5B's 14,2)")
    ap.add_argument("--head-dim", type=int, default=D, help="64 (SmolLM2, Qwen2.5-0.5B) or 128")
    args = ap.parse_args(argv)
    heads = tuple(int(h) for h in args.heads.split(","))
    if build.load("ragged_paged_attention", SYMBOL) is None:
        print("the CPU kernels are not available here")
        return 1
    kernels = {"this": layers_fn(f"ragged_paged_attention.{SYMBOL}", args.head_dim)}
    if args.against:
        kernels["against"] = layers_fn(
            build.load_variant(args.against, "ragged_paged_attention", SYMBOL, "against"),
            args.head_dim)
    rng = np.random.default_rng(0)
    print(f"30 layers of decode attention, {heads[0]} query and {heads[1]} KV heads of "
          f"{args.head_dim}, one jitted call ({os.cpu_count()} cores; best of {args.rounds} "
          "rounds, interleaved)")
    head = "| seqs | context | cache | ms | GB/s |"
    if args.against:
        head += f" {args.against.name}, ms | {args.against.name} / this |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for shape in args.shapes.split(","):
        seqs, context, drafts = parse_shape(shape)
        for dtype in args.dtypes.split(","):
            batch, nbytes = decode_batch(seqs, context, np.dtype(dtype), rng, drafts, heads,
                                         args.head_dim)
            best = {name: float("inf") for name in kernels}
            outs = {name: fn(*batch).block_until_ready() for name, fn in kernels.items()}
            if args.against:
                diff = float(jnp.max(jnp.abs(outs["this"] - outs["against"])))
                assert diff < 1e-3, f"the two kernels disagree by {diff}"
            for _ in range(args.rounds):
                for name, fn in kernels.items():
                    t0 = time.perf_counter()
                    fn(*batch).block_until_ready()
                    best[name] = min(best[name], time.perf_counter() - t0)
            ms = best["this"] * 1e3
            label = f"{context} +{drafts}" if drafts else f"{context}"
            line = f"| {seqs} | {label} | {dtype} | {ms:.2f} | {nbytes / best['this'] / 1e9:.1f} |"
            if args.against:
                line += f" {best['against'] * 1e3:.2f} | {best['against'] / best['this']:.2f}x |"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
