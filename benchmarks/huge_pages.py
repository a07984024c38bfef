"""Decode with the weights on 2 MiB pages (the engine's default on a Linux CPU) against the same
weights on XLA's own 4 KiB pages, in one process.

    JAX_PLATFORMS=cpu python benchmarks/huge_pages.py [--batches 1,16,64] [--reps 8]

The engine puts its weights on huge pages when it starts (jaxinfer/runtime/huge_pages.py). This
script then makes a second copy of every weight array with `jnp.array(copy=True)`, which XLA
allocates as it always does, and decodes the same greedy requests (128 tokens after an 8-token
prompt, EOS ignored) with one copy and then the other, `--reps` times interleaved, swapping only
the runner's parameters. It prints the best and median rates of each and the ratio of the
medians, and checks the two produce the same tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.runtime import huge_pages  # noqa: E402


def anon_huge_kb() -> int | None:
    """This process's AnonHugePages (kB), or None where /proc does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    if not huge_pages.transparent_huge_pages():
        print("this kernel gives no transparent huge pages on request: nothing to compare")
        return 1
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, max_num_seqs=max(batches), num_pages=1024, max_model_len=512,
              kv_cache_dtype="float16")
    runner = llm.engine.runner
    huge = runner.state
    small = jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, huge)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    print(f"{args.model}: AnonHugePages {anon_huge_kb()} kB; {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} cores; {args.max_tokens} tokens a request, {args.reps} interleaved "
          "runs of each")
    print("| batch | 4 KiB pages: best / median tok/s | 2 MiB pages: best / median tok/s | "
          "ratio of medians | same tokens |")
    print("|---|---|---|---|---|")
    for batch in batches:
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + i] for i in range(batch)]
        llm.generate(prompts, sp, use_tqdm=False)  # compiles this batch's shapes
        rates = {"small": [], "huge": []}
        tokens = {}
        for _ in range(args.reps):
            for name, state in (("small", small), ("huge", huge)):
                runner.state = state
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                rates[name].append(args.max_tokens * batch / (time.perf_counter() - t0))
                tokens.setdefault(name, [o.outputs[0].token_ids for o in outs])
        runner.state = huge
        s, h = rates["small"], rates["huge"]
        print(f"| {batch} | {max(s):.1f} / {np.median(s):.1f} | {max(h):.1f} / {np.median(h):.1f} "
              f"| {np.median(h) / np.median(s):.3f} | {tokens['small'] == tokens['huge']} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
