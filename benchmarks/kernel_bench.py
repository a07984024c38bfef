"""Ragged paged attention: correctness on the device and decode speed against baselines.

    PYTHONPATH=. python benchmarks/kernel_bench.py            # on a GPU: --check and --bench
    PYTHONPATH=. python benchmarks/kernel_bench.py --cpu-smoke  # tiny sizes, interpret mode

--check: the kernel (compiled) against `ragged_paged_attention_reference` on mixed, decode,
verification, sliding-window/soft-cap and int8 batches with NaN in every unwritten slot, and the
KV-write kernel against the XLA scatter. --bench: decode over (batch 1/16/64/256) x (context
512/2k/8k), Llama-3.1-8B heads (32 q / 8 kv, head_dim 128, bf16, 16-token pages), beside
`jax.experimental.pallas.ops.gpu.paged_attention` and the XLA path of jaxinfer.ops; achieved GB/s
(K+V bytes read) against a device copy bandwidth measured in the same run. Also a few prefill
shapes (TFLOP/s). Tables go to stdout and, if --out or $OUT is set, to kernel_bench.md / .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.kv_cache import AttentionMetadata
from pallas_kernels.kv_write import quantize_kv, write_kv, write_kv_reference
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)


@dataclasses.dataclass(frozen=True)
class Shapes:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]  # (num_seqs, tokens per seq)


GPU = Shapes(32, 8, 128, 16, "bfloat16", (1, 16, 64, 256), (512, 2048, 8192), ((1, 2048), (4, 1024), (16, 256)))
CPU = Shapes(4, 2, 64, 16, "float32", (1, 4), (64, 256), ((1, 64),))


def log(*a):
    print(*a, flush=True)


def time_fn(fn, *args, min_time: float, max_iters: int = 200) -> tuple[float, float]:
    """(compile+first run seconds, mean seconds per call)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    n = int(min(max_iters, max(3, min_time / one)))
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / n)
    return first, best


def copy_bandwidth(nbytes: int, min_time: float) -> float:
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    _, t = time_fn(f, x, min_time=min_time)
    return 2 * nbytes / t / 1e9  # read + write


# ----------------------------------------------------------------------------------------------
# --check
# ----------------------------------------------------------------------------------------------


def run_checks(interpret: bool, lowering: str, big: bool) -> list[dict]:
    from tests.kernels.paged_batches import make_paged_batch, rel_err

    scale = 4 if big else 1
    heads = dict(num_kv_heads=8, group=4, head_dim=128) if big else dict(num_kv_heads=2, group=3, head_dim=64)
    mixed = dict(q_lens=[19 * scale, 7 * scale, 1, 1, 4, 1], kv_lens=[19 * scale, 40 * scale, 1, 32 * scale, 23 * scale, 17])
    decode = dict(q_lens=[1] * 5, kv_lens=[1, 16, 50 * scale, 97 * scale, 333])
    cases = [
        ("mixed f32 ps16", mixed, dict(page_size=16, dtype=jnp.float32), {}, 1e-4),
        ("mixed bf16 ps16", mixed, dict(page_size=16, dtype=jnp.bfloat16), {}, 3e-2),
        ("mixed f32 ps8 D64 G3", mixed, dict(page_size=8, dtype=jnp.float32, num_kv_heads=3, group=3, head_dim=64), {}, 1e-4),
        ("mixed f32 ps32 G8", mixed, dict(page_size=32, dtype=jnp.float32, num_kv_heads=2, group=8), {}, 1e-4),
        ("verify(1+3) bf16", dict(q_lens=[4, 4, 1, 3], kv_lens=[4, 30 * scale, 9, 64 * scale]),
         dict(page_size=16, dtype=jnp.bfloat16), dict(max_q_len=4), 3e-2),
        ("decode split f32", decode, dict(page_size=16, dtype=jnp.float32), dict(max_q_len=1), 1e-4),
        ("decode split bf16", decode, dict(page_size=16, dtype=jnp.bfloat16), dict(max_q_len=1), 3e-2),
        ("window+softcap bf16", mixed, dict(page_size=16, dtype=jnp.bfloat16),
         dict(sliding_window=13 * scale, soft_cap=5.0), 3e-2),
        ("decode window+softcap f32", decode, dict(page_size=16, dtype=jnp.float32),
         dict(max_q_len=1, sliding_window=40, soft_cap=3.0), 1e-4),
        ("int8 decode", decode, dict(page_size=16, dtype=jnp.bfloat16), dict(max_q_len=1, int8=True), 3e-2),
        ("int8 mixed", mixed, dict(page_size=16, dtype=jnp.float32), dict(int8=True), 1e-4),
    ]
    results = []
    for name, lens, batch_kw, call_kw, tol in cases:
        kw = {**heads, **batch_kw}
        call_kw = dict(call_kw)
        int8 = call_kw.pop("int8", False)
        try:
            b = make_paged_batch(0, **lens, num_seqs_pad=8, num_tokens_pad=_pow2(sum(lens["q_lens"])), **kw)
            k_cache, v_cache, scales = b.k_cache, b.v_cache, {}
            if int8:
                k_cache, ks = quantize_kv(jnp.nan_to_num(b.k_cache))
                v_cache, vs = quantize_kv(jnp.nan_to_num(b.v_cache))
                scales = dict(k_scale=ks, v_scale=vs)
            sm = 1 / math.sqrt(kw["head_dim"])
            out = _rpa(b.q, k_cache, v_cache, jnp.int32(1), b.md, sm_scale=sm,
                                         interpret=interpret, lowering=lowering, **call_kw, **scales)
            ref_kw = {k: v for k, v in call_kw.items() if k in ("sliding_window", "soft_cap")}
            ref = ragged_paged_attention_reference(b.q, k_cache, v_cache, 1, *_layout(b.md), sm_scale=sm, **ref_kw, **scales)
            out_np = np.asarray(out.astype(jnp.float32))
            err = rel_err(out_np, ref.astype(jnp.float32), b.num_tokens_real)
            ok = bool(err < tol and not np.isnan(out_np).any() and (out_np[b.num_tokens_real:] == 0).all())
            results.append(dict(case=name, rel_err=err, tol=tol, ok=ok))
        except Exception as e:  # report and go on: one failing case must not hide the others
            traceback.print_exc()
            results.append(dict(case=name, rel_err=None, tol=tol, ok=False, error=f"{type(e).__name__}: {e}"[:300]))
        log(f"  check {name:28s} rel_err={results[-1]['rel_err']}  {'PASS' if results[-1]['ok'] else 'FAIL'}")
    # KV write kernel against the XLA scatter (real pages; page 0 takes padding).
    try:
        rng = np.random.default_rng(0)
        shape = (2, 64, 16, heads["num_kv_heads"], heads["head_dim"])
        kc, vc = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((40, *shape[3:])), jnp.bfloat16) for _ in range(2))
        slots = np.zeros(40, np.int32)
        slots[:33] = rng.permutation(np.arange(16, 64 * 16))[:33]
        got = write_kv(kc, vc, jnp.int32(1), k, v, jnp.asarray(slots), interpret=interpret)
        want = write_kv_reference(kc, vc, 1, k, v, jnp.asarray(slots))
        ok = all(bool(jnp.array_equal(g[:, 1:], w[:, 1:])) for g, w in zip(got, want))
        results.append(dict(case="write_kv vs scatter", rel_err=0.0 if ok else None, tol=0.0, ok=ok))
    except Exception as e:
        traceback.print_exc()
        results.append(dict(case="write_kv vs scatter", rel_err=None, tol=0.0, ok=False, error=repr(e)[:300]))
    log(f"  check {'write_kv vs scatter':28s} {'PASS' if results[-1]['ok'] else 'FAIL'}")
    return results


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# --bench
# ----------------------------------------------------------------------------------------------


def make_decode(batch: int, context: int, sh: Shapes, seed: int = 0):
    """Full-context decode batch on the device: random pages, permuted page table."""
    dtype = jnp.dtype(sh.dtype)
    pages_per_seq = context // sh.page_size
    num_pages = batch * pages_per_seq + 1
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    shape = (1, num_pages, sh.page_size, sh.num_kv_heads, sh.head_dim)
    k_cache = jax.random.normal(kk, shape, dtype)
    v_cache = jax.random.normal(kv, shape, dtype)
    page_indices = (jax.random.permutation(kp, num_pages - 1) + 1).astype(jnp.int32).reshape(batch, pages_per_seq)
    q = jax.random.normal(kq, (batch, sh.num_q_heads, sh.head_dim), dtype)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((batch,), jnp.int32),
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
        kv_lens=jnp.full((batch,), context, jnp.int32),
        page_indices=page_indices,
        num_seqs=jnp.array([batch], jnp.int32),
    )
    return q, k_cache, v_cache, md


def make_prefill(num_seqs: int, tokens: int, sh: Shapes, seed: int = 0):
    dtype = jnp.dtype(sh.dtype)
    pages_per_seq = tokens // sh.page_size
    num_pages = num_seqs * pages_per_seq + 1
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    shape = (1, num_pages, sh.page_size, sh.num_kv_heads, sh.head_dim)
    k_cache = jax.random.normal(kk, shape, dtype)
    v_cache = jax.random.normal(kv, shape, dtype)
    page_indices = (jax.random.permutation(kp, num_pages - 1) + 1).astype(jnp.int32).reshape(num_seqs, pages_per_seq)
    q = jax.random.normal(kq, (num_seqs * tokens, sh.num_q_heads, sh.head_dim), dtype)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((num_seqs * tokens,), jnp.int32),
        cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32) * tokens,
        kv_lens=jnp.full((num_seqs,), tokens, jnp.int32),
        page_indices=page_indices,
        num_seqs=jnp.array([num_seqs], jnp.int32),
    )
    return q, k_cache, v_cache, md


def _layout(md: AttentionMetadata) -> tuple:
    """The kernels' batch-layout arguments (kv_lens, page_indices, cu_q_lens, num_seqs)."""
    return md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs


def _rpa(q, k_cache, v_cache, layer, md: AttentionMetadata, **kw):
    """The Pallas kernel with the XLA path's signature (metadata as one pytree)."""
    return ragged_paged_attention(q, k_cache, v_cache, layer, *_layout(md), **kw)


def _xla_impl():
    try:
        from jaxinfer.ops.xla_attention import ragged_paged_attention_xla

        return "xla(ops)", ragged_paged_attention_xla
    except ImportError:
        return "xla(reference)", lambda q, k, v, layer, md, **kw: ragged_paged_attention_reference(
            q, k, v, layer, *_layout(md), **kw)


def _jax_paged_attention():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        return paged_attention
    except Exception as e:  # moved or removed in a later JAX
        log(f"  jax paged_attention unavailable: {e!r}")
        return None


def bench_decode(sh: Shapes, *, interpret: bool, lowering: str, min_time: float, deadline: float,
                 copy_gbs: float, rows: list[dict], on_row=lambda: None) -> list[dict]:
    sm_scale = 1 / math.sqrt(sh.head_dim)
    xla_name, xla_fn = _xla_impl()
    jax_pa = _jax_paged_attention()
    for batch in sh.batches:
        for context in sh.contexts:
            row = dict(batch=batch, context=context, copy_gbs=copy_gbs)
            rows.append(row)
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget"
                continue
            q, k_cache, v_cache, md = make_decode(batch, context, sh)
            kv_bytes = 2 * batch * context * sh.num_kv_heads * sh.head_dim * jnp.dtype(sh.dtype).itemsize
            row["kv_mb"] = kv_bytes / 1e6
            args = (q, k_cache, v_cache, jnp.int32(0), md)
            impls = {
                "rpa": (jax.jit(functools.partial(_rpa, sm_scale=sm_scale, max_q_len=1,
                                                  interpret=interpret, lowering=lowering)), args),
                xla_name: (jax.jit(functools.partial(xla_fn, sm_scale=sm_scale)), args),
            }
            if jax_pa is not None:
                k_splits = min(16, md.page_indices.shape[1])
                k_pages = jnp.transpose(k_cache[0], (2, 0, 1, 3))  # [Hkv, N, ps, D]
                v_pages = jnp.transpose(v_cache[0], (2, 0, 1, 3))

                def run_pa(q, k_pages, v_pages, page_indices, lengths, k_splits=k_splits):
                    return jax_pa(q * sm_scale, k_pages, v_pages, page_indices, lengths,
                                  k_splits=k_splits, interpret=interpret)

                impls["jax_pa"] = (jax.jit(run_pa), (q, k_pages, v_pages, md.page_indices, md.kv_lens))
            outs = {}
            for name, (fn, fn_args) in impls.items():
                if name.startswith("xla(reference)") and kv_bytes > 2e9:
                    row[name] = "too big"
                    continue
                try:
                    first, t = time_fn(fn, *fn_args, min_time=min_time)
                    row[name] = dict(us=t * 1e6, gbs=kv_bytes / t / 1e9, compile_s=first)
                    outs[name] = np.asarray(fn(*fn_args).astype(jnp.float32))
                except Exception as e:
                    row[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
            if "rpa" in outs:
                for name, o in outs.items():
                    if name != "rpa":
                        ref = outs["rpa"]
                        row[f"diff_vs_{name}"] = float(np.abs(o - ref).max() / max(np.abs(o).max(), 1e-30))
            log(f"  decode batch={batch:4d} ctx={context:5d} " + "  ".join(
                f"{n}={v['us']:.1f}us/{v['gbs']:.0f}GB/s" if isinstance(v, dict) else f"{n}={v}"
                for n, v in row.items() if n in impls))
            del q, k_cache, v_cache, md, impls, outs, args
            on_row()
    return rows


def bench_prefill(sh: Shapes, *, interpret: bool, lowering: str, min_time: float, deadline: float,
                  rows: list[dict], on_row=lambda: None) -> list[dict]:
    sm_scale = 1 / math.sqrt(sh.head_dim)
    xla_name, xla_fn = _xla_impl()
    for num_seqs, tokens in sh.prefills:
        row = dict(num_seqs=num_seqs, tokens=tokens)
        rows.append(row)
        if time.perf_counter() > deadline:
            row["skipped"] = "time budget"
            continue
        q, k_cache, v_cache, md = make_prefill(num_seqs, tokens, sh)
        flops = 4 * num_seqs * sh.num_q_heads * sh.head_dim * tokens * (tokens + 1) / 2  # causal QK + PV
        for name, fn in {
            "rpa": jax.jit(functools.partial(_rpa, sm_scale=sm_scale, interpret=interpret,
                                             lowering=lowering)),
            xla_name: jax.jit(functools.partial(xla_fn, sm_scale=sm_scale)),
        }.items():
            try:
                first, t = time_fn(fn, q, k_cache, v_cache, jnp.int32(0), md, min_time=min_time)
                row[name] = dict(us=t * 1e6, tflops=flops / t / 1e12, compile_s=first)
            except Exception as e:
                row[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
        log(f"  prefill {num_seqs}x{tokens} " + "  ".join(
            f"{n}={v['us']:.0f}us/{v['tflops']:.1f}TFLOP/s" if isinstance(v, dict) else f"{n}={v}"
            for n, v in row.items() if n not in ("num_seqs", "tokens")))
        del q, k_cache, v_cache, md
        on_row()
    return rows


def sweep_decode(sh: Shapes, *, interpret: bool, lowering: str, min_time: float, deadline: float) -> list[dict]:
    """Time the decode kernel over Triton launch parameters and chunk sizes (for tuning)."""
    sm_scale = 1 / math.sqrt(sh.head_dim)
    rows = []
    shapes = [(sh.batches[0], sh.contexts[-1]), (sh.batches[-2], sh.contexts[1 % len(sh.contexts)])]
    for batch, context in shapes:
        q, k_cache, v_cache, md = make_decode(batch, context, sh)
        kv_bytes = 2 * batch * context * sh.num_kv_heads * sh.head_dim * jnp.dtype(sh.dtype).itemsize
        for chunk in (64, 128, 256):
            for num_warps in (4, 8):
                for num_stages in (1, 2, 3):
                    if time.perf_counter() > deadline:
                        return rows
                    fn = jax.jit(functools.partial(
                        ragged_paged_attention, sm_scale=sm_scale, max_q_len=1, interpret=interpret,
                        lowering=lowering, kv_chunk_size=chunk, num_warps=num_warps, num_stages=num_stages))
                    try:
                        _, t = time_fn(fn, q, k_cache, v_cache, jnp.int32(0), md, min_time=min_time)
                        rows.append(dict(batch=batch, context=context, chunk=chunk, num_warps=num_warps,
                                         num_stages=num_stages, us=t * 1e6, gbs=kv_bytes / t / 1e9))
                    except Exception as e:
                        rows.append(dict(batch=batch, context=context, chunk=chunk, num_warps=num_warps,
                                         num_stages=num_stages, error=repr(e)[:200]))
                    log(f"  sweep {rows[-1]}")
        del q, k_cache, v_cache, md
    return rows


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def _cell(v, key):
    return f"{v[key]:.1f}" if isinstance(v, dict) else (str(v)[:24] if v is not None else "-")


def render(env: dict, checks: list[dict], decode: list[dict], prefill: list[dict], copy_gbs: float | None) -> str:
    lines = ["# kernel_bench", "", "```", json.dumps(env, indent=1), "```", ""]
    if checks:
        lines += ["## Correctness on the device (kernel vs reference)", "", "| case | rel err | tol | ok |",
                  "| --- | --- | --- | --- |"]
        for c in checks:
            err = "-" if c["rel_err"] is None else f"{c['rel_err']:.2e}"
            lines.append(f"| {c['case']} | {err} | {c['tol']:.0e} | {'PASS' if c['ok'] else 'FAIL ' + c.get('error', '')} |")
        lines.append("")
    if decode:
        _, xla_name = _xla_names(decode)
        lines += [f"## Decode (copy bandwidth {copy_gbs:.0f} GB/s, read+write of a device array)", "",
                  f"| batch | ctx | KV MB | rpa us | rpa GB/s | rpa/copy | jax_pa us | jax_pa GB/s | {xla_name} us | "
                  f"{xla_name} GB/s | rpa speedup vs jax_pa | vs {xla_name} | max rel diff vs baselines |",
                  "| " + " | ".join(["---"] * 13) + " |"]
        for r in decode:
            if "skipped" in r:
                lines.append(f"| {r['batch']} | {r['context']} | skipped ({r['skipped']}) |" + " |" * 10)
                continue
            rpa, pa, xla = r.get("rpa"), r.get("jax_pa"), r.get(xla_name)
            frac = f"{rpa['gbs'] / copy_gbs:.0%}" if isinstance(rpa, dict) else "-"
            sp_pa = f"{pa['us'] / rpa['us']:.2f}x" if isinstance(rpa, dict) and isinstance(pa, dict) else "-"
            sp_x = f"{xla['us'] / rpa['us']:.2f}x" if isinstance(rpa, dict) and isinstance(xla, dict) else "-"
            diffs = [v for k, v in r.items() if k.startswith("diff_vs_")]
            diff = f"{max(diffs):.1e}" if diffs else "-"
            lines.append(f"| {r['batch']} | {r['context']} | {r['kv_mb']:.0f} | {_cell(rpa, 'us')} | {_cell(rpa, 'gbs')} | "
                         f"{frac} | {_cell(pa, 'us')} | {_cell(pa, 'gbs')} | {_cell(xla, 'us')} | {_cell(xla, 'gbs')} | "
                         f"{sp_pa} | {sp_x} | {diff} |")
        lines.append("")
    if prefill:
        xla_name = next((k for r in prefill for k in r if k.startswith("xla")), "xla")
        lines += ["## Prefill (causal, all tokens new)", "", f"| seqs x tokens | rpa us | rpa TFLOP/s | {xla_name} us | "
                  f"{xla_name} TFLOP/s | rpa speedup |", "| --- | --- | --- | --- | --- | --- |"]
        for r in prefill:
            if "skipped" in r:
                lines.append(f"| {r['num_seqs']}x{r['tokens']} | skipped ({r['skipped']}) | | | | |")
                continue
            rpa, xla = r.get("rpa"), r.get(xla_name)
            sp = f"{xla['us'] / rpa['us']:.2f}x" if isinstance(rpa, dict) and isinstance(xla, dict) else "-"
            lines.append(f"| {r['num_seqs']}x{r['tokens']} | {_cell(rpa, 'us')} | {_cell(rpa, 'tflops')} | "
                         f"{_cell(xla, 'us')} | {_cell(xla, 'tflops')} | {sp} |")
        lines.append("")
    return "\n".join(lines)


def _xla_names(rows):
    for r in rows:
        for k in r:
            if k.startswith("xla("):
                return "rpa", k
    return "rpa", "xla(ops)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, interpret mode (runs on a CPU)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time decode over num_warps/num_stages/chunk")
    ap.add_argument("--lowering", default="triton", choices=["triton", "mosaic"])
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new shapes after this")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if not args.check and not args.bench and not args.sweep:
        args.check = args.bench = True
    start = time.perf_counter()
    deadline = start + args.budget_s
    on_gpu = jax.default_backend() == "gpu"
    interpret = args.cpu_smoke or not on_gpu
    sh = CPU if args.cpu_smoke else GPU
    min_time = 0.02 if args.cpu_smoke else 0.15
    env = dict(jax=jax.__version__, backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
               interpret=interpret, lowering=args.lowering, shapes=dataclasses.asdict(sh))
    log(json.dumps(env))
    if not on_gpu and not args.cpu_smoke:
        log("no GPU: use --cpu-smoke")
        return 2
    checks, decode, prefill = [], [], []
    copy_gbs = None

    def save(final: bool = False):
        """Write what there is so far (a timeout still leaves a table)."""
        env["wall_s"] = round(time.perf_counter() - start, 1)
        report = render(env, checks, decode, prefill, copy_gbs)
        if final:
            print(report, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "kernel_bench.md"), "w") as f:
                f.write(report)
            with open(os.path.join(args.out, "kernel_bench.json"), "w") as f:
                json.dump(dict(env=env, checks=checks, decode=decode, prefill=prefill, copy_gbs=copy_gbs), f,
                          indent=1)

    if args.check:
        log("== check")
        checks.extend(run_checks(interpret, args.lowering, big=not args.cpu_smoke))
        save()
    if args.bench:
        copy_gbs = copy_bandwidth(16 << 20 if args.cpu_smoke else 2 << 30, min_time)
        log(f"== copy bandwidth {copy_gbs:.0f} GB/s")
        log("== decode")
        bench_decode(sh, interpret=interpret, lowering=args.lowering, min_time=min_time, deadline=deadline,
                     copy_gbs=copy_gbs, rows=decode, on_row=save)
        if not args.no_prefill:
            log("== prefill")
            bench_prefill(sh, interpret=interpret, lowering=args.lowering, min_time=min_time, deadline=deadline,
                          rows=prefill, on_row=save)
    if args.sweep:
        log("== sweep")
        sweep = sweep_decode(sh, interpret=interpret, lowering=args.lowering, min_time=min_time,
                             deadline=time.perf_counter() + args.budget_s)
        if args.out:
            with open(os.path.join(args.out, "kernel_sweep.json"), "w") as f:
                json.dump(sweep, f, indent=1)
    save(final=True)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
