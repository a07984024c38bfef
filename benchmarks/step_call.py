"""What a step's call costs around its computation: the runner's call against a plain one.

    JAX_PLATFORMS=cpu python benchmarks/step_call.py [--batches 1,16] [--rounds 100]

The runner (jaxinfer/runtime/runner.py) passes the weights to its jitted step as one flat tuple of
arrays, flattened once when it starts, hands the packed step buffer over as numpy, and fetches the
sample as one array (runtime/step.py's `flat_state` and `pack_output`). The plain call is what
jitting the step over the model's nnx.State gives: the state flattened node by node on every
call, the buffer put on the device first, the sample's four arrays fetched one by one. Both run
the same decode step (B sequences after an 8-token prompt, float16 KV cache) with the same
compiled computation, interleaved `--rounds` times in one process; the table has the median
and best milliseconds of each, the ratio of the medians, and whether both sampled the same
tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.runtime.runner import logprob_level  # noqa: E402
from jaxinfer.runtime.step import step_fn  # noqa: E402


def decode_step_input(llm: LLM, batch: int):
    """The StepInput of a decode step of `batch` sequences (the engine's own, captured)."""
    runner, seen = llm.engine.runner, []
    dispatch = runner.dispatch  # the engine starts its steps through it

    def capture(step_input):
        seen.append(step_input)
        return dispatch(step_input)

    runner.dispatch = capture
    try:
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + i] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                     use_tqdm=False)
    finally:
        del runner.dispatch  # back to the method
    return [si for si in seen if si.num_rows == batch][-1]


def plain_call(runner, step_input):
    """The step jitted over the nnx.State, compiled for this input's layout -> a function that runs
    it once the plain way and returns the sampled token ids."""
    buf, layout = step_input.pack()
    level = logprob_level(step_input)
    flags, graphdef = runner.flags, runner.graphdef
    jitted = jax.jit(lambda state, kv, b, lvl: step_fn(graphdef, state, kv, b, lvl, layout, flags),
                     donate_argnums=(1,))
    compiled = jitted.lower(runner.state, runner.kv_cache, jax.device_put(buf), level).compile()

    def run():
        b, _ = step_input.pack()  # as the runner packs its input on every call
        out, runner.kv_cache = compiled(runner.state, runner.kv_cache, jax.device_put(b), level)
        return jax.device_get(out).token_ids[:step_input.num_rows]
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, max_num_seqs=max(batches), num_pages=256, max_model_len=256,
              kv_cache_dtype="float16")
    runner = llm.engine.runner
    print(f"{args.model}, one decode step (8-token context), {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} cores; {args.rounds} interleaved rounds")
    print("| batch | runner's call: median / best ms | plain call: median / best ms | "
          "plain / runner (medians) | same tokens |")
    print("|---|---|---|---|---|")
    for batch in batches:
        step_input = decode_step_input(llm, batch)
        plain = plain_call(runner, step_input)
        calls = {"runner": lambda: runner.execute(step_input).token_ids, "plain": plain}
        times = {name: [] for name in calls}
        tokens = {name: fn() for name, fn in calls.items()}  # compiled, caches warm
        for _ in range(args.rounds):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        r, p = times["runner"], times["plain"]
        same = bool(np.array_equal(tokens["runner"], tokens["plain"]))
        print(f"| {batch} | {np.median(r):.2f} / {min(r):.2f} | {np.median(p):.2f} / {min(p):.2f} "
              f"| {np.median(p) / np.median(r):.2f}x | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
