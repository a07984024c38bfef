"""The CPU quantized matmul kernel against XLA's dense float32 matmul, by rows of x.

    JAX_PLATFORMS=cpu python benchmarks/cpu_matmul.py                 # rows 1 .. 512
    JAX_PLATFORMS=cpu python benchmarks/cpu_matmul.py --rows 1,16,64
    JAX_PLATFORMS=cpu python benchmarks/cpu_matmul.py --rows 1,9 --against /tmp/old.cc
    JAX_PLATFORMS=cpu python benchmarks/cpu_matmul.py --rows 1,64 --lm-head

One jitted call runs the weight matmuls of SmolLM2-135M's 30 layers (fused q/k/v [576, 960],
o [576, 576], fused gate/up [576, 3072], down [1536, 576]) on M rows, each layer's output
feeding the next so XLA cannot overlap them: once through the C++ kernel on Q4_1-shaped codes
(4-bit, groups of 32, f16 scales and minimums: the default model's format, ~60 MB), once through
`jnp.dot` on float32 weights of the same shapes (~425 MB). The two run interleaved, round after
round, and the best round of each is kept, so load from other users of a shared machine hits
both alike; a pass over 64 MiB before every timed call makes each take its weights from memory.
This is where `cpu_kernels.quant_matmul.dense_faster_above_rows` comes from: the row count above
which the engine would rather keep a float copy of each weight. With --against,
the float kernel built from another version of `quant_matmul.cc` runs too, interleaved, after
a check whether its product of one layer's matrix equals this version's bit for bit.

--q8-against times another version of `quant_matmul_q8.cc` (the int8-activation kernel) beside
this one (implies --int8-activations), after the same check of one layer's product.

--padded also times the kernels (float x, and int8 x where --int8-activations) on the same codes
kept at the row stride the engine gives them on the CPU (`padded_stride`: rows of an odd number
of cache lines; the gate/up matrix's 3072 columns and the LM head's 49,152 take 64 more), after a
check that the products are equal bit for bit.

--lm-head times SmolLM2's LM head instead (int8 codes in groups of 32, f16 scales: the GGUF's
Q8_0 [576, 49152], ~30 MB) and passes over a 64 MiB buffer before every timed call, so that the
head comes from memory as it does in a step (where the layers' weights pass through the caches
first; a last-level cache of 32 MB would otherwise hold most of it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cpu_kernels import build  # noqa: E402
from cpu_kernels import quant_matmul as cpu_quant  # noqa: E402

LAYERS, HIDDEN, FFN, KV, VOCAB = 30, 576, 1536, 192, 49152
SHAPES = [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * FFN), (FFN, HIDDEN)]


def codes(rng, k: int, n: int):
    """Random Q4_1-shaped codes: u8[K/2, N] values, f16[K/32, N] scales and minimums."""
    return (jnp.asarray(rng.integers(0, 256, (k // 2, n), dtype=np.uint8)),
            jnp.asarray((rng.random((k // 32, n)) * 0.01).astype(np.float16)),
            jnp.asarray((rng.random((k // 32, n)) * -0.005).astype(np.float16)))


def all_rows(x):
    """The kernels' i32[1] count of x's real rows: all of them here."""
    return jnp.full((1,), x.shape[0], jnp.int32)


def int4_matmul(target: str):
    """x @ W through kernel `target` for Q4_1-shaped codes (quant_matmul's call, float x)."""
    def matmul(x, w):
        values, scales, mins = w
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], values.shape[1]),
                                                             jnp.float32))
        return call(x, values, scales, mins, all_rows(x), bits=np.int64(4),
                    group_size=np.int64(32), has_mins=np.int64(1))
    return matmul


def int8_matmul(target: str):
    """x @ W through kernel `target` for Q8_0-shaped codes (quant_matmul's call, float x)."""
    def matmul(x, w):
        values, scales = w
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], values.shape[1]),
                                                             jnp.float32))
        return call(x, values, scales, scales, all_rows(x), bits=np.int64(8),
                    group_size=np.int64(32), has_mins=np.int64(0))
    return matmul


def lm_head_codes(rng):
    """Random Q8_0-shaped codes of the LM head: i8[576, 49152] values, f16[18, 49152] scales."""
    return (jnp.asarray(rng.integers(-127, 128, (HIDDEN, VOCAB), dtype=np.int8)),
            jnp.asarray((rng.random((HIDDEN // 32, VOCAB)) * 0.01).astype(np.float16)))


def padded(w):
    """A weight's arrays (values, scales[, mins]) with rows `padded_stride` columns long."""
    stride = cpu_quant.padded_stride(w[0].shape[1])
    return tuple(jnp.pad(a, ((0, 0), (0, stride - a.shape[1]))) for a in w)


def padded_runs(runs: dict, weights, make, int8_activations: bool) -> None:
    """Adds the --padded runs to `runs`: `make(q8)` (the jitted product, x float or int8) on
    `weights` (a pytree of padded weights)."""
    runs["padded"] = (make(False), weights)
    if int8_activations:
        runs["q8_padded"] = (make(True), weights)


def padded_cells(best: dict, runs: dict, x, w, columns: int) -> str:
    """The --padded columns of a row: ms, ratio to the unpadded kernel, and whether the product
    of x and the weight `w` ((values, scales[, mins]), `columns` wide) is bitwise the same at
    the padded stride."""
    cells = ""
    for name, base in (("padded", "kernel"), ("q8_padded", "q8")):
        if name not in runs:
            continue
        bits, q8 = (4 if len(w) == 3 else 8), name == "q8_padded"
        mul = lambda w, n: cpu_quant.quant_matmul(  # noqa: E731  (mins: None for int8)
            x, *w, bits=bits, group_size=32, int8_activations=q8, columns=n)
        same = bool(jnp.array_equal(mul(w, None), mul(padded(w), columns)))
        cells += f" {best[name] * 1e3:.2f} | {best[name] / best[base]:.2f}x | {same} |"
    return cells


def padded_head(int8_activations: bool) -> str:
    head = " padded stride, ms | padded / kernel | bitwise equal |"
    if int8_activations:
        head += " int8 activations, padded, ms | padded / int8 activations | bitwise equal |"
    return head


def best_times(runs: dict, x, rounds: int, before=None) -> dict[str, float]:
    """{name: best seconds} of `runs` ({name: (fn, weights)}) on x, interleaved round by round
    after a first call each (the compile); `before()` runs untimed before every timed call. Each
    round starts one run later than the round before, so no run always follows the same one
    (a kernel timed right after XLA's dense product came out ~10% slower than the same kernel
    timed after another)."""
    best = dict.fromkeys(runs, float("inf"))
    for fn, w in runs.values():
        fn(x, w).block_until_ready()
    names = list(runs)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn, w = runs[name]
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn(x, w).block_until_ready()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def cache_flush():
    """A call that passes over 64 MiB, so the next one's weights come from memory (as in a step,
    where other matrices pass through the caches in between), not from what the run before it
    left in a last-level cache: two kernels timed one after the other on the same weights would
    otherwise favour the second."""
    buffer = jnp.ones((64 << 20) // 4, jnp.float32)
    total = jax.jit(lambda b: jnp.sum(b * 1.0001))
    return lambda: total(buffer).block_until_ready()


def layers(matmul):
    """The 30 layers' products, each layer's output the next one's input: x [M, 576] -> [M, 576]."""
    def run(x, weights):
        for qkv, o, gate_up, down in weights:
            y = matmul(x, qkv)  # [M, 960]
            x = x + matmul(y[:, :HIDDEN] + jnp.mean(y[:, HIDDEN:]), o)
            y = matmul(x, gate_up)  # [M, 3072]
            x = x + 1e-3 * matmul(y[:, :FFN] * y[:, FFN:], down)
        return x
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--against", type=Path, help="another version of quant_matmul.cc")
    ap.add_argument("--int8-activations", action="store_true",
                    help="also the kernel with x rounded to int8 (integer dot products)")
    ap.add_argument("--q8-against", type=Path,
                    help="another version of quant_matmul_q8.cc (implies --int8-activations)")
    ap.add_argument("--padded", action="store_true",
                    help="also the kernels on the codes at the engine's padded row stride")
    ap.add_argument("--lm-head", action="store_true",
                    help="the LM head (Q8_0 [576, 49152]) from memory instead of the 30 layers")
    args = ap.parse_args(argv)
    args.int8_activations = args.int8_activations or args.q8_against is not None
    if args.lm_head:
        return lm_head(args)
    if not cpu_quant.available():
        print("the CPU kernels are not available here")
        return 1
    rng = np.random.default_rng(0)
    quantized = [[codes(rng, k, n) for k, n in SHAPES] for _ in range(LAYERS)]
    dense = [[jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02) for k, n in SHAPES]
             for _ in range(LAYERS)]
    runs = {"kernel": (layers(lambda x, w: cpu_quant.quant_matmul(x, *w, bits=4, group_size=32)),
                       quantized),
            "xla": (layers(jnp.dot), dense)}
    if args.against:
        against = int4_matmul(
            build.load_variant(args.against, "quant_matmul", "JaxinferQuantMatmul", "against"))
        runs["against"] = (layers(against), quantized)
    if args.int8_activations:
        runs["q8"] = (layers(lambda x, w: cpu_quant.quant_matmul(
            x, *w, bits=4, group_size=32, int8_activations=True)), quantized)
    if args.q8_against:
        q8_against = int4_matmul(build.load_variant(args.q8_against, "quant_matmul_q8",
                                                    "JaxinferQuantMatmulQ8", "against"))
        runs["q8_against"] = (layers(q8_against), quantized)
    if args.padded:
        unpadded = {cpu_quant.padded_stride(n): n for _, n in SHAPES}
        padded_runs(runs, [[padded(w) for w in layer] for layer in quantized],
                    lambda q8: layers(lambda x, w: cpu_quant.quant_matmul(
                        x, *w, bits=4, group_size=32, int8_activations=q8,
                        columns=unpadded[w[0].shape[1]])),
                    args.int8_activations)
    flush = cache_flush()
    print(f"SmolLM2-135M's 30 layers of weight matmuls, one jitted call ({jax.devices()[0]}, "
          f"{os.cpu_count()} cores; best of {args.rounds} rounds, interleaved, caches flushed)")
    head = "| rows | C++ kernel on int4 codes, ms | XLA dense f32, ms | dense / kernel |"
    if args.against:
        head += f" {args.against.name}, ms | {args.against.name} / kernel | bitwise equal |"
    if args.int8_activations:
        head += " int8 activations, ms | kernel / int8 activations |"
    if args.q8_against:
        head += (f" {args.q8_against.name}, ms | {args.q8_against.name} / int8 activations |"
                 " bitwise equal |")
    if args.padded:
        head += padded_head(args.int8_activations)
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, HIDDEN)) * 0.01, jnp.float32)
        best = best_times(runs, x, args.rounds, before=flush)
        row = (f"| {m} | {best['kernel'] * 1e3:.1f} | {best['xla'] * 1e3:.1f} | "
               f"{best['xla'] / best['kernel']:.2f}x |")
        if args.against:
            w = quantized[0][2]  # one layer's gate/up matrix, [576, 3072]
            same = bool(jnp.array_equal(jax.jit(against)(x, w), jax.jit(
                lambda x, w: cpu_quant.quant_matmul(x, *w, bits=4, group_size=32))(x, w)))
            row += (f" {best['against'] * 1e3:.1f} | {best['against'] / best['kernel']:.2f}x |"
                    f" {same} |")
        if args.int8_activations:
            row += f" {best['q8'] * 1e3:.1f} | {best['kernel'] / best['q8']:.2f}x |"
        if args.q8_against:
            w = quantized[0][2]
            same = bool(jnp.array_equal(jax.jit(q8_against)(x, w), jax.jit(
                lambda x, w: cpu_quant.quant_matmul(x, *w, bits=4, group_size=32,
                                                    int8_activations=True))(x, w)))
            row += (f" {best['q8_against'] * 1e3:.1f} | {best['q8_against'] / best['q8']:.2f}x |"
                    f" {same} |")
        if args.padded:  # one layer's gate/up matrix, [576, 3072]
            row += padded_cells(best, runs, x, quantized[0][2], SHAPES[2][1])
        print(row, flush=True)
    return 0


def lm_head(args) -> int:
    """The --lm-head table: the one matrix, from memory each call."""
    rng = np.random.default_rng(0)
    head = lm_head_codes(rng)
    dense = jnp.asarray(rng.standard_normal((HIDDEN, VOCAB), np.float32) * 0.02)
    runs = {"kernel": (jax.jit(lambda x, w: cpu_quant.quant_matmul(x, *w, None, bits=8,
                                                                   group_size=32)), head),
            "xla": (jax.jit(jnp.dot), dense)}
    if args.against:
        against = jax.jit(int8_matmul(
            build.load_variant(args.against, "quant_matmul", "JaxinferQuantMatmul", "against")))
        runs["against"] = (against, head)
    if args.int8_activations:
        runs["q8"] = (jax.jit(lambda x, w: cpu_quant.quant_matmul(
            x, *w, None, bits=8, group_size=32, int8_activations=True)), head)
    if args.q8_against:
        q8_against = jax.jit(int8_matmul(build.load_variant(
            args.q8_against, "quant_matmul_q8", "JaxinferQuantMatmulQ8", "against")))
        runs["q8_against"] = (q8_against, head)
    if args.padded:
        padded_runs(runs, padded(head), lambda q8: jax.jit(
            lambda x, w: cpu_quant.quant_matmul(x, *w, None, bits=8, group_size=32,
                                                int8_activations=q8, columns=VOCAB)),
                    args.int8_activations)
    flush = cache_flush()
    print(f"SmolLM2-135M's LM head, int8 codes [576, 49152] ({jax.devices()[0]}, "
          f"{os.cpu_count()} cores; best of {args.rounds} rounds, interleaved, caches flushed)")
    head_row = "| rows | C++ kernel on int8 codes, ms | GB/s | XLA dense f32, ms | dense / kernel |"
    if args.against:
        head_row += f" {args.against.name}, ms | {args.against.name} / kernel | bitwise equal |"
    if args.int8_activations:
        head_row += " int8 activations, ms | kernel / int8 activations |"
    if args.q8_against:
        head_row += (f" {args.q8_against.name}, ms | {args.q8_against.name} / int8 activations |"
                     " bitwise equal |")
    if args.padded:
        head_row += padded_head(args.int8_activations)
    print(head_row)
    print("|---" * (head_row.count("|") - 1) + "|")
    nbytes = HIDDEN * VOCAB + (HIDDEN // 32) * VOCAB * 2
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, HIDDEN)), jnp.float32)
        best = best_times(runs, x, args.rounds, before=flush)
        row = (f"| {m} | {best['kernel'] * 1e3:.2f} | {nbytes / best['kernel'] / 1e9:.1f} | "
               f"{best['xla'] * 1e3:.2f} | {best['xla'] / best['kernel']:.2f}x |")
        if args.against:
            same = bool(jnp.array_equal(against(x, head), runs["kernel"][0](x, head)))
            row += (f" {best['against'] * 1e3:.2f} | {best['against'] / best['kernel']:.2f}x |"
                    f" {same} |")
        if args.int8_activations:
            row += f" {best['q8'] * 1e3:.2f} | {best['kernel'] / best['q8']:.2f}x |"
        if args.q8_against:
            same = bool(jnp.array_equal(q8_against(x, head), runs["q8"][0](x, head)))
            row += (f" {best['q8_against'] * 1e3:.2f} | {best['q8_against'] / best['q8']:.2f}x |"
                    f" {same} |")
        if args.padded:
            row += padded_cells(best, runs, x, head, VOCAB)
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
