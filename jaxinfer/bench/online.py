"""Online benchmark: the workload sent to a running server's /v1/completions (token-id prompts,
streamed, greedy, ignore_eos), each request at its arrival time, at most `max_concurrency` in
flight. A token's time is when its chunk arrived; when the server sent fewer chunks than the
usage's completion_tokens (it merges tokens for a lagging client, or holds back a partial
character), the rest count at the last chunk's time."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from jaxinfer.bench.metrics import RequestRecord
from jaxinfer.bench.workload import BenchRequest


async def server_model(url: str, headers: dict) -> str:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as http:
        r = await http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def run_online(url: str, model: str, requests: list[BenchRequest], offsets: list[float], *,
                     max_concurrency: int | None = None, api_key: str | None = None,
                     timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """(one record per request, seconds from the start to the last answer)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    records = [RequestRecord(start=o, input_tokens=len(r.prompt_token_ids))
               for r, o in zip(requests, offsets)]
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=30.0)) as http:
        t0 = time.perf_counter()

        async def one(req: BenchRequest, rec: RequestRecord, offset: float) -> None:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            async with gate:
                rec.start = time.perf_counter() - t0
                try:
                    await _stream(http, model, req, rec, t0)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    rec.error = type(e).__name__

        await asyncio.gather(*(one(r, rec, o) for r, rec, o in zip(requests, records, offsets)))
        return records, time.perf_counter() - t0


async def _stream(http: httpx.AsyncClient, model: str, req: BenchRequest, rec: RequestRecord,
                  t0: float) -> None:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            rec.error = f"HTTP {r.status_code}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                rec.error = chunk["error"].get("code") or "stream error"
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", ())):
                rec.token_times.append(time.perf_counter() - t0)
    if usage is None:
        rec.error = "no usage"
        return
    rec.input_tokens = usage["prompt_tokens"]
    n = usage["completion_tokens"]
    if n and not rec.token_times:
        rec.token_times.append(time.perf_counter() - t0)
    rec.token_times[n:] = []
    rec.token_times.extend([rec.token_times[-1]] * (n - len(rec.token_times)))
