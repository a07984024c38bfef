"""Continuous vs static batching, KV utilisation, and the prefix cache, on the same engine code.

    python benchmarks/throughput.py [--num-requests 256] [--prefix-requests 64] [--model smollm2-135m]
                                    [--engine-arg KEY=VALUE ...]

Workload (fixed seed): prompt lengths uniform in [16, 1024] tokens, output lengths from an
exponential (mean 128) capped at 512, greedy with ignore_eos so lengths are exact. All modes run
the same requests through the same step and kernels. "static" admits a new batch only when the
whole previous batch has finished; a finished request leaves the batch, so the batch's steps
shrink as it drains. "static-padded" is request-level batching as transformers' `generate` and
other static servers run it: the batch also keeps its shape until its longest request ends, the
finished rows staying in every step as padding (the same executables, a larger bucket).
KV utilisation = live tokens / allocated page slots, sampled every step while requests are
waiting (the pool is saturated). "CPU s" is the process's CPU time: on a shared machine it moves
less with other users' load than the wall-clock rate. The prefix test sends requests that share a
512-token prefix all at once and compares mean time to first token with the prefix cache on and
off (it needs --max-prompt + --cap-out >= 512).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.sched.scheduler import Scheduler  # noqa: E402
from peers import parse_engine_args  # noqa: E402


def workload(n: int, seed: int, vocab: int, max_prompt: int, mean_out: int, cap_out: int):
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(16, max_prompt + 1, size=n)
    out_lens = np.minimum(np.maximum(rng.exponential(mean_out, size=n).astype(int), 1), cap_out)
    prompts = [rng.integers(100, vocab - 100, size=int(L)).tolist() for L in prompt_lens]
    params = [SamplingParams(max_tokens=int(o), temperature=0.0, ignore_eos=True) for o in out_lens]
    return prompts, params


class FixedShapeBuckets:
    """The engine's buckets, but a step is never smaller than the largest batch seen since the
    scheduler last ran empty: finished rows stay as padding until the whole batch is done."""

    def __init__(self, buckets, scheduler):
        self.buckets, self.scheduler, self.batch = buckets, scheduler, 0
        self.page_size = buckets.page_size

    def pick(self, num_tokens: int, num_seqs: int, pages_per_seq: int):
        self.batch = max(self.batch, num_seqs)
        return self.buckets.pick(max(num_tokens, self.batch), max(num_seqs, self.batch),
                                 pages_per_seq)

    def new_batch(self) -> None:
        self.batch = 0


def run_mode(llm: LLM, prompts, params, fixed: FixedShapeBuckets | None = None) -> dict:
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    steps0, preempt0 = eng.metrics.num_steps, eng.metrics.num_preemptions_total
    utils, num_out, t0, cpu0 = [], 0, time.perf_counter(), time.process_time()
    outs = {}
    while eng.has_unfinished_requests():
        if fixed is not None and not eng.scheduler.running:
            fixed.new_batch()  # the previous batch is done: the next one sets the shape
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        st = eng.scheduler.stats()
        if st.num_waiting > 0 and st.num_allocated_slots:
            utils.append(st.kv_utilization)
    dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs.values())
    ttft = [o.metrics.time_to_first_token for o in outs.values()]
    return dict(seconds=dt, out_tok_s=num_out / dt, num_out=num_out, cpu_seconds=cpu,
                kv_util=float(np.mean(utils)) if utils else float("nan"),
                ttft_mean=float(np.mean(ttft)), steps=eng.metrics.num_steps - steps0,
                preemptions=eng.metrics.num_preemptions_total - preempt0,
                tokens={o.request_id: o.outputs[0].token_ids for o in outs.values()})


def prefix_test(llm: LLM, n: int, vocab: int, prefix_len: int = 512, suffix_len: int = 16) -> float:
    rng = np.random.default_rng(7)
    prefix = rng.integers(100, vocab - 100, size=prefix_len).tolist()
    prompts = [prefix + rng.integers(100, vocab - 100, size=suffix_len).tolist() for _ in range(n)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.engine.scheduler.reset_prefix_cache()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return float(np.mean([o.metrics.time_to_first_token for o in outs]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prefix-requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--mean-out", type=int, default=128)
    ap.add_argument("--cap-out", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--num-pages", type=int, default=2048)
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--modes", default="continuous,static,static-padded",
                    help="comma-separated modes to run (e.g. static alone, to finish a long run)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig setting for every mode (repeatable; values as JSON), "
                         "e.g. kv_cache_dtype=float16 (the CPU preset's cache)")
    ap.add_argument("--dummy", action="store_true",
                    help="random weights of the model's shapes (MODEL = a directory with config.json "
                         "and tokenizer files, e.g. configs/models/smollm2-135m-shapes): the same "
                         "compute as the real weights, since lengths are exact (ignore_eos)")
    args = ap.parse_args()

    common = dict(page_size=16, num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_prompt + args.cap_out + 16,
                  **parse_engine_args(args.engine_arg))
    rows = []
    results = {}
    # One engine (one set of compiled executables) for both modes: static only swaps the scheduler.
    if args.dummy:
        common.update(load_format="dummy", tokenizer=args.model)
    llm = LLM(args.model, **common)
    vocab = llm.engine.model_config.vocab_size
    prompts, params = workload(args.num_requests, 0, vocab, args.max_prompt, args.mean_out,
                               args.cap_out)
    t0 = time.perf_counter()
    llm.engine.warmup()
    print(f"warm-up {time.perf_counter() - t0:.0f} s, "
          f"{llm.engine.runner.num_compilations} executables", flush=True)
    eng = llm.engine
    modes = [m for m in args.modes.split(",")
             if not (args.skip_static and m.startswith("static"))]
    buckets = eng.buckets
    for mode in modes:
        ec = dataclasses.replace(eng.engine_config, scheduling=mode.removesuffix("-padded"))
        eng.scheduler = Scheduler(ec, eng.num_pages, eng.max_model_len,
                                  eng.scheduler.eos_token_ids)
        fixed = FixedShapeBuckets(buckets, eng.scheduler) if mode == "static-padded" else None
        eng.buckets = fixed or buckets
        r = run_mode(llm, prompts, params, fixed)
        eng.buckets = buckets
        results[mode] = r
        rows.append((mode, r))
        print(f"[{mode}] {r['out_tok_s']:.1f} out tok/s in {r['seconds']:.0f} s", flush=True)
    on = prefix_test(llm, args.prefix_requests, vocab)
    eng.scheduler.pool.enable_prefix_caching = False
    off = prefix_test(llm, args.prefix_requests, vocab)
    eng.scheduler.pool.enable_prefix_caching = True
    results["prefix"] = (on, off)

    print(f"\nThroughput, {args.model}, {args.num_requests} requests, prompts 16-{args.max_prompt}, "
          f"outputs exp(mean {args.mean_out}) cap {args.cap_out}, greedy, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores"
          f"{', random weights of its shapes' if args.dummy else ''}"
          + (f"; engine: {args.engine_arg}" if args.engine_arg else ""))
    bases = [m for m in ("static", "static-padded") if m in results]
    print(f"{'mode':>13} | {'out tok/s':>9} | {'seconds':>8} | {'CPU s':>7} | {'steps':>6} | "
          f"{'KV util':>7} | "
          f"{'mean TTFT s':>11} | {'preempt':>7} | " + " | ".join(f"vs {b}" for b in bases))
    print("-" * (94 + 18 * len(bases)))
    for mode, r in rows:
        ratios = " | ".join(f"{r['out_tok_s'] / results[b]['out_tok_s']:{len(b) + 2}.2f}x"
                            for b in bases)
        print(f"{mode:>13} | {r['out_tok_s']:9.1f} | {r['seconds']:8.1f} | {r['cpu_seconds']:7.1f} | "
              f"{r['steps']:6d} | "
              f"{r['kv_util']:7.1%} | {r['ttft_mean']:11.2f} | {r['preemptions']:7d} | {ratios}")
    token_sets = [results[m]["tokens"] for m in results if m != "prefix"]
    if len(token_sets) > 1:
        same = all(t == token_sets[0] for t in token_sets[1:])
        print(f"greedy tokens identical across modes: {same}")
    on, off = results["prefix"]
    print(f"\nPrefix cache, {args.prefix_requests} requests sharing a 512-token prefix: mean TTFT "
          f"{on:.3f} s with, {off:.3f} s without -> {off / on:.1f}x lower")


if __name__ == "__main__":
    main()
