"""Prometheus metrics of one server: its own registry (no global state), the server's histograms and
counters, and gauges/counters read from the engine's last metrics snapshot at scrape time.
`render()` is GET /metrics; `samples()` is the same registry as numbers, which GET
/v1/engine/stats (serve/engine_stats.py) reads, so the two never disagree on a value's source."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxinfer.engine import EngineMetrics
from jaxinfer.engine.async_engine import AsyncEngine

PREFIX = "jaxinfer"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 20.0, 40.0, 80.0)

# (metric, help, kind, the EngineMetrics attribute it reads)
_ENGINE_FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "Requests in the running batch", "gauge", "num_running"),
    ("num_requests_waiting", "Requests queued in the scheduler", "gauge", "num_waiting"),
    ("kv_pages_used", "KV cache pages in use by requests", "gauge", "num_used_pages"),
    ("kv_pages_total", "KV cache pages that can be handed out", "gauge", "num_usable_pages"),
    ("kv_pages_cached", "KV pages kept only for prefix-cache hits", "gauge", "num_cached_pages"),
    ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up", "gauge",
     "prefix_cache_hit_rate"),
    ("preemptions", "Requests preempted (pages taken back, recomputed later)", "counter",
     "num_preemptions_total"),
    ("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache", "counter",
     "prefix_cache_query_tokens"),
    ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", "counter",
     "prefix_cache_hit_tokens"),
    ("kv_page_evictions", "Cached KV pages evicted", "counter", "num_evictions_total"),
    ("spec_draft_tokens", "Speculative draft tokens proposed", "counter", "num_draft_tokens_total"),
    ("spec_accepted_tokens", "Speculative draft tokens accepted", "counter",
     "num_accepted_tokens_total"),
    ("spec_acceptance_rate", "Accepted / proposed speculative draft tokens", "gauge",
     "spec_acceptance_rate"),
    ("compilations", "XLA executables compiled by the engine", "counter", "num_compilations"),
    ("compile_seconds", "Seconds the engine spent compiling", "counter", "compile_seconds"),
    ("engine_steps", "Engine steps run", "counter", "num_steps"),
    ("requests_finished", "Requests the engine finished", "counter", "num_finished_total"),
    ("kv_utilization", "Live tokens / page slots held by running requests", "gauge",
     "kv_utilization"),
)


class _EngineCollector(Collector):
    def __init__(self, async_engine: AsyncEngine):
        self._async_engine = async_engine

    def collect(self):
        ae = self._async_engine
        snapshot: EngineMetrics | None = ae.metrics_snapshot
        if snapshot is not None:  # None until the engine thread took the first one
            for name, help_, kind, attribute in _ENGINE_FIELDS:
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                yield family(f"{PREFIX}_{name}", help_, value=float(getattr(snapshot, attribute)))
        yield GaugeMetricFamily(f"{PREFIX}_server_requests_in_flight",
                                "Engine requests the server is streaming", value=ae.num_in_flight)
        yield GaugeMetricFamily(f"{PREFIX}_server_requests_waiting_first_token",
                                "Admitted engine requests with no token yet (bounded by max_waiting)",
                                value=ae.num_waiting)
        yield CounterMetricFamily(f"{PREFIX}_engine_step_errors",
                                  "Engine steps that raised (their requests failed)",
                                  value=ae.num_step_errors)
        yield GaugeMetricFamily(f"{PREFIX}_ready", "1 once warm-up is done and requests are admitted",
                                value=1.0 if ae.is_ready else 0.0)


class ServerMetrics:
    """The server's metrics. One per app; `render()` gives the Prometheus text format."""

    def __init__(self, async_engine: AsyncEngine):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Request received -> first token sent",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time between output tokens after the first (per request)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Request received -> last token",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Output tokens generated",
                                         registry=r)
        self.requests = Counter(f"{PREFIX}_requests", "HTTP generation requests by outcome",
                                ["endpoint", "outcome"], registry=r)
        r.register(_EngineCollector(async_engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def samples(self) -> dict[str, float]:
        """The registry's unlabelled samples, named as /metrics names them (counters with
        `_total`; histograms' `_sum` and `_count`), without the `_created` timestamps."""
        return {s.name: s.value for family in self.registry.collect() for s in family.samples
                if not s.labels and not s.name.endswith("_created")}
