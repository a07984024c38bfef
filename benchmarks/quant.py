"""Weight quantization on SmolLM2-135M-Instruct: resident bytes, perplexity, decode speed.

    python benchmarks/quant.py                  # the model table (all formats in one run)
    python benchmarks/quant.py --matmul         # XLA formulations of the quantized matmul
    python benchmarks/quant.py --no-decode      # bytes + perplexity only (fast)
    python benchmarks/quant.py --forward        # the model's decode forward alone, per format

Model table: one row per weight format, float32 being the GGUF file dequantized (the file is
Q4_1, so "int4-g32" is the file's own weights loaded as stored; its token_embd / tied LM head is
Q8_0, re-quantized for an int4 head). Perplexity is over
tests/data/ppl_text.txt (jaxinfer.perplexity: chunked prefill through the paged cache, 512
tokens a chunk, full left context); decode tokens/s go through jaxinfer.LLM (greedy,
ignore_eos; every engine warmed up first, then the runs interleaved round-robin and the best of
--rounds kept, so that load from other users of a shared machine hits all rows alike).
Ratios are against float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import quant  # noqa: E402
from jaxinfer.models import quantize  # noqa: E402
from jaxinfer.models.perplexity import perplexity  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "ppl_text.txt")
PROMPTS = [
    "The history of the printing press begins",
    "Write a short poem about the sea.",
    "In computer science, a hash table is",
    "The three primary colours are",
]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    engine_kwargs: dict
    requantize: dict | None = None  # QuantConfig fields: quantize the float model (no GGUF import)
    gguf_type: str | None = None  # re-quantize every Linear with gguf-py (llama.cpp's quantizer)
    head: dict | None = None  # QuantConfig fields: then quantize the (float) LM head this way
    decode: bool = True


ROWS = [
    Row("float32", dict(quantization="none")),
    Row("auto (the GGUF's Q4_1 body and Q8_0 head as stored)", dict(quantization="auto")),
    Row("int8", dict(quantization="int8")),
    Row("int8+head", dict(quantization="int8", quantize_lm_head=True)),
    Row("int4-g32 (Q4_1 as stored)", dict(quantization="int4")),
    # the head follows the method: int4, GPTQ against the hidden states of random tokens
    Row("int4-g32+head(int4 GPTQ)", dict(quantization="int4", quantize_lm_head=True)),
    Row("int4-g32+head(int8)", dict(quantization="int4"), head=dict(method="int8"),
        decode=False),
    Row("int4-g32+head(int4 min/max)", dict(quantization="int4"),
        head=dict(method="int4", search=False, lm_head_gptq=False), decode=False),
    Row("int4-g128", dict(quantization="int4", quant_group_size=128)),
    Row("int4-g128+head(int4 GPTQ)", dict(quantization="int4", quant_group_size=128,
                                          quantize_lm_head=True)),
    # every Linear re-quantized from the float weights (the file's Q4_1 values dequantized, so
    # g32 asymmetric min/max gets them back exactly; the search keeps them too)
    Row("int4-g32 sym, requantized", {}, dict(method="int4", symmetric=True), decode=False),
    Row("int4-g32 sym min/max, requant.", {}, dict(method="int4", symmetric=True, search=False),
        decode=False),
    Row("  llama.cpp Q4_0, requant.", {}, gguf_type="Q4_0", decode=False),
    Row("int4-g64 asym, requantized", {}, dict(method="int4", group_size=64), decode=False),
    Row("int4-g64 asym min/max, req.", {}, dict(method="int4", group_size=64, search=False),
        decode=False),
    Row("int4-g128 asym, requantized", {}, dict(method="int4", group_size=128), decode=False),
]


def requantize_with_gguf(model, type_name: str):
    """Every decoder Linear re-quantized by gguf-py (the reference quantizer), imported as stored."""
    import gguf
    from flax import nnx

    from jaxinfer.models.layers import Linear, QuantizedLinear

    qtype = gguf.GGMLQuantizationType[type_name]
    for path, module in list(nnx.iter_modules(model)):
        if type(module) is not Linear or path[0] != "layers":
            continue
        layers = []
        for w in np.asarray(module.weight[...]):  # [K, N] per layer
            raw = gguf.quants.quantize(np.ascontiguousarray(w.T), qtype)
            layers.append(quant.from_gguf(raw, type_name, w.T.shape))
        parent = model
        for key in path[:-1]:
            parent = getattr(parent, key)
        setattr(parent, path[-1], QuantizedLinear(quant.stack(layers), module.bias,
                                                  dtype=module.dtype))
    return model


def weight_bytes(model) -> int:
    from flax import nnx

    return sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model)))


# --- decode -------------------------------------------------------------------------------------


def decode_tok_s(model_name: str, rows: list[Row], batch_sizes, new_tokens: int,
                 rounds: int) -> dict[str, dict]:
    """tokens/s per row and batch size. Every engine is built and warmed up first, then the runs
    are interleaved round-robin and the best of `rounds` is kept, so that load from other users of
    the (shared) machine hits all rows alike."""
    from jaxinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = {b: [PROMPTS[i % len(PROMPTS)] for i in range(b)] for b in batch_sizes}
    engines = {}
    for row in rows:
        engines[row.name] = LLM(model_name, max_model_len=256, max_num_seqs=max(batch_sizes),
                                num_pages=8 * max(batch_sizes) + 1, **row.engine_kwargs)
        for b in batch_sizes:
            engines[row.name].generate(prompts[b], params, use_tqdm=False)  # compile
    best = {name: dict.fromkeys(batch_sizes, 0.0) for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            for b in batch_sizes:
                t0 = time.perf_counter()
                outs = llm.generate(prompts[b], params, use_tqdm=False)
                dt = time.perf_counter() - t0
                tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / dt
                best[name][b] = max(best[name][b], tok_s)
    return best


def model_table(args) -> None:
    from transformers import AutoTokenizer

    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import load_model, model_source

    source = model_source(args.model)
    tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    with open(TEXT) as f:
        token_ids = tok(f.read())["input_ids"]
    print(f"perplexity text: {len(token_ids)} tokens", flush=True)
    batch_sizes = [1, args.batch]
    results = []
    for row in ROWS:
        if args.only and row.name != "float32" and not any(o in row.name for o in args.only):
            continue
        t0 = time.perf_counter()
        _, model = load_model(args.model, EngineConfig(**row.engine_kwargs))
        if row.requantize:
            model = quantize.quantize_model(model, quantize.QuantConfig(**row.requantize))
        if row.gguf_type:
            model = requantize_with_gguf(model, row.gguf_type)
        if row.head:
            model = quantize.quantize_model(model, quantize.QuantConfig(**row.head,
                                                                  quantize_lm_head=True))
        load_s = time.perf_counter() - t0
        r = {"name": row.name, "bytes": weight_bytes(model), "load_s": load_s}
        r["ppl"] = perplexity(model, token_ids)
        del model
        gc.collect()
        results.append(r)
        print(f"  {row.name}: {r}", flush=True)
    if not args.no_decode:
        decode_rows = [row for row in ROWS if row.decode and any(r["name"] == row.name
                                                                 for r in results)]
        speeds = decode_tok_s(args.model, decode_rows, batch_sizes, args.new_tokens, args.rounds)
        for r in results:
            r.update(speeds.get(r["name"], {}))

    base = results[0]
    assert base["name"] == "float32", "the first row must be float32"
    print(f"\nWeight quantization, {args.model}, CPU={os.cpu_count()} cores, "
          f"decode {args.new_tokens} new tokens greedy")
    hdr = (f"{'format':<28} | {'weights MB':>10} | {'x f32':>5} | {'ppl':>7} | {'d ppl':>7} | "
           f"{'tok/s b=1':>9} | {'x f32':>5} | {f'tok/s b={args.batch}':>10} | {'x f32':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        def speed(b):
            if b not in r or b not in base:
                return f"{'-':>9} | {'-':>5}" if b == 1 else f"{'-':>10} | {'-':>5}"
            width = 9 if b == 1 else 10
            return f"{r[b]:{width}.1f} | {r[b] / base[b]:5.2f}"
        print(f"{r['name']:<28} | {r['bytes'] / 1e6:10.1f} | {r['bytes'] / base['bytes']:5.3f} | "
              f"{r['ppl']:7.3f} | {100 * (r['ppl'] / base['ppl'] - 1):+6.2f}% | {speed(1)} | "
              f"{speed(args.batch)}")


# --- matmul formulations ------------------------------------------------------------------------

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192)]


def _best_ms(fn, *a, rounds: int = 30) -> float:
    jax.block_until_ready(fn(*a))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _grouped_matmul(x, qw):
    """The alternative: per-group batched dot on the integer weights, then scale and sum groups."""
    k, n = qw.shape
    gs = qw.group_size
    lo, hi = quant.unpack_int4(qw.values, k)
    q = jnp.concatenate([lo, hi], axis=0).astype(x.dtype).reshape(k // gs, gs, n)
    if qw.mins is None:
        q = q - 8
    xg = x.reshape(x.shape[0], k // gs, gs)
    y = jnp.einsum("bgk,gkn->bgn", xg, q)
    y = jnp.einsum("bgn,gn->bn", y, qw.scales.astype(x.dtype))
    if qw.mins is not None:
        y = y + xg.sum(-1) @ qw.mins.astype(x.dtype)
    return y


def _native_int4_matmul(x, w4, scales):
    """jnp.int4 storage (XLA's own sub-byte type), dequantised in the jit."""
    k, n = w4.shape
    gs = k // scales.shape[0]
    w = (w4.astype(x.dtype).reshape(-1, gs, n) * scales.astype(x.dtype)[:, None, :]).reshape(k, n)
    return x @ w


def matmul_table(args) -> None:
    rng = np.random.default_rng(0)
    print(f"Quantized matmul on XLA {jax.default_backend()} (best of 30, ms), "
          f"SmolLM2 shapes [K -> N]")
    print(f"{'batch':>5} {'shape':>12} | {'f32':>6} | {'int8':>6} | {'int4 deq':>8} | "
          f"{'int4 grp':>8} | {'int4 nat':>8}")
    for b in (1, 32):
        for k, n in SHAPES:
            w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
            x = jnp.asarray(rng.standard_normal((b, k)), jnp.float32)
            q8 = quant.quantize_int8(w)
            q4 = quant.quantize_int4(w, 32, symmetric=True)
            w4 = jnp.asarray(rng.integers(-8, 8, (k, n)), jnp.int4)
            f = jax.jit(lambda x, w: x @ w)
            mm = jax.jit(quant.quantized_matmul)
            t = [_best_ms(f, x, jnp.asarray(w)), _best_ms(mm, x, q8), _best_ms(mm, x, q4),
                 _best_ms(jax.jit(_grouped_matmul), x, q4),
                 _best_ms(jax.jit(_native_int4_matmul), x, w4, q4.scales)]
            print(f"{b:>5} {f'{k}->{n}':>12} | {t[0]:6.3f} | {t[1]:6.3f} | {t[2]:8.3f} | "
                  f"{t[3]:8.3f} | {t[4]:8.3f}", flush=True)

    # 30 stacked layers under lax.scan (weights beyond the caches, as in the model)
    print("\n30 stacked layers of SmolLM2 projections under lax.scan (ms per pass)")
    layer_shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
    stacked = {name: rng.standard_normal((30, *s)).astype(np.float32) * 0.05
               for name, s in layer_shapes.items()}
    formats = {
        "f32": {k: jnp.asarray(v) for k, v in stacked.items()},
        "int8": {k: quant.quantize_int8(v) for k, v in stacked.items()},
        "int4-g32": {k: quant.quantize_int4(v, 32, symmetric=False) for k, v in stacked.items()},
        "int4-g128": {k: quant.quantize_int4(v, 128, symmetric=False) for k, v in stacked.items()},
    }

    def mm(x, w):
        return x @ w if isinstance(w, jax.Array) else quant.quantized_matmul(x, w)

    def body(h, p):
        qkv = mm(h, p["qkv"])
        h = h + mm(qkv[:, :576], p["o"])
        gu = mm(h, p["gate_up"])
        h = h + mm(jax.nn.silu(gu[:, :1536]) * gu[:, 1536:], p["down"])
        return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5), None

    run = jax.jit(lambda x, params: jax.lax.scan(body, x, params)[0])
    print(f"{'batch':>5} | " + " | ".join(f"{name:>9}" for name in formats))
    for b in (1, 32):
        x = jnp.asarray(rng.standard_normal((b, 576)), jnp.float32)
        times = [_best_ms(run, x, p, rounds=10) for p in formats.values()]
        print(f"{b:>5} | " + " | ".join(f"{t:9.2f}" for t in times), flush=True)

    # memory analysis of one jitted call on a realistic shape
    print("\nCompiled memory of quantized_matmul(x[1, 576], W[576 -> 1536]) on this backend:")
    for name, qw in [("int8", quant.quantize_int8(stacked["gate_up"][0][:, :1536])),
                     ("int4-g32", quant.quantize_int4(stacked["gate_up"][0][:, :1536], 32))]:
        stats = jax.jit(quant.quantized_matmul).lower(
            jax.ShapeDtypeStruct((1, 576), jnp.float32), qw).compile().memory_analysis()
        if stats is not None:
            print(f"  {name}: arguments {stats.argument_size_in_bytes / 1e6:.2f} MB, temp "
                  f"{stats.temp_size_in_bytes / 1e6:.2f} MB (the f32 weight would be "
                  f"{576 * 1536 * 4 / 1e6:.2f} MB)")


def forward_table(args) -> None:
    """The model's jitted forward alone (a decode step without the engine around it): T new tokens,
    one per sequence, 6 tokens of context each; interleaved rounds, best kept."""
    from flax import nnx

    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import load_model
    from jaxinfer.ops.kv_cache import AttentionMetadata, allocate_kv_cache

    rows = [r for r in ROWS if r.decode]
    runs = {}
    for row in rows:
        config, model = load_model(args.model, EngineConfig(**row.engine_kwargs))
        graphdef, state = nnx.split(model)

        def forward(state, cache, ids, pos, md, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            hidden, cache = m(ids, pos, cache, md)
            return m.compute_logits(hidden), cache

        for t in (1, args.batch):
            cache = allocate_kv_cache(config, 2 * t + 1, 16, jnp.float32)
            seqs = jnp.arange(t, dtype=jnp.int32)
            md = AttentionMetadata(
                slot_mapping=(2 * seqs + 1) * 16 + 5, cu_q_lens=jnp.arange(t + 1, dtype=jnp.int32),
                kv_lens=jnp.full(t, 6, jnp.int32), page_indices=(2 * seqs + 1)[:, None] + jnp.array(
                    [[0, 1]], jnp.int32), num_seqs=jnp.array([t], jnp.int32))
            fn = jax.jit(forward, donate_argnums=(1,))
            ids, pos = jnp.ones(t, jnp.int32), jnp.full(t, 5, jnp.int32)
            out, cache = fn(state, cache, ids, pos, md)
            jax.block_until_ready(out)
            runs[(row.name, t)] = [fn, state, cache, ids, pos, md]
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds * 2):
        for key, run in runs.items():
            fn, state, cache, ids, pos, md = run
            for _ in range(3):
                t0 = time.perf_counter()
                out, cache = fn(state, cache, ids, pos, md)
                jax.block_until_ready(out)
                best[key] = min(best[key], time.perf_counter() - t0)
            run[2] = cache
    print(f"\nModel forward only (jit, XLA {jax.default_backend()}), ms per step, best of rounds")
    print(f"{'format':<28} | {'T=1':>7} | {'x f32':>5} | {f'T={args.batch}':>7} | {'x f32':>5}")
    base = rows[0].name
    for row in rows:
        cells = [f"{best[(row.name, t)] * 1e3:7.1f} | {best[(base, t)] / best[(row.name, t)]:5.2f}"
                 for t in (1, args.batch)]
        print(f"{row.name:<28} | " + " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="decode runs per row (best kept)")
    ap.add_argument("--matmul", action="store_true", help="time the XLA matmul formulations")
    ap.add_argument("--forward", action="store_true", help="time the model forward alone")
    ap.add_argument("--only", action="append", help="rows whose name contains this (repeatable)")
    args = ap.parse_args()
    if args.matmul:
        matmul_table(args)
    elif args.forward:
        forward_table(args)
    else:
        model_table(args)


if __name__ == "__main__":
    main()
