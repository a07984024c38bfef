"""The benchmark's PNG: TTFT / TPOT / ITL p50, p90, p99 against the request rate (one point per
run), and output tokens/s over time (one line per run). matplotlib's Agg backend: no display."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from jaxinfer.bench.metrics import PERCENTILES


def draw(runs: list[dict], path: str, title: str) -> None:
    labels = [_rate_label(r["request_rate"]) for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (name, label) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))):
        for p, marker in zip(PERCENTILES, "os^"):
            ax.plot(range(len(runs)), [r[f"p{p}_{name}_ms"] for r in runs], marker=marker,
                    label=f"p{p}")
        ax.set_xticks(range(len(runs)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(f"{label} percentiles")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[3]
    for run, label in zip(runs, labels):
        series = run["output_tokens_over_time"]
        ax.plot(range(len(series)), series, label=f"rate {label}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput over time")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"
