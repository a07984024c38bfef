"""Overload of the HTTP server: C clients at once against a server that runs `--max-num-seqs` of
them and queues at most `--max-waiting` more; the rest must get 503 with Retry-After, quickly.

    python benchmarks/overload.py [MODEL] [--clients 8,40,80] [--max-num-seqs 8] [--max-waiting 16]
                                  [--max-tokens 32] [--rounds 3] [-- extra `jaxinfer serve` flags]

MODEL "tiny" (the default) is a tiny random Llama written to a temporary folder (needs torch and
transformers, as the tests do); any other is what `jaxinfer serve` takes. The script starts the
server (127.0.0.1, a free port, warm-up on), then per client count runs `--rounds` bursts: every
client sends one non-streaming greedy completion (`--max-tokens` tokens, EOS ignored) at the same
moment. One line per client count: requests, admitted (200), 503s (each checked for Retry-After),
other failures (must be 0), p50 / p99 / max latency of the admitted requests, the 503s' p99
latency, and the server's peak RSS (VmHWM) after the round. /health must be 200 at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from startup import (  # noqa: E402
    free_port,
    parse_with_server_flags,
    start_server,
    stop_server,
    wait_ready,
)

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was"


def tiny_model(folder: str) -> str:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.tiny_models import save_tiny_model

    return str(save_tiny_model("llama", os.path.join(folder, "tiny-llama"), seed=0))


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def burst(url: str, model: str, clients: int, max_tokens: int) -> list[tuple[int, float, str]]:
    """(status, seconds, Retry-After or "") of `clients` requests sent at once."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = asyncio.Event()

        async def one():
            await start.wait()
            t0 = time.perf_counter()
            try:
                r = await http.post("/v1/completions", json=body)
            except httpx.HTTPError as e:
                return -1, time.perf_counter() - t0, type(e).__name__
            return r.status_code, time.perf_counter() - t0, r.headers.get("retry-after", "")

        tasks = [asyncio.create_task(one()) for _ in range(clients)]
        await asyncio.sleep(0.05)
        start.set()
        return await asyncio.gather(*tasks)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="tiny")
    p.add_argument("--clients", default=None, help="client counts (default: 1x, 5x, 10x seqs)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-waiting", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ready-timeout", type=float, default=3600.0)
    args, extra = parse_with_server_flags(p)
    counts = ([int(c) for c in args.clients.split(",")] if args.clients else
              [args.max_num_seqs, 5 * args.max_num_seqs, 10 * args.max_num_seqs])
    with tempfile.TemporaryDirectory(prefix="jaxinfer-overload-") as tmp:
        model = tiny_model(tmp) if args.model == "tiny" else args.model
        if args.model == "tiny":
            extra = ["--max-model-len", "256", "--page-size", "8", *extra]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = os.path.join(tmp, "server.log")
        proc = start_server(model, port, ["--max-num-seqs", str(args.max_num_seqs),
                                          "--max-waiting", str(args.max_waiting),
                                          "--no-access-log", *extra], log_path=log_path)
        try:
            print(f"ready after {wait_ready(url, proc, args.ready_timeout):.1f} s; "
                  f"max_num_seqs={args.max_num_seqs} max_waiting={args.max_waiting} "
                  f"max_tokens={args.max_tokens}, {args.rounds} bursts per row")
            name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            asyncio.run(burst(url, name, 2, args.max_tokens))  # first requests: caches warm
            print(f"{'clients':>8} {'requests':>9} {'admitted':>9} {'503':>6} {'other':>6} "
                  f"{'p50 s':>7} {'p99 s':>7} {'max s':>7} {'503 p99':>8} {'peak RSS':>10}")
            failures = 0
            for clients in counts:
                results = []
                for _ in range(args.rounds):
                    results += asyncio.run(burst(url, name, clients, args.max_tokens))
                ok = [dt for s, dt, _ in results if s == 200]
                refused = [(dt, ra) for s, dt, ra in results if s == 503]
                other = [s for s, _, _ in results if s not in (200, 503)]
                missing_retry = sum(1 for _, ra in refused if not ra)
                failures += len(other) + missing_retry
                print(f"{clients:>8} {len(results):>9} {len(ok):>9} {len(refused):>6} "
                      f"{len(other):>6} {pct(ok, 0.5):>7.2f} {pct(ok, 0.99):>7.2f} "
                      f"{max(ok, default=float('nan')):>7.2f} "
                      f"{pct([dt for dt, _ in refused], 0.99):>8.3f} "
                      f"{peak_rss_mib(proc.pid):>7.0f} MiB")
                if other or missing_retry:
                    print(f"   failures: statuses {sorted(set(other))}, "
                          f"{missing_retry} 503s without Retry-After")
            health = httpx.get(f"{url}/health").status_code
            print(f"/health after the bursts: {health}")
            return 0 if failures == 0 and health == 200 else 1
        finally:
            stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
