"""`jaxinfer batch` (every line through the server's routes, in process) against `LLM.generate` on
the same requests: the cost of the HTTP-shaped path (validation, response bodies, detokenization
on the event loop) over the bare Python API.

    python benchmarks/batch_job.py [--model smollm2-135m] [--num-lines 128] [--max-tokens 32]

Workload (fixed seed): completion lines with prompts of 8-64 random token ids, greedy, ignore_eos
so every line generates exactly --max-tokens tokens. Each path runs once untimed (compiles), then
timed; the table gives output tokens/s and the ratio batch / generate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxinfer import LLM, SamplingParams  # noqa: E402
from serve.batch import BatchOptions, run_batch_with  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-lines", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_model_len=512)
    rng = np.random.default_rng(0)
    vocab = llm.engine.vocab_size
    prompts = [rng.integers(100, vocab - 100, size=int(n)).tolist()
               for n in rng.integers(8, 65, size=args.num_lines)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
        with open(inp, "w") as f:
            for i, p in enumerate(prompts):
                f.write(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": p, "max_tokens": args.max_tokens,
                                             "temperature": 0, "ignore_eos": True}}) + "\n")

        def via_generate() -> int:
            outs = llm.generate(prompts, sp, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        def via_batch() -> int:
            if os.path.exists(out):
                os.remove(out)  # else the job resumes: every line is answered already
            assert run_batch_with(llm.engine, inp, out, BatchOptions(progress=False)) == 0
            with open(out) as f:
                rows = [json.loads(ln) for ln in f]
            return sum(r["response"]["body"]["usage"]["completion_tokens"] for r in rows)

        results = {}
        for name, fn in (("LLM.generate", via_generate), ("jaxinfer batch", via_batch)):
            fn()  # untimed: compiles the shapes this workload needs
            t0 = time.perf_counter()
            tokens = fn()
            results[name] = (tokens, time.perf_counter() - t0)
    base = results["LLM.generate"][0] / results["LLM.generate"][1]
    print(f"\n{args.num_lines} lines x {args.max_tokens} tokens, {args.model}")
    print(f"{'path':<16} {'tokens':>7} {'seconds':>8} {'out tok/s':>10} {'ratio':>6}")
    for name, (tokens, dt) in results.items():
        print(f"{name:<16} {tokens:>7} {dt:>8.2f} {tokens / dt:>10.1f} {tokens / dt / base:>6.2f}")


if __name__ == "__main__":
    main()
