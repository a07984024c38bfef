"""Tensor and data parallelism: decode step time and offline throughput per setting.

    JAX_PLATFORMS=cpu python benchmarks/scale.py                  # host devices (default)
    JAX_PLATFORMS=cpu python benchmarks/scale.py --settings 1x1,2x1 --layers 4
    JAX_PLATFORMS=cpu python benchmarks/scale.py --settings 2x1 --attention-backend xla
    JAX_PLATFORMS=cpu python benchmarks/scale.py --settings 1x1,2x1 --quantization int4
    python benchmarks/scale.py --devices real                     # jax.devices(), e.g. GPUs

Each setting TPxDP (tensor_parallel_size x data_parallel_size; default 1x1, 2x1, 4x1, 1x2, 2x2)
runs in a subprocess of its own. With `--devices host` the subprocess sets
XLA_FLAGS=--xla_force_host_platform_device_count=TP*DP before importing jax: fake CPU devices
that all share the same host cores, so the table shows what the sharding costs (collectives,
partitioned executables), not a speedup. With `--devices real` the subprocess uses jax.devices()
as they are (a setting needing more devices than there are fails, and its row says so).

The model is random weights (`load_format="dummy"`) of SmolLM2-135M's shapes changed so every
head count divides 4: hidden 512, 8 query heads and 4 KV heads of 64, intermediate 1536,
vocabulary 49152 (its tokenizer), `--layers` (8) layers, float32. Per setting: an untimed warm-up
(the workload once, compiling its shape buckets), then the workload through `LLM.generate`:
`--requests` (16) prompts of `--prompt-len` (64) random token ids, `--output-len` (32) output
tokens each, greedy, EOS ignored, prefix caching off; then the decode step time: 16 requests
brought to decoding, `--steps` (8) engine steps timed (one step decodes one token of each). The
table gives the step time, output tok/s of the workload and its ratio to tp=1 (1x1).
Every setting runs attention on `--attention-backend` (default "auto": the C++ kernels on a CPU,
run per device under shard_map when tp > 1; docs/scale_out.md), and weights quantized as
`--quantization` (default none; int8 / int4 matmuls run on the same backend's kernels, also per
device). On a shared machine repeat a run before reading much into one row: 8 timed steps move
with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_SHAPES = os.path.join(_ROOT, "configs", "models", "smollm2-135m-shapes")


def model_config(layers: int) -> dict:
    with open(os.path.join(_SHAPES, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  intermediate_size=1536, num_hidden_layers=layers)
    return config


def run_setting(args) -> dict:
    """In the child: one LLM of args.tp x args.dp; returns the measurements."""
    import jax
    import numpy as np

    sys.path.insert(0, _ROOT)
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        with open(path, "w") as f:
            json.dump(model_config(args.layers), f)
        llm = LLM(path, tokenizer=_SHAPES, load_format="dummy", tensor_parallel_size=args.tp,
                  data_parallel_size=args.dp, max_num_seqs=args.requests,
                  max_num_batched_tokens=max(256, args.prompt_len),
                  max_model_len=args.prompt_len + args.output_len + args.steps + 16,
                  enable_prefix_caching=False, attention_backend=args.attention_backend,
                  quantization=args.quantization)
    rng = np.random.default_rng(0)

    def prompts():
        return [rng.integers(100, 30_000, args.prompt_len).tolist() for _ in range(args.requests)]

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts(), params, use_tqdm=False)  # warm-up: compiles the buckets used
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts(), params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    # decode step time: every request prefilled and decoding, then `steps` steps timed
    engine = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(args.requests)]
    for rid, prompt in zip(ids, prompts()):
        engine.add_request(rid, prompt, long)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    engine.step()  # every sequence decodes from here
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - t0) / args.steps
    for rid in ids:
        engine.abort_request(rid)
    return {"devices": f"{len(jax.devices())} x {jax.devices()[0].platform}",
            "attention": getattr(engine, "replicas", [engine])[0].runner.attention_backend,
            "step_ms": step_s * 1e3, "tok_s": out_tokens / seconds, "out_tokens": out_tokens,
            "seconds": seconds, "warmup_s": warmup_s}


def run_child(setting: str, args) -> dict:
    tp, dp = (int(x) for x in setting.split("x"))
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.devices == "host":
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={tp * dp}"])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tp", str(tp), "--dp", str(dp),
           "--layers", str(args.layers), "--requests", str(args.requests),
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
           "--steps", str(args.steps), "--attention-backend", args.attention_backend,
           "--quantization", args.quantization]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return {"error": f"exit {proc.returncode}: " + (lines[-1] if lines else "no output")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="1x1,2x1,4x1,1x2,2x2", help="TPxDP, comma-separated")
    ap.add_argument("--devices", choices=["host", "real"], default="host",
                    help="host: TP*DP fake CPU devices; real: jax.devices() as they are")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "xla", "pallas"],
                    help="the engines' attention_backend (default: auto)")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--timeout", type=float, default=900, help="seconds per setting")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_setting(args)), flush=True)
        return 0

    rows = []
    for setting in [s for s in args.settings.split(",") if s]:
        print(f"running tp x dp = {setting} ...", file=sys.stderr, flush=True)
        rows.append((setting, run_child(setting, args)))
    base = dict(rows).get("1x1", {}).get("tok_s")
    if args.devices == "host":
        print("Host devices (XLA_FLAGS=--xla_force_host_platform_device_count) all share the same "
              "CPU cores: this shows the sharding's overhead, not a speedup. On a GPU machine run "
              "it with `--devices real` (jax.devices()).\n")
    print(f"{args.layers}-layer SmolLM2-shaped model (8 / 4 heads), random weights; "
          f"{args.requests} requests x {args.prompt_len} prompt + {args.output_len} output tokens, "
          f"greedy, weights {args.quantization}; step = one decode step of all requests\n")
    print(f"| setting | devices | attention | step ms (decode, batch {args.requests}) | "
          "output tok/s | ratio to tp=1 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for setting, r in rows:
        tp, dp = setting.split("x")
        name = f"tp={tp} dp={dp}"
        if "error" in r:
            print(f"| {name} | {int(tp) * int(dp)} | | failed: {r['error'].replace('|', '/')} "
                  "| | |")
            continue
        ratio = f"{r['tok_s'] / base:.2f}" if base else "n/a"
        print(f"| {name} | {r['devices']} | {r['attention']} | {r['step_ms']:.1f} | "
              f"{r['tok_s']:.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows), f, indent=1)
    return 1 if any("error" in r for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
