"""`jaxinfer bench`: the flags, the runs (one per request rate), the table, the JSON and the PNG.

    jaxinfer bench --model smollm2-135m --num-prompts 64 --input-len 128 --output-len 64
    jaxinfer bench --url http://127.0.0.1:8000 --request-rate 1,4,16,inf --max-concurrency 32

Without --url the engine runs in this process (the engine flags apply): offline throughput, with
the same latency metrics taken at step boundaries. With --url it measures a running server (its
first model unless --model); the API key comes from --api-key or $JAXINFER_API_KEY.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time

from jaxinfer.bench.metrics import summarize, table, tokens_over_time
from jaxinfer.bench.workload import Workload, arrival_offsets, make_requests
from jaxinfer.config_args import add_engine_args, engine_kwargs


def add_bench_args(parser: argparse.ArgumentParser, *, default_model: str) -> None:
    parser.add_argument("--url", default=None,
                        help="a running server (online serving benchmark); without it the "
                             "engine runs in process (offline throughput)")
    parser.add_argument("--model", default=None,
                        help=f"offline: the model to load (default: {default_model}); online: "
                             "the model name to send (default: the server's first)")
    parser.set_defaults(bench_default_model=default_model)
    parser.add_argument("--api-key", default=None, help="online: default $JAXINFER_API_KEY")
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=Workload.num_requests)
    g.add_argument("--input-len", type=int, default=Workload.input_len, help="prompt tokens")
    g.add_argument("--output-len", type=int, default=Workload.output_len, help="output tokens")
    g.add_argument("--range-ratio", type=float, default=Workload.range_ratio,
                   help="lengths uniform within +-this fraction of the means")
    g.add_argument("--request-rate", default="inf",
                   help="requests/s (Poisson arrivals), comma-separated for a sweep; inf sends "
                        "all at once (default: %(default)s)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="online: requests in flight at most (default: no limit)")
    g.add_argument("--seed", type=int, default=Workload.seed)
    g = parser.add_argument_group("output")
    g.add_argument("--result-json", default="bench.json", help="default: %(default)s")
    g.add_argument("--plot", default="bench.png", help="PNG path (default: %(default)s)")
    add_engine_args(parser, exclude=("seed",))


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rate {text!r}: numbers or inf, comma-separated") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise ValueError(f"--request-rate {text!r}: every rate must be positive (or inf)")
    return rates


def run_bench(args: argparse.Namespace) -> int:
    workload = Workload(num_requests=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed)
    rates = parse_rates(args.request_rate)
    requests = make_requests(workload)
    if args.url:
        from jaxinfer.bench.online import run_online, server_model

        api_key = args.api_key or os.environ.get("JAXINFER_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        model = args.model or asyncio.run(server_model(args.url, headers))
        target = f"{args.url} ({model})"

        def run(offsets):
            return asyncio.run(run_online(args.url, model, requests, offsets,
                                          max_concurrency=args.max_concurrency, api_key=api_key))
    else:
        from jaxinfer.bench.offline import run_offline
        from jaxinfer.engine import LLMEngine

        model = args.model or args.bench_default_model
        t0 = time.perf_counter()
        engine = LLMEngine(model, **engine_kwargs(args))
        print(f"engine built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        target = f"{model} (in process)"
        run_offline(engine, requests[:1], [0.0])  # compiles the first shapes outside the runs

        def run(offsets):
            return run_offline(engine, requests, offsets)

    runs = []
    for rate in rates:
        records, duration = run(arrival_offsets(len(requests), rate, args.seed))
        result = {"request_rate": rate, "max_concurrency": args.max_concurrency,
                  **summarize(records, duration),
                  "output_tokens_over_time": tokens_over_time(records)}
        runs.append(result)
        print(table(result, f"{'Serving' if args.url else 'Offline'} benchmark: {target}, "
                            f"rate {'inf' if math.isinf(rate) else f'{rate:g}'}"))
    report = {"mode": "online" if args.url else "offline", "target": target,
              "workload": dataclasses.asdict(workload),
              "runs": [{**r, "request_rate": _json_rate(r["request_rate"])} for r in runs]}
    with open(args.result_json, "w") as f:
        json.dump(report, f, indent=2)
    from jaxinfer.bench.plot import draw

    draw(runs, args.plot, f"jaxinfer bench: {target}")
    print(f"wrote {args.result_json} and {args.plot}", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _json_rate(rate: float):
    return "inf" if math.isinf(rate) else rate
