"""Offline benchmark: the workload through an LLMEngine in this process, stepped here, so every
token's time is when the step that made it returned. Requests join the engine when their arrival
time passes (all at once at rate inf)."""

from __future__ import annotations

import time

from jaxinfer.bench.metrics import RequestRecord
from jaxinfer.bench.workload import BenchRequest
from jaxinfer.engine import LLMEngine
from jaxinfer.sampling_params import SamplingParams


def run_offline(engine: LLMEngine, requests: list[BenchRequest],
                offsets: list[float]) -> tuple[list[RequestRecord], float]:
    """(one record per request, seconds from the first arrival to the last token)."""
    records = [RequestRecord(start=o, input_tokens=len(r.prompt_token_ids))
               for r, o in zip(requests, offsets)]
    order = sorted(range(len(requests)), key=lambda i: offsets[i])
    seen = [0] * len(requests)
    added, finished = 0, 0
    t0 = time.perf_counter()
    while finished < len(requests):
        now = time.perf_counter() - t0
        while added < len(order) and offsets[order[added]] <= now:
            i = order[added]
            params = SamplingParams(max_tokens=requests[i].output_len, temperature=0.0,
                                    ignore_eos=True)
            engine.add_request(f"bench-{i}", requests[i].prompt_token_ids, params)
            records[i].start = now
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, offsets[order[added]] - now)))
            continue
        outputs = engine.step(detokenize=False)
        now = time.perf_counter() - t0
        for out in outputs:
            i = int(out.request_id.removeprefix("bench-"))
            n = len(out.outputs[0].token_ids)
            records[i].token_times.extend([now] * (n - seen[i]))
            seen[i] = n
            if out.finished:
                finished += 1
    return records, time.perf_counter() - t0
