"""Decode speed: jaxinfer vs HF transformers `generate` on the same weights, in the same run.

    python benchmarks/decode.py [--model smollm2-135m] [--new-tokens 64] [--batch 32] [--no-hf]

Prints a table of output tokens/s at batch 1 and batch N, and the ratio jaxinfer / transformers.
Greedy, ignore_eos, exact lengths; compile/warm-up runs are excluded from the timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PROMPTS = [
    "The history of the printing press begins",
    "Write a short poem about the sea.",
    "In computer science, a hash table is",
    "The three primary colours are",
]


def bench_jaxinfer(model: str, batch_sizes: list[int], new_tokens: int, engine_kwargs: dict) -> dict:
    from jaxinfer import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for b in batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
        llm.generate(prompts, params, use_tqdm=False)  # compile every shape this run touches
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        results[b] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    return results


def bench_hf(model_path: str, gguf_file: str | None, batch_sizes: list[int], new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(model_path, **kw)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32, **kw).eval()
    results = {}
    for b in batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
        enc = tok(prompts, return_tensors="pt", padding=True)
        gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=tok.pad_token_id)
        with torch.inference_mode():
            model.generate(**enc, **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})
            t0 = time.perf_counter()
            out = model.generate(**enc, **gen)
            dt = time.perf_counter() - t0
        results[b] = (out.shape[1] - enc["input_ids"].shape[1]) * b / dt
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--dummy", action="store_true",
                    help="random weights of MODEL's shapes (a directory with config.json and "
                         "tokenizer files); implies --no-hf")
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()

    from jaxinfer.models.loader import model_source

    source = None if args.dummy else model_source(args.model)
    args.no_hf |= args.dummy
    batch_sizes = [1, args.batch]
    engine_kwargs = dict(max_model_len=512, max_num_seqs=max(batch_sizes), num_pages=1024,
                         attention_backend=args.attention_backend)
    if args.dummy:
        engine_kwargs.update(load_format="dummy", tokenizer=args.model)
    ours = bench_jaxinfer(args.model, batch_sizes, args.new_tokens, engine_kwargs)
    print("jaxinfer tok/s:", {b: round(v, 1) for b, v in ours.items()}, flush=True)
    hf = {} if args.no_hf else bench_hf(source.path, source.gguf_file, batch_sizes, args.new_tokens)

    print(f"\nDecode, {args.model}, greedy, {args.new_tokens} new tokens, float32, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores")
    print(f"{'batch':>6} | {'jaxinfer tok/s':>15} | {'transformers tok/s':>19} | {'ratio':>6}")
    print("-" * 56)
    for b in batch_sizes:
        h = hf.get(b)
        ratio = f"{ours[b] / h:6.2f}" if h else "   n/a"
        hs = f"{h:19.1f}" if h else f"{'n/a':>19}"
        print(f"{b:>6} | {ours[b]:15.1f} | {hs} | {ratio}")


if __name__ == "__main__":
    main()
