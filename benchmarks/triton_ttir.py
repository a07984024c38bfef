"""Compile the kernels' Triton IR for sm_90 without a GPU (a check of the GPU path on a CPU box).

Two steps, two Pythons:

    # 1. with the project's JAX: lower each kernel config for CUDA, keep the Triton IR (text)
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/triton_ttir.py dump /tmp/ttir [NAME_PART]
    # 2. with any Python that has the `triton` wheel (it ships ptxas): TTIR -> TTGIR -> PTX -> cubin
    python benchmarks/triton_ttir.py compile /tmp/ttir

Step 2 uses the pip Triton, not the one inside jaxlib's CUDA plugin, so it is a proxy: it shows
the IR is valid, that its dots/loads/layouts compile for Hopper, and how much shared memory each
kernel needs (<= 227 KiB per block on H100/H200), not that the GPU runs it right.
"""

from __future__ import annotations

import os
import re
import sys

SM90_MAX_SHARED = 232448  # bytes per block (opt-in) on H100/H200


def _configs():
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.kv_write import write_kv
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    sds = jax.ShapeDtypeStruct
    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731

    def rpa(name, *, T, S, P, hq, hkv, d, ps, dtype, kv_dtype=None, **kw):
        layout = (i32(S), i32(S, P), i32(S + 1), i32(1))  # kv_lens, page_indices, cu_q_lens, num_seqs
        kv = sds((2, S * P + 1, ps, hkv, d), kv_dtype or dtype)
        extra = {}
        if kv_dtype == jnp.int8:
            extra = dict(k_scale=sds(kv.shape[:4], jnp.float32), v_scale=sds(kv.shape[:4], jnp.float32))
        fn = functools.partial(ragged_paged_attention, sm_scale=d ** -0.5, interpret=False, **kw)
        return name, lambda: jax.jit(fn).trace(sds((T, hq, d), dtype), kv, kv, i32(), *layout, **extra)

    def kvw(name, *, T, hkv, d, ps, dtype, quantized=False):
        cache = sds((2, 64, ps, hkv, d), jnp.int8 if quantized else dtype)
        scales = (sds(cache.shape[:4], jnp.float32),) * 2 if quantized else ()
        fn = functools.partial(write_kv, interpret=False)
        return name, lambda: jax.jit(fn).trace(cache, cache, i32(), sds((T, hkv, d), dtype),
                                               sds((T, hkv, d), dtype), i32(T), *scales)

    def qmm(name, *, m, k, n, bits, group_size, symmetric=True, dtype=jnp.bfloat16):
        from pallas_kernels.quant_matmul import quant_matmul

        rows = k if bits == 8 else k // 2
        values = sds((rows, n), jnp.int8 if bits == 8 else jnp.uint8)
        scales = sds((-(-k // group_size), n), jnp.float16)
        mins = None if symmetric else scales
        fn = functools.partial(quant_matmul, bits=bits, group_size=group_size, interpret=False)
        return name, lambda: jax.jit(fn).trace(sds((m, k), dtype), values, scales, mins)

    bf16, f32 = jnp.bfloat16, jnp.float32
    return [
        rpa("decode_llama8b_bf16", T=64, S=64, P=512, hq=32, hkv=8, d=128, ps=16, dtype=bf16, max_q_len=1),
        rpa("decode_b1_splits_bf16", T=8, S=8, P=512, hq=32, hkv=8, d=128, ps=16, dtype=bf16, max_q_len=1),
        rpa("decode_smollm2_bf16", T=64, S=64, P=128, hq=9, hkv=3, d=64, ps=16, dtype=bf16, max_q_len=1),
        rpa("decode_ps8_g8_f32", T=16, S=16, P=64, hq=16, hkv=2, d=64, ps=8, dtype=f32, max_q_len=1),
        rpa("mixed_llama8b_bf16", T=512, S=8, P=128, hq=32, hkv=8, d=128, ps=16, dtype=bf16),
        rpa("mixed_smollm2_f32", T=256, S=8, P=64, hq=9, hkv=3, d=64, ps=32, dtype=f32),
        rpa("verify_1p3_bf16", T=64, S=16, P=128, hq=32, hkv=8, d=128, ps=16, dtype=bf16, max_q_len=4),
        rpa("window_softcap_bf16", T=256, S=8, P=128, hq=16, hkv=8, d=128, ps=16, dtype=bf16,
            sliding_window=4096, soft_cap=50.0),
        rpa("int8_decode", T=64, S=64, P=512, hq=32, hkv=8, d=128, ps=16, dtype=bf16, kv_dtype=jnp.int8,
            max_q_len=1),
        kvw("write_kv_bf16", T=256, hkv=8, d=128, ps=16, dtype=bf16),
        kvw("write_kv_int8", T=256, hkv=3, d=64, ps=16, dtype=bf16, quantized=True),
        qmm("qmm_int8_channel_smollm2", m=1, k=576, n=1536, bits=8, group_size=576, dtype=f32),
        qmm("qmm_int8_g32_llama8b", m=32, k=4096, n=14336, bits=8, group_size=32),
        qmm("qmm_int4_g32_sym_smollm2", m=1, k=1536, n=576, bits=4, group_size=32, dtype=f32),
        qmm("qmm_int4_g32_asym_llama8b", m=64, k=14336, n=4096, bits=4, group_size=32,
            symmetric=False),
        qmm("qmm_int4_g128_llama8b", m=16, k=4096, n=4096, bits=4, group_size=128),
    ]


def dump(out_dir: str, only: str = "") -> None:
    from jax._src.pallas.triton import lowering, pallas_call_registration

    os.makedirs(out_dir, exist_ok=True)
    captured: list[str] = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        for name, trace in _configs():
            if only not in name:
                continue
            captured.clear()
            trace().lower(lowering_platforms=("cuda",))
            for i, asm in enumerate(captured):
                path = os.path.join(out_dir, f"{name}{'' if i == 0 else f'_{i}'}.ttir")
                with open(path, "w") as f:
                    f.write(asm)
                print(f"{path}: {len(asm)} chars")
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = original


def compile_all(in_dir: str, num_warps: int = 4, num_stages: int = 3) -> int:
    import triton
    from triton.backends.compiler import GPUTarget

    failures = 0
    print(f"triton {triton.__version__}, target sm_90, num_warps={num_warps}, num_stages={num_stages}")
    print(f"{'kernel':28s} {'shared KiB':>10s} {'mma':>5s} {'cp.async':>8s} {'regs?':>6s}  status")
    for name in sorted(os.listdir(in_dir)):
        if not name.endswith(".ttir"):
            continue
        path = os.path.join(in_dir, name)
        try:
            k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=num_warps, num_stages=num_stages))
            ptx = k.asm["ptx"]
            shared = k.metadata.shared
            mma = len(re.findall(r"\bmma\.sync|wgmma\.mma_async", ptx))
            cp = len(re.findall(r"cp\.async", ptx))
            regs = getattr(k, "n_regs", None)
            ok = shared <= SM90_MAX_SHARED and "cubin" in k.asm
            failures += not ok
            print(f"{name[:-5]:28s} {shared / 1024:10.1f} {mma:5d} {cp:8d} {str(regs):>6s}  "
                  f"{'ok' if ok else 'TOO MUCH SHARED MEMORY'}")
        except Exception as e:  # report every kernel
            failures += 1
            print(f"{name[:-5]:28s} FAILED: {type(e).__name__}: {str(e)[:400]}")
    return failures


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("dump", "compile"):
        print(__doc__)
        sys.exit(2)
    if sys.argv[1] == "dump":
        dump(sys.argv[2], *sys.argv[3:4])
    else:
        extra = [int(x) for x in sys.argv[3:5]]
        sys.exit(1 if compile_all(sys.argv[2], *extra) else 0)
