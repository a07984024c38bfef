"""Fuzzing a served model through its own /openapi.json (schemathesis + hypothesis): longer than
the test suite's seeded run, on a real engine.

    python benchmarks/fuzz.py [MODEL] [--examples 200] [--seed 0] [--url URL]
                              [-- extra `jaxinfer serve` flags]

MODEL "tiny" (the default) is a tiny random Llama written to a temporary folder (needs torch and
transformers, as the tests do); any other is what `jaxinfer serve` takes. Without --url the script
starts the server (127.0.0.1, a free port). For every route and both generation modes (requests
that fit the schema, requests that break it) it sends up to --examples requests; a valid body
names the served model so that it reaches the engine. Prints one line per route (requests, by
status class, 5xx), the totals, the 5xx bodies if any, and then /health and the KV pages still in
use (from /metrics, after the engine went idle): a clean run has no 5xx, /health 200 and 0 pages.
Exit status 0 for a clean run, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import httpx
import hypothesis
import schemathesis
from schemathesis import GenerationMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overload import tiny_model  # noqa: E402
from startup import (  # noqa: E402
    free_port,
    parse_with_server_flags,
    start_server,
    stop_server,
    wait_ready,
)


def fuzz_route(base_url: str, operation, model: str, mode: GenerationMode, examples: int,
               seed: int, statuses: collections.Counter, server_errors: list[str]) -> None:
    @hypothesis.seed(seed)
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck),
                         phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    def send(case):
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        try:
            response = case.call(base_url=base_url, timeout=300)
        except Exception as e:  # noqa: BLE001 - a dropped connection counts as a failure
            statuses["no response"] += 1
            server_errors.append(f"{operation.label} ({mode}): {type(e).__name__}: {e}")
            return
        statuses[f"{response.status_code // 100}xx"] += 1
        if response.status_code >= 500:
            server_errors.append(f"{operation.label} ({mode}): {response.status_code} "
                                 f"{response.text[:300]} <- {case.body!r:.300}")

    try:
        send()
    except hypothesis.errors.Unsatisfiable:
        pass  # nothing to break (a GET without parameters has no invalid requests)


def kv_pages_used(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith("jaxinfer_kv_pages_used "):
            return float(line.split()[1])
    return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="tiny")
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--examples", type=int, default=200, help="per route and generation mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=3600.0)
    args, extra = parse_with_server_flags(p)
    with tempfile.TemporaryDirectory(prefix="jaxinfer-fuzz-") as tmp:
        proc, url = None, args.url
        if url is None:
            model = tiny_model(tmp) if args.model == "tiny" else args.model
            if args.model == "tiny":
                extra = ["--max-model-len", "256", "--page-size", "8", *extra]
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(model, port, ["--no-access-log", *extra],
                                log_path=os.path.join(tmp, "server.log"))
        try:
            ready = wait_ready(url, proc, args.ready_timeout)
            name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            print(f"ready after {ready:.1f} s; fuzzing {url} ({name}), up to {args.examples} "
                  f"requests per route and mode, seed {args.seed}")
            schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
            totals: collections.Counter = collections.Counter()
            server_errors: list[str] = []
            t0 = time.perf_counter()
            print(f"{'route':<32} {'requests':>9} {'2xx':>6} {'4xx':>6} {'5xx':>5} {'seconds':>8}")
            for result in schema.get_all_operations():
                operation = result.ok()
                statuses: collections.Counter = collections.Counter()
                t_route = time.perf_counter()
                for mode in GenerationMode:
                    fuzz_route(url, operation, name, mode, args.examples, args.seed, statuses,
                               server_errors)
                totals.update(statuses)
                print(f"{operation.label:<32} {sum(statuses.values()):>9} {statuses['2xx']:>6} "
                      f"{statuses['4xx']:>6} {statuses['5xx']:>5} "
                      f"{time.perf_counter() - t_route:>8.1f}")
            print(f"{'total':<32} {sum(totals.values()):>9} {totals['2xx']:>6} {totals['4xx']:>6} "
                  f"{totals['5xx']:>5} {time.perf_counter() - t0:>8.1f}"
                  + (f"  ({totals['no response']} without a response)"
                     if totals["no response"] else ""))
            for line in server_errors[:20]:
                print("  " + line)
            time.sleep(1.0)  # the engine's metrics snapshot follows its last request
            health = httpx.get(f"{url}/health").status_code
            pages = kv_pages_used(url)
            print(f"/health {health}; KV pages in use after the run: {pages:.0f}")
            return 0 if not server_errors and health == 200 and pages == 0 else 1
        finally:
            if proc is not None:
                stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
