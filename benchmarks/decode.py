"""Decode and prefill speed at fixed batch sizes and contexts: jaxinfer beside llama.cpp's
`llama-batched-bench` on the same GGUF, in the same run.

    python benchmarks/decode.py [--model smollm2-135m] [--batches 1,16,64] [--contexts 32,512]
                                [--new-tokens 32] [--llama-batched-bench PATH] [--no-llama] [--hf]
                                [--sync-baseline] [--runs 2]

For each batch B and context C: B prompts of C random tokens (distinct, prefix caching off) are
prefilled, then decoded N more tokens, greedy with EOS ignored. jaxinfer's decode tok/s is
B * N / (time of the N engine steps after every prompt is prefilled): pure decode steps, host
scheduling and detokenization included (the sequences prefilled first have decoded up to B * C /
512 tokens by then, while the others prefilled, so the window starts at contexts of C to that much
more), after an untimed warm-up of every shape bucket; the best
of `--runs` such runs (2) counts. Its prefill tok/s is C / (time to the first token) at B = 1, the
best of two.
`llama-batched-bench` (llama.cpp's own benchmark: `-npp C -ntg N -npl B`) reports the same two
rates (S_TG, S_PP at B = 1) on the same GGUF with all CPU threads; its first configuration is
run twice and the first result dropped (it pays for loading the file). Build it with the
llama.cpp peer build (benchmarks/README.md); its path comes from `--llama-batched-bench` or
$LLAMA_BATCHED_BENCH. `--hf` adds transformers `generate` on the GGUF dequantized to float32 at
batch 1 and the largest batch at the smallest context. `--sync-baseline` also times each case
with the same engine's `async_scheduling` off (the host schedules each step only after the one
before it has returned), runs of the two alternating (each first in turn), and adds the median
of the pairs' ratios (sync time / async time: a noisy machine moves both runs of a pair alike)
and the steps that were scheduled ahead in a run (`auto` does so on a CPU only after small steps:
0 means both columns ran the same loop, and their ratio is the machine's noise).

The table: one row per (B, C), tok/s of each system and jaxinfer's ratio to llama.cpp; then the
prefill row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxinfer.models.loader import model_source  # noqa: E402


def random_prompts(batch: int, context: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 30_000, context).tolist() for _ in range(batch)]


def decode_seconds(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> float:
    """Seconds of `new_tokens` engine steps once every prompt is prefilled (each step then
    decodes one token of every sequence)."""
    from jaxinfer import SamplingParams

    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)  # aborted below
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        engine.step()
    requests = list(sched.running)
    before = sum(r.num_output_tokens for r in requests)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        engine.step()
    seconds = time.perf_counter() - t0
    produced = sum(r.num_output_tokens for r in requests) - before
    for r in requests:
        engine.abort_request(r.request_id)
    if produced != len(prompts) * new_tokens:
        raise RuntimeError(f"{tag}: {produced} tokens in {new_tokens} steps of {len(prompts)} "
                           f"sequences ({len(requests)} were running): a larger max_model_len?")
    return seconds


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_jaxinfer(model: str, batches: list[int], contexts: list[int], new_tokens: int,
                   engine_kwargs: dict, sync_baseline: bool = False,
                   num_runs: int = 2) -> tuple[dict, float, dict]:
    """({(B, C): decode tok/s}, prefill tok/s of the largest context at B = 1, {(B, C): (decode
    tok/s with async_scheduling off, median async/sync ratio of the pairs, steps scheduled ahead
    a run)} when `sync_baseline`)."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM(model, warmup=True, **engine_kwargs)
    prefill_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    configs = {True: engine.engine_config}
    if sync_baseline:  # only the engine's loop reads the setting: the same executables serve both
        configs[False] = dataclasses.replace(engine.engine_config, async_scheduling="off")

    decode, prefill, sync = {}, 0.0, {}
    for c in contexts:
        for b in batches:
            prompts = random_prompts(b, c, seed=b * 100_000 + c)
            runs = {mode: [] for mode in configs}
            ahead = 0
            for i in range(1 + num_runs):  # the first touches every shape of the case: dropped
                order = list(configs.items())
                for mode, config in order[::-1] if i % 2 else order:  # each first in turn
                    engine.engine_config = config
                    before = engine.scheduler.num_ahead_steps
                    runs[mode].append(decode_seconds(engine, prompts, new_tokens,
                                                     f"{b}x{c}-{mode}-{i}"))
                    if mode and i:
                        ahead += engine.scheduler.num_ahead_steps - before
            engine.engine_config = configs[True]
            decode[(b, c)] = b * new_tokens / min(runs[True][1:])
            if sync_baseline:
                pairs = [s / a for a, s in zip(runs[True][1:], runs[False][1:])]
                sync[(b, c)] = (b * new_tokens / min(runs[False][1:]), float(np.median(pairs)),
                                ahead / num_runs)
            if b == 1 and c == max(contexts):
                prefill = max(c / timed(lambda: llm.generate(prompts, prefill_only,
                                                             use_tqdm=False))
                              for _ in range(2))
            print(f"jaxinfer B={b} C={c}: {decode[(b, c)]:.1f} tok/s", flush=True)
    return decode, prefill, sync


def bench_llama(binary: str, gguf: str, batches: list[int], contexts: list[int],
                new_tokens: int) -> tuple[dict, float]:
    """({(B, C): S_TG tok/s}, S_PP tok/s of the largest context at B = 1)."""
    ctx = max(batches) * (max(contexts) + new_tokens) + 64
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", ",".join(map(str, contexts)), "-ntg", str(new_tokens),
           "-npl", ",".join(map(str, [batches[0]] + batches)), "-t", str(os.cpu_count() or 1),
           "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    seen, decode, prefill = set(), {}, 0.0
    for r in rows:
        key = (r["pl"], r["pp"])
        if key == (batches[0], contexts[0]) and key not in seen:
            seen.add(key)  # the first run of the first configuration: loading, dropped
            continue
        decode[key] = r["speed_tg"]
        if r["pl"] == 1 and r["pp"] == max(contexts):
            prefill = r["speed_pp"]
    return decode, prefill


def bench_hf(folder: str, gguf_file: str, batches: list[int], context: int,
             new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file,
                                                 torch_dtype=torch.float32).eval()
    results = {}
    for b in batches:
        ids = torch.tensor(random_prompts(b, context, seed=b * 100_000 + context))
        gen = dict(do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **gen)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
            t_prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1 + new_tokens, min_new_tokens=1 + new_tokens, **gen)
            results[(b, context)] = b * new_tokens / (time.perf_counter() - t0 - t_prefill)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a known name or a .gguf file")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="32,512")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--llama-batched-bench", default=os.environ.get("LLAMA_BATCHED_BENCH") or
                    os.path.expanduser("~/.cache/jaxinfer-peers/llama-batched-bench"))
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--hf", action="store_true", help="also transformers generate (slow)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig setting for jaxinfer (repeatable; values as JSON)")
    ap.add_argument("--sync-baseline", action="store_true",
                    help="also decode with async_scheduling off, and print the ratio")
    ap.add_argument("--runs", type=int, default=2,
                    help="timed runs of each case (each mode with --sync-baseline), after one "
                         "untimed")
    args = ap.parse_args()
    batches = sorted(int(x) for x in args.batches.split(","))
    contexts = sorted(int(x) for x in args.contexts.split(","))

    source = model_source(args.model)
    page_size = 16
    # the sequences prefilled first decode while the others prefill (one 512-token chunk a step)
    early = max(batches) * max(contexts) // 512 + 1
    pages_per_seq = -(-(max(contexts) + early + args.new_tokens + 1) // page_size)
    engine_kwargs = dict(max_model_len=pages_per_seq * page_size, page_size=page_size,
                         max_num_seqs=max(batches), num_pages=max(batches) * pages_per_seq + 8,
                         enable_prefix_caching=False)
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        try:
            engine_kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_kwargs[key] = value
    ours, our_prefill, sync = bench_jaxinfer(args.model, batches, contexts, args.new_tokens,
                                             engine_kwargs, args.sync_baseline, args.runs)
    llama, llama_prefill = {}, 0.0
    if not args.no_llama:
        gguf = os.path.join(source.path, source.gguf_file) if source.gguf_file else None
        if gguf is None or not os.path.exists(args.llama_batched_bench):
            print(f"llama-batched-bench skipped: {args.llama_batched_bench} or the GGUF is missing")
        else:
            llama, llama_prefill = bench_llama(args.llama_batched_bench, gguf, batches, contexts,
                                               args.new_tokens)
    hf = {}
    if args.hf:
        hf = bench_hf(source.path, source.gguf_file, [batches[0], batches[-1]], contexts[0],
                      args.new_tokens)

    def cell(v):
        return f"{v:.1f}" if v else "n/a"

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "n/a"

    print(f"\nDecode, {args.model}, greedy, {args.new_tokens} new tokens after a context of C, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores, engine {engine_kwargs}")
    extra = " sync tok/s | async / sync (median of pairs) | steps ahead a run |" if sync else ""
    print("| batch | context | jaxinfer tok/s | llama.cpp tok/s | jaxinfer / llama.cpp | "
          "transformers tok/s |" + extra)
    print("|---|---|---|---|---|---|" + "---|---|---|" * bool(sync))
    for c in contexts:
        for b in batches:
            k = (b, c)
            more = (f" {cell(sync[k][0])} | {sync[k][1]:.2f}x | {sync[k][2]:.0f} |"
                    if sync else "")
            print(f"| {b} | {c} | {cell(ours[k])} | {cell(llama.get(k))} | "
                  f"{ratio(ours[k], llama.get(k))} | {cell(hf.get(k))} |" + more)
    print(f"| prefill, 1 x {max(contexts)} tokens | | {cell(our_prefill)} | {cell(llama_prefill)} "
          f"| {ratio(our_prefill, llama_prefill)} | |" + " | | |" * bool(sync))


if __name__ == "__main__":
    main()
