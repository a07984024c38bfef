"""Structured output's cost, in process (`LLM`): output tok/s with and without a JSON-schema
constraint at each batch size, and the first-token latency of a constraint never seen before
(compiled on that request) against the same constraint again (cached) and no constraint.

    python benchmarks/structured.py [--model smollm2-135m] [--batches 1,64] [--new-tokens 64]
                                    [--ttft-trials 5]

Throughput: each request is the same short chat prompt, greedy. Unconstrained requests generate
exactly `--new-tokens` tokens (EOS ignored); constrained ones follow a schema of an object holding
a list of strings (up to `--new-tokens` tokens, fewer when the JSON closes early), so the table
divides each run's output tokens by its seconds (prefill included, after an untimed warm-up of
every shape bucket, masked variants included, and an untimed first pass that compiles the
schema), then an untimed pass of each configuration and the best of two timed ones. The
constrained rate pays for the host-side mask (llguidance, per request per step), its copy to the
device and the masked sampler. Ratio = constrained / unconstrained. max_num_seqs is the largest
batch, so each batch runs in one step.

First-token latency (batch 1, prefix caching off, so each trial prefills the prompt): the time
from `add_request` to the engine's first output holding a token, through the engine's step loop
(the request is aborted there). "cold" uses the schema with a property name made unique per trial,
so llguidance compiles it inside that request's `add_request` (the grammar cache is checked to
have missed); "cached" uses the schema compiled earlier; "unconstrained" none. The three cases
take turns, trial by trial, after one untimed run of each; the table gives each case's median
and its difference from the unconstrained median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"},
                         "items": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "items"]}


def unique_schema(tag: str) -> dict:
    """SCHEMA with its first property renamed, so no grammar cache has seen it."""
    name = f"title_{tag}"
    return {"type": "object",
            "properties": {name: {"type": "string"},
                           "items": {"type": "array", "items": {"type": "string"}}},
            "required": [name, "items"]}


def first_token_seconds(engine, request_id: str, prompt, params) -> float:
    """From add_request to the first step output holding a token of `request_id` (then aborted)."""
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    try:
        while True:
            for out in engine.step():
                if out.request_id == request_id and (out.outputs[0].token_ids or out.finished):
                    return time.perf_counter() - t0
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"{request_id} finished with no output")
    finally:
        engine.abort_request(request_id)  # a no-op once it has finished


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ttft-trials", type=int, default=5, help="timed trials of each TTFT case")
    args = ap.parse_args()
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.sampling_params import StructuredOutputs

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, warmup=True, max_num_seqs=max(batches), max_num_batched_tokens=256,
              max_model_len=512, enable_prefix_caching=False)
    warmup_compilations = llm.engine.metrics.num_compilations
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List some fruits as JSON with a title and items."}])
    free = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.new_tokens,
                                 structured_outputs=StructuredOutputs(json=SCHEMA))
    llm.generate([prompt], constrained, use_tqdm=False)  # compiles the schema (cached after)

    def rate(batch: int, params) -> float:
        t0 = time.perf_counter()
        outs = llm.generate([prompt] * batch, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds

    print(f"\ngreedy, {args.new_tokens} output tokens at most, best of 2")
    print("| batch | unconstrained tok/s | JSON-schema tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    for b in batches:
        rate(b, free), rate(b, constrained)  # untimed: first runs of these shapes
        f = max(rate(b, free) for _ in range(2))  # best of two (a shared machine)
        c = max(rate(b, constrained) for _ in range(2))
        print(f"| {b} | {f:.1f} | {c:.1f} | {c / f:.2f} |", flush=True)

    engine, grammars = llm.engine, getattr(llm.engine, "grammars", None)
    nonce = f"{os.getpid()}_{time.time_ns() % 10**6}"
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)

    def case_params(case: str, trial: str) -> SamplingParams:
        if case == "unconstrained":
            return SamplingParams(**greedy)
        schema = SCHEMA if case == "cached" else unique_schema(f"{nonce}_{trial}")
        return SamplingParams(**greedy, structured_outputs=StructuredOutputs(json=schema))

    cases = ("unconstrained", "cached", "cold")
    ttft: dict[str, list[float]] = {c: [] for c in cases}
    for trial in range(-1, args.ttft_trials):  # trial -1: untimed
        for case in cases:
            compiled_before = grammars.num_compiled if grammars is not None else None
            s = first_token_seconds(engine, f"ttft-{case}-{trial}", prompt,
                                    case_params(case, str(trial)))
            if grammars is not None:
                missed = grammars.num_compiled - compiled_before
                if missed != (case == "cold"):
                    raise RuntimeError(f"{case}: {missed} grammar compiles, expected "
                                       f"{int(case == 'cold')}")
            if trial >= 0:
                ttft[case].append(s)
    base = statistics.median(ttft["unconstrained"]) * 1e3
    print(f"\nfirst-token latency at batch 1, median of {args.ttft_trials} trials "
          f"(cold: a schema compiled on that request)")
    print("| case | TTFT ms (median) | added vs unconstrained ms |")
    print("| --- | --- | --- |")
    for case in cases:
        m = statistics.median(ttft[case]) * 1e3
        print(f"| {case} | {m:.1f} | {m - base:+.1f} |")
    extra = llm.engine.metrics.num_compilations - warmup_compilations
    print(f"\nstep executables: {warmup_compilations} at warm-up, {extra} more during the runs")


if __name__ == "__main__":
    main()
