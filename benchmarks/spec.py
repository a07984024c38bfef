"""Speculative decoding: tokens/s with and without it, single stream and at batch 64.

    python benchmarks/spec.py [--model smollm2-135m] [--max-tokens 64,256] [--batch 64]
                              [--reps 2] [--temperature T] [--draft [PATH]]
                              [--engine-arg KEY=VALUE ...]

Single stream (one request at a time, greedy unless `--temperature`, SmolLM2's chat template): copy-heavy prompts (repeat
or edit a given code block, answer with quotes from a given text) and free-form prompts, each run
with speculation off (`spec_decode=False`: no drafts, so its steps are scheduled ahead as a plain
engine's are) and on (n-gram prompt lookup; `--draft` adds a draft model, by default the target
itself, which shows the machinery, not a speed-up). Reports output
tokens/s over each whole request and, single stream, over its decode phase alone (the tokens
after the first over the time after it: speculation's own speed-up, without the prefill both
pay alike), acceptance rate and mean accepted length (tokens per verification step), and checks
the output is identical (greedy, or seeded sampling at `--temperature`: n-gram drafts are
verified against the tokens sampled at their rows, so they never change a request's tokens). Single streams run at each cap of `--max-tokens` (answers stop at
EOS before it): 64 tokens are the first half of a copy (the code block is ~130 tokens), where the
answer's opening (a code fence, a sentence before the quote), which no lookup predicts, weighs
most; 256 lets every answer run to its end, the whole copy a user asked for. Batches of 8 and
`--batch` requests at once (the same prompts, repeated): throughput with the adaptive policy
(speculation shrinks, then switches off, as the batch grows: sched/spec_policy.py) vs
speculation off, vs speculation forced on at any size (the policy's batch rule off), and with
the uncalibrated budget of 64 tokens per step. `warmup()`
compiles every shape and calibrates the policy's batch budget on this device; untimed passes
warm the caches; configurations run interleaved `--reps` times and the fastest run of each
counts, since the machine is shared. Its engine warms up ~60 executables at `--batch 64`
(~45,000 memory mappings on Linux, under the default `vm.max_map_count` of 65,530;
docs/performance.md says why that matters). `--engine-arg` overrides the settings above too
(e.g. `max_num_batched_tokens=128`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxinfer import LLM, SamplingParams  # noqa: E402
from peers import parse_engine_args  # noqa: E402

CODE = '''def moving_average(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
TEXT = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin "
        "encompasses seven million square kilometres, of which five and a half million square "
        "kilometres are covered by the rainforest. The majority of the forest is contained within "
        "Brazil, with sixty percent of the rainforest, followed by Peru with thirteen percent and "
        "Colombia with ten percent.")
COPY_PROMPTS = [
    f"Repeat the following code exactly, without any comment:\n\n{CODE}",
    f"Rename the variable `total` to `running_sum` in this code and output the whole code:\n\n{CODE}",
    f"Add a docstring line to this function and output the whole code:\n\n{CODE}",
    f"Text: {TEXT}\n\nQuote, word for word, the sentences of the text that mention Brazil and Peru.",
]
FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five tips for learning a new language.",
    "Describe the water cycle.",
]


def chat_ids(llm: LLM, prompt: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True)


def run_single(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> dict:
    eng = llm.engine
    m0 = eng.metrics
    tokens, seconds, decode_seconds = [], 0.0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.generate([p], sp, use_tqdm=False)[0]
        seconds += time.perf_counter() - t0
        tokens.append(out.outputs[0].token_ids)
        decode_seconds += out.metrics.last_token_time - out.metrics.first_token_time
    r = _result(eng, m0, tokens, seconds)
    # the decode phase alone: tokens after each request's first over the time after it (the
    # prefill and its first token cost the same with or without speculation)
    r["decode_tok_s"] = (sum(len(t) - 1 for t in tokens) / decode_seconds if decode_seconds > 0
                         else None)  # None: every answer was one token
    return r


def run_batch(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> dict:
    eng = llm.engine
    m0 = eng.metrics
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return _result(eng, m0, [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0)


def _result(eng, m0, tokens, seconds) -> dict:
    m = eng.metrics
    drafted = m.num_draft_tokens_total - m0.num_draft_tokens_total
    accepted = m.num_accepted_tokens_total - m0.num_accepted_tokens_total
    steps = m.num_spec_steps_total - m0.num_spec_steps_total
    num_out = sum(len(t) for t in tokens)
    return dict(tok_s=num_out / seconds, decode_tok_s=None, seconds=seconds, num_out=num_out,
                tokens=tokens,
                acceptance=accepted / drafted if drafted else float("nan"),
                mean_len=1 + accepted / steps if steps else float("nan"),
                drafted=drafted, compiles=m.num_compilations - m0.num_compilations)


def warm(llm: LLM, prompts, sps) -> None:
    for sp in sps:  # every prefill bucket, decode and verify shape, untimed
        short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                               spec_decode=sp.spec_decode)
        for p in prompts:
            llm.generate([p], short, use_tqdm=False)


def set_policy(llm: LLM, **changes) -> None:
    """Swap the engine's speculation policy (the scheduler's; the engine reads it from there)."""
    policy = dataclasses.replace(llm.engine.spec_policy, **changes)
    llm.engine.scheduler.spec_policy = policy


def best_of(reps: int, runs: dict) -> dict:
    """Runs each config `reps` times, interleaved (the machine is shared and noisy); keeps each
    config's fastest run. `runs`: name -> (setup, fn)."""
    best = {}
    for _ in range(reps):
        for name, (setup, fn) in runs.items():
            setup()
            r = fn()
            if name not in best or r["tok_s"] > best[name]["tok_s"]:
                best[name] = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", default="64,256",
                    help="single-stream caps on each answer, comma-separated (each one run)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-max-tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions; the best counts")
    ap.add_argument("--k", type=int, default=None,
                    help="num_speculative_tokens (default: the engine's, 16 for n-gram drafts)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature, seeded (default 0: greedy)")
    ap.add_argument("--draft", nargs="?", const="", default=None,
                    help="also a draft model (default: the target itself)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig setting (repeatable; values as JSON), e.g. "
                         "int8_activations=true")
    args = ap.parse_args()

    common = dict(page_size=16, num_pages=2048, max_num_seqs=max(args.batch, 8),
                  max_num_batched_tokens=256, max_model_len=1024,
                  **({} if args.k is None else {"num_speculative_tokens": args.k}))
    common.update(parse_engine_args(args.engine_arg))  # --engine-arg overrides the settings above
    caps = [int(c) for c in args.max_tokens.split(",")]
    sampling = dict(temperature=args.temperature, seed=0 if args.temperature > 0 else None)
    sp_off = {c: SamplingParams(max_tokens=c, **sampling, spec_decode=False) for c in caps}
    sp_on = {c: SamplingParams(max_tokens=c, **sampling) for c in caps}
    rows, identical = [], True

    llm = LLM(args.model, speculative_method="ngram", **common)
    llm_k = llm.engine.engine_config.num_speculative_tokens  # --k, or the engine's default
    workloads = {"copy": [chat_ids(llm, p) for p in COPY_PROMPTS],
                 "free": [chat_ids(llm, p) for p in FREE_PROMPTS]}
    t0 = time.perf_counter()
    llm.engine.warmup()  # every shape, then the policy's batch budget from measured step times
    budget = llm.engine.spec_policy.max_batched_tokens
    print(f"warm-up {time.perf_counter() - t0:.0f} s, {llm.engine.metrics.num_compilations} "
          f"executables; calibrated budget: {budget} decode + draft tokens per step", flush=True)
    warm(llm, workloads["copy"] + workloads["free"], [sp_off[caps[0]], sp_on[caps[0]]])
    adaptive = lambda: set_policy(llm, max_batched_tokens=budget)  # noqa: E731
    default = lambda: set_policy(llm, max_batched_tokens=64)  # noqa: E731  uncalibrated default
    forced = lambda: set_policy(llm, max_batched_tokens=10**6)  # noqa: E731  batch rule off
    single = {}
    for cap in caps:
        for name, prompts in workloads.items():
            off, on = sp_off[cap], sp_on[cap]
            best = best_of(args.reps, {
                "off": (adaptive, lambda: run_single(llm, prompts, off)),
                "ngram adaptive": (adaptive, lambda: run_single(llm, prompts, on)),
                "ngram budget 64": (default, lambda: run_single(llm, prompts, on)),
            })
            single[name, cap] = best["off"]
            for mode, r in best.items():
                same = None if mode == "off" else r["tokens"] == best["off"]["tokens"]
                identical &= same is not False
                rows.append((f"{name} <={cap}", mode, r, same))
            print(f"single {name} <={cap}: "
                  + ", ".join(f"{m} {r['tok_s']:.1f}" for m, r in best.items()) + " tok/s",
                  flush=True)

    all_prompts = workloads["copy"] + workloads["free"]
    sp_b_off = SamplingParams(max_tokens=args.batch_max_tokens, **sampling, ignore_eos=True,
                              spec_decode=False)
    sp_b_on = SamplingParams(max_tokens=args.batch_max_tokens, **sampling, ignore_eos=True)
    for batch in sorted({len(all_prompts), args.batch}):
        prompts = [all_prompts[i % len(all_prompts)] for i in range(batch)]
        for setup, sp in ((adaptive, sp_b_off), (adaptive, sp_b_on), (default, sp_b_on),
                          (forced, sp_b_on)):
            setup()
            run_batch(llm, prompts, sp)  # untimed: caches warm
        best = best_of(args.reps, {
            "off": (adaptive, lambda: run_batch(llm, prompts, sp_b_off)),
            "ngram adaptive": (adaptive, lambda: run_batch(llm, prompts, sp_b_on)),
            "ngram budget 64": (default, lambda: run_batch(llm, prompts, sp_b_on)),
            "ngram forced": (forced, lambda: run_batch(llm, prompts, sp_b_on)),
        })
        for mode, r in best.items():
            same = None if mode == "off" else r["tokens"] == best["off"]["tokens"]
            identical &= same is not False
            rows.append((f"batch {batch}", mode, r, same))
        print(f"batch {batch}: " + ", ".join(f"{m} {r['tok_s']:.1f}" for m, r in best.items())
              + " tok/s", flush=True)
    adaptive()
    del llm
    gc.collect()

    if args.draft is not None:
        draft = args.draft or args.model
        llm = LLM(args.model, speculative_method="draft", draft_model=draft, **common)
        warm(llm, workloads["copy"] + workloads["free"], [sp_on[caps[0]]])
        for cap in caps:
            for name, prompts in workloads.items():
                on = run_single(llm, prompts, sp_on[cap])
                # a draft model's sampled drafts go through the rejection rule: same tokens greedy
                same = (on["tokens"] == single[name, cap]["tokens"] if args.temperature == 0
                        else None)
                identical &= same is not False
                rows.append((f"{name} <={cap}", f"draft={os.path.basename(draft)}", on, same))
        del llm

    sampling_name = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, seeded"
    print(f"\nSpeculative decoding, {args.model}, {sampling_name}, chat template, k={llm_k}, "
          f"single streams (copy/free <=N: N tokens a prompt at most, stopping at EOS), batches x "
          f"{args.batch_max_tokens} tokens, best of {args.reps}, CPU={os.cpu_count()} cores; "
          f"adaptive = calibrated batch budget {budget} tokens/step"
          + (f"; engine: {args.engine_arg}" if args.engine_arg else ""))
    print("tok/s: output tokens over the whole of each request (prefill included); decode tok/s: "
          "tokens after each request's first over the time after it (single stream only)")
    print(f"{'workload':>14} | {'speculation':>15} | {'tok/s':>7} | {'ratio':>6} | "
          f"{'decode tok/s':>12} | {'ratio':>6} | {'accept':>6} | {'mean len':>8} | "
          f"{'drafts':>6} | same")
    print("-" * 114)
    base, decode_base = {}, {}
    for workload, mode, r, same in rows:
        base.setdefault(workload, r["tok_s"])
        ratio = r["tok_s"] / base[workload]
        decode = r["decode_tok_s"]
        if decode is None:
            decode_cols = f"{'':>12} | {'':>6}"
        else:
            decode_base.setdefault(workload, decode)
            decode_cols = f"{decode:12.1f} | {decode / decode_base[workload]:5.2f}x"
        print(f"{workload:>14} | {mode:>15} | {r['tok_s']:7.1f} | {ratio:5.2f}x | {decode_cols} | "
              f"{r['acceptance']:6.1%} | {r['mean_len']:8.2f} | {r['drafted']:6d} | "
              f"{'' if same is None else same}")
    print(f"{sampling_name} output identical with and without speculation: {identical}")


if __name__ == "__main__":
    main()
