"""Load test of the HTTP server: N concurrent streaming clients for D seconds on loopback.

    python benchmarks/serve_load.py [MODEL] [--clients 64] [--duration 60] [--max-tokens 128]
                                    [--url http://127.0.0.1:8000] [-- extra `jaxinfer serve` flags]

Without --url it starts `jaxinfer serve MODEL` itself (127.0.0.1, a free port), waits for /health,
runs the load, and stops it. Each client sends streaming completions (random-word prompts, greedy,
ignore_eos, exactly --max-tokens tokens) back to back until the time is up; requests still running
then are finished and counted. Reports errors, output tokens/s, time to first token, inter-token
latency (gaps between streamed chunks: one token each unless the server coalesced several for a
lagging client) and per-request TPOT ((last chunk - first chunk) / (tokens - 1)), at p50 / p99.

The client is Python on the same machine: on a small CPU box it competes with the server for cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from startup import parse_with_server_flags, served  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend").split()


class Stats:
    def __init__(self):
        self.ttft: list[float] = []
        self.itl: list[float] = []  # gaps between streamed chunks (one token each, unless the
        # server coalesced several because the client lagged)
        self.tpot: list[float] = []  # per request: (last chunk - first chunk) / (tokens - 1)
        self.output_tokens = 0
        self.requests_ok = 0
        self.errors: dict[str, int] = {}

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                      stats: Stats) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunk_times: list[float] = []
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            stats.error(f"HTTP {r.status_code}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                stats.error(chunk["error"].get("code") or "stream error")
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", ())):
                chunk_times.append(time.perf_counter())
    if not chunk_times or usage is None:
        stats.error("no tokens" if not chunk_times else "no usage")
        return
    n = usage["completion_tokens"]
    stats.ttft.append(chunk_times[0] - t0)
    stats.itl.extend(b - a for a, b in zip(chunk_times, chunk_times[1:]))
    if n > 1:
        stats.tpot.append((chunk_times[-1] - chunk_times[0]) / (n - 1))
    stats.output_tokens += n
    stats.requests_ok += 1


async def client_loop(http, model, max_tokens, prompt_words, deadline, stats, rng) -> None:
    while time.perf_counter() < deadline:
        prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
        try:
            await one_request(http, model, prompt, max_tokens, stats)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            stats.error(type(e).__name__)
            await asyncio.sleep(0.1)


async def run_load(url: str, model: str, clients: int, duration: float, max_tokens: int,
                   prompt_words: int, api_key: str | None) -> tuple[Stats, float]:
    stats = Stats()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=timeout) as http:
        t0 = time.perf_counter()
        deadline = t0 + duration
        await asyncio.gather(*[client_loop(http, model, max_tokens, prompt_words, deadline, stats,
                                           random.Random(i)) for i in range(clients)])
        elapsed = time.perf_counter() - t0
    return stats, elapsed


async def warm_up(url: str, model: str, api_key: str | None) -> None:
    """One short request first, so nothing lazy (first use of a path) lands in the numbers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600.0) as http:
        stats = Stats()
        await one_request(http, model, "warm up", 4, stats)
        if stats.errors:
            raise RuntimeError(f"the warm-up request failed: {stats.errors}")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def compilations(url: str, api_key: str | None) -> float | None:
    """The server's `jaxinfer_compilations_total` from /metrics (None if it has none)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    for line in text.splitlines():
        if line.startswith("jaxinfer_compilations_total "):
            return float(line.split()[1])
    return None


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--api-key", default=os.environ.get("JAXINFER_API_KEY"))
    p.add_argument("--ready-timeout", type=float, default=3600.0)
    args, extra = parse_with_server_flags(p)
    with served(args, extra, "serve-load") as url:
        model = served_model(url)
        asyncio.run(warm_up(url, model, args.api_key))
        compiled_before = compilations(url, args.api_key)
        stats, elapsed = asyncio.run(run_load(url, model, args.clients, args.duration,
                                              args.max_tokens, args.prompt_words, args.api_key))
        compiled_after = compilations(url, args.api_key)
    num_errors = sum(stats.errors.values())
    print(f"\n{args.clients} streaming clients, {args.duration:.0f} s (+ drain: {elapsed:.1f} s "
          f"total), {args.max_tokens} output tokens each, {args.prompt_words}-word prompts")
    rows = [
        ("requests ok", f"{stats.requests_ok}"),
        ("errors", f"{num_errors}" + (f" {stats.errors}" if stats.errors else "")),
        ("output tokens/s", f"{stats.output_tokens / elapsed:.1f}"),
        ("requests/s", f"{stats.requests_ok / elapsed:.2f}"),
        ("TTFT p50 (ms)", f"{pct(stats.ttft, 50) * 1e3:.1f}"),
        ("TTFT p99 (ms)", f"{pct(stats.ttft, 99) * 1e3:.1f}"),
        ("ITL p50 (ms)", f"{pct(stats.itl, 50) * 1e3:.1f}"),
        ("ITL p99 (ms)", f"{pct(stats.itl, 99) * 1e3:.1f}"),
        ("TPOT p50 (ms)", f"{pct(stats.tpot, 50) * 1e3:.1f}"),
        ("TPOT p99 (ms)", f"{pct(stats.tpot, 99) * 1e3:.1f}"),
        ("compilations (warm-up)", f"{compiled_before:.0f}" if compiled_before is not None else "?"),
        ("compilations (load)", f"{compiled_after - compiled_before:.0f}"
         if None not in (compiled_before, compiled_after) else "?"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v:>12}")
    return 1 if num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
