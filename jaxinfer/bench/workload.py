"""The synthetic workload of `jaxinfer bench`: how many requests, their prompt and output lengths
(uniform within +-range_ratio of the means, like vLLM's random dataset) and when they arrive.

Prompts are token ids drawn from [FIRST_ID, LAST_ID), ids every byte-level vocabulary has, so a
prompt is exactly its length on any model (no tokenizer round trip); outputs are exactly their
length (ignore_eos, greedy). Arrivals: all at once (rate inf) or a Poisson process of `rate`
requests/s; `max_concurrency` caps the requests in flight (online only).
"""

from __future__ import annotations

import dataclasses
import math
import random

FIRST_ID, LAST_ID = 16, 256


@dataclasses.dataclass(frozen=True)
class Workload:
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    seed: int = 0

    def __post_init__(self):
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_requests, input_len and output_len must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio={self.range_ratio} must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(w: Workload) -> list[BenchRequest]:
    rng = random.Random(w.seed)

    def length(mean: int) -> int:
        lo, hi = max(1, round(mean * (1 - w.range_ratio))), max(1, round(mean * (1 + w.range_ratio)))
        return rng.randint(lo, hi)

    return [BenchRequest([rng.randrange(FIRST_ID, LAST_ID) for _ in range(length(w.input_len))],
                         length(w.output_len)) for _ in range(w.num_requests)]


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent: 0 for rate inf, else
    exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate {rate} must be positive (or inf)")
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
