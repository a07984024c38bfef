"""Do interactive requests keep their latency while a batch runs on the same server?

    python benchmarks/batch_interactive.py [MODEL] [--interactive 16] [--batch-lines 128]
                                           [--policies fcfs] [--shares 1:16,64:512]
                                           [-- extra `jaxinfer serve` flags]

MODEL defaults to the server's default (smollm2-135m). For each scheduling policy in --policies and
each background share S:T in --shares the script starts its own `jaxinfer serve MODEL
--scheduling-policy P --background-max-num-seqs S --background-max-num-batched-tokens T`
(127.0.0.1, a free port, warm-up on, --data-dir in a temporary folder), waits for /health and
sends two untimed requests.

Phase A (idle): K = --interactive streaming chat completions, one after another (fixed prompts,
greedy, `max_tokens` 32, EOS ignored); time to first token and inter-token latency (the gaps
between streamed content chunks) of each.

Phase B (batch): N = --batch-lines chat lines (other fixed prompts, greedy, `max_tokens` 64, EOS
ignored) are uploaded to /v1/files (purpose "batch") and a batch is created on
/v1/chat/completions; once it is `in_progress` the same K requests are sent, one after another,
and timed again; only those that finished while the batch was still in progress count (a short
batch ends before all K are done: use a larger N). Then the batch is waited for; its duration
(in_progress_at -> completed_at, whole seconds as the API gives them) and output tok/s (the output
file's completion tokens / duration).

Batch lines run in the background under either policy (`service_tier` "flex"): behind every
interactive request in the queue, preempted first, and, while an interactive request is in the
engine, in at most S sequences and T tokens of a step (the share); at most --batch-max-in-flight
(64) of them are in the engine at once. The default shares compare the engine's default (1:16)
with a share as large as the whole step (64:512: the batch then slows every step as much as it
likes, which is how the server behaved before it had background requests). Each server start
takes 1-3 minutes on a 2-core CPU. Prints one markdown table: setting, phase, TTFT p50 / p99,
ITL p50 / p99 (ms), and the ratios of phase B to phase A; then the batch's duration and tok/s per
setting. "k/K during" says how many interactive requests phase B counted.

The client is Python on the same machine: on a small CPU box it competes with the server for cores.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import pct
from startup import (
    free_port,
    parse_with_server_flags,
    start_server,
    stop_server,
    wait_ready,
)

TOPICS = ("the ocean", "a mountain village", "the history of bread", "a lighthouse keeper",
          "winter in a city", "how bees make honey", "an old clock", "the first train",
          "a library at night", "a desert storm", "learning to swim", "a market in spring",
          "the moon landing", "a lost umbrella", "a garden in autumn", "a quiet river")


def interactive_prompts(k: int) -> list[str]:
    return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}." for i in range(k)]


def batch_lines(n: int, model: str, max_tokens: int) -> bytes:
    lines = []
    for i in range(n):
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content":
                              f"Tell me a story about {TOPICS[i % len(TOPICS)]} (number {i})."}]}
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(lines) + "\n").encode()


async def one_chat(http: httpx.AsyncClient, model: str, prompt: str,
                   max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one streaming chat completion, in seconds."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": prompt}]}
    t0 = time.perf_counter()
    times: list[float] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"chat request: HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"chat stream error: {chunk['error']}")
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("chat request: no content streamed")
    return times[0] - t0, [b - a for a, b in itertools.pairwise(times)]


async def interactive_phase(http, model, prompts, max_tokens, batch_id=None):
    """TTFTs and gaps of the requests (with `batch_id`: only those that finished while it was still
    in_progress), and how many those were."""
    ttft, itl, during = [], [], 0
    for prompt in prompts:
        t, gaps = await one_chat(http, model, prompt, max_tokens)
        if batch_id is not None:
            status = (await http.get(f"/v1/batches/{batch_id}")).json()["status"]
            if status != "in_progress":
                continue
        during += 1
        ttft.append(t)
        itl.extend(gaps)
    return ttft, itl, during


async def run_policy(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0, connect=30.0)) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        prompts = interactive_prompts(args.interactive)
        for p in prompts[:2]:  # untimed: first use of every path
            await one_chat(http, model, p, args.max_tokens)
        a_ttft, a_itl, _ = await interactive_phase(http, model, prompts, args.max_tokens)

        data = batch_lines(args.batch_lines, model, args.batch_max_tokens)
        r = await http.post("/v1/files", data={"purpose": "batch"},
                            files={"file": ("batch.jsonl", data, "application/jsonl")})
        r.raise_for_status()
        r = await http.post("/v1/batches", json={"input_file_id": r.json()["id"],
                                                 "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"})
        r.raise_for_status()
        batch_id = r.json()["id"]
        while (status := (await http.get(f"/v1/batches/{batch_id}")).json()["status"]) in (
                "validating",):
            await asyncio.sleep(0.05)
        if status != "in_progress":
            raise RuntimeError(f"the batch is {status} before phase B started")
        b_ttft, b_itl, during = await interactive_phase(http, model, prompts, args.max_tokens,
                                                        batch_id)
        while True:
            batch = (await http.get(f"/v1/batches/{batch_id}")).json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.2)
        if batch["status"] != "completed":
            raise RuntimeError(f"the batch ended {batch['status']}: {batch.get('errors')}")
        counts = batch["request_counts"]
        out = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text
        tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                     for line in out.splitlines() if line.strip())
        duration = batch["completed_at"] - batch["in_progress_at"]
        return {"A": (a_ttft, a_itl), "B": (b_ttft, b_itl), "during": during,
                "batch": {"completed": counts["completed"], "failed": counts["failed"],
                          "seconds": duration, "tokens": tokens}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--interactive", type=int, default=16, help="K interactive requests a phase")
    p.add_argument("--max-tokens", type=int, default=32, help="of each interactive request")
    p.add_argument("--batch-lines", type=int, default=128, help="N lines in the batch")
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--policies", default="fcfs",
                   help="scheduling policies, one server each (e.g. priority,fcfs)")
    p.add_argument("--shares", default="1:16,64:512",
                   help="background shares SEQS:TOKENS, one server each per policy")
    p.add_argument("--ready-timeout", type=float, default=3600.0)
    args, extra = parse_with_server_flags(p)
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxinfer-batch-interactive-") as tmp:
        for policy, share in itertools.product(args.policies.split(","), args.shares.split(",")):
            seqs, tokens = share.split(":")
            name = f"{policy} {seqs}:{tokens}"
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log_path = os.path.join(tmp, f"server-{policy}-{seqs}-{tokens}.log")
            proc = start_server(args.model, port,
                                ["--scheduling-policy", policy, "--no-access-log",
                                 "--background-max-num-seqs", seqs,
                                 "--background-max-num-batched-tokens", tokens,
                                 "--data-dir", os.path.join(tmp, f"data-{policy}-{seqs}-{tokens}"),
                                 *extra], log_path=log_path)
            try:
                ready = wait_ready(url, proc, args.ready_timeout)
                print(f"{name}: ready after {ready:.1f} s", flush=True)
                results[name] = asyncio.run(run_policy(url, args))
            except Exception:
                with open(log_path) as f:
                    print(f.read()[-4000:], file=sys.stderr)
                raise
            finally:
                stop_server(proc)

    print(f"\n{args.model}: K={args.interactive} sequential streaming chats (max_tokens "
          f"{args.max_tokens}), batch of N={args.batch_lines} lines (max_tokens "
          f"{args.batch_max_tokens}); times in ms\n")
    print("| policy share | phase | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | ratio B/A (TTFT p50 / p99, "
          "ITL p50 / p99) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for policy, res in results.items():
        stats = {ph: [1000 * pct(xs, q) for xs in res[ph] for q in (50, 99)] for ph in "AB"}
        ratios = " / ".join(f"{b / a:.2f}" for a, b in zip(stats["A"], stats["B"]))
        during = f"B: batch running ({res['during']}/{args.interactive} during)"
        for ph, label in (("A", "A: idle"), ("B", during)):
            cells = " | ".join(f"{v:.0f}" for v in stats[ph])
            print(f"| {policy} | {label} | {cells} | {ratios if ph == 'B' else ''} |")
    print()
    for policy, res in results.items():
        b = res["batch"]
        rate = b["tokens"] / b["seconds"] if b["seconds"] else float("nan")
        print(f"{policy}: batch {b['completed']} completed, {b['failed']} failed, "
              f"{b['seconds']} s, {b['tokens']} output tokens, {rate:.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
