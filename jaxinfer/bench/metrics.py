"""Per-request timings -> vLLM `bench serve`'s metrics: request and token throughput, and TTFT
(time to first token), TPOT (time per output token after the first, per request) and ITL (every
gap between tokens) mean / median / p90 / p99 in milliseconds; and output tokens per second over
time for the plot."""

from __future__ import annotations

import dataclasses

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass
class RequestRecord:
    """One request: when it was sent and when each output token arrived (seconds since the run
    started; a streamed chunk of k tokens counts as k tokens at its time)."""

    start: float
    input_tokens: int
    token_times: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)


def summarize(records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.error is None and r.token_times]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    series = {
        "ttft": [r.token_times[0] - r.start for r in ok],
        "tpot": [(r.token_times[-1] - r.token_times[0]) / (r.output_tokens - 1)
                 for r in ok if r.output_tokens > 1],
        "itl": [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:]) if b > a],
        "e2el": [r.token_times[-1] - r.start for r in ok],
    }
    result = {"completed": len(ok), "failed": len(records) - len(ok), "duration": duration,
              "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
              "request_throughput": len(ok) / duration if duration > 0 else 0.0,
              "output_throughput": out_tokens / duration if duration > 0 else 0.0,
              "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0
              else 0.0,
              "errors": sorted({r.error for r in records if r.error})}
    for name, values in series.items():
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        result[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        result[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        for p in PERCENTILES:
            result[f"p{p}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return result


def tokens_over_time(records: list[RequestRecord], bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive bins of `bin_s` seconds from the start."""
    times = [t for r in records if r.error is None for t in r.token_times]
    if not times:
        return []
    counts = np.bincount((np.asarray(times) // bin_s).astype(int))
    return (counts / bin_s).tolist()


def table(result: dict, title: str) -> str:
    rows = [("Successful requests", f"{result['completed']}"),
            ("Failed requests", f"{result['failed']}"),
            ("Benchmark duration (s)", f"{result['duration']:.2f}"),
            ("Total input tokens", f"{result['total_input_tokens']}"),
            ("Total generated tokens", f"{result['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}")]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        rows.append((f"Mean {label} (ms)", f"{result[f'mean_{name}_ms']:.2f}"))
        for p in PERCENTILES:
            rows.append((f"P{p} {label} (ms)", f"{result[f'p{p}_{name}_ms']:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    bar = "=" * (width + 12)
    lines = [bar, title.center(len(bar)), bar]
    lines += [f"{k + ':':<{width}}{v:>12}" for k, v in rows]
    return "\n".join([*lines, bar])
