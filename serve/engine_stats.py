"""GET /v1/engine/stats: the engine's live numbers as JSON, for the web page's dashboard.

Built from one read of the server's Prometheus registry (ServerMetrics.samples()), the same
numbers GET /metrics renders, so the dashboard and a Prometheus scrape never disagree about where
a value comes from. `metrics` holds every unlabelled sample by its Prometheus name; the other
keys group the ones the dashboard draws. Rates over time (output tokens/s) are left to the
client: it polls and differences the `tokens.generated` counter against `time`.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve.metrics import PREFIX
from serve.state import ServerState


async def engine_stats(server: ServerState, request: Request) -> Response:
    """The engine's live numbers (the same as /metrics), as JSON."""
    samples = server.metrics.samples()

    def get(name: str) -> float | None:
        return samples.get(f"{PREFIX}_{name}")  # None until the engine's first snapshot

    return JSONResponse({
        "object": "engine.stats",
        "time": time.time(),
        "model": server.model_name,
        "ready": bool(get("ready")),
        "requests": {"running": get("num_requests_running"),
                     "waiting": get("num_requests_waiting"),
                     "in_flight": get("server_requests_in_flight"),
                     "finished": get("requests_finished_total")},
        "kv_pages": {"used": get("kv_pages_used"), "cached": get("kv_pages_cached"),
                     "total": get("kv_pages_total")},
        "prefix_cache": {"hit_rate": get("prefix_cache_hit_rate"),
                         "query_tokens": get("prefix_cache_query_tokens_total"),
                         "hit_tokens": get("prefix_cache_hit_tokens_total")},
        "speculative": {"acceptance_rate": get("spec_acceptance_rate"),
                        "draft_tokens": get("spec_draft_tokens_total"),
                        "accepted_tokens": get("spec_accepted_tokens_total")},
        "tokens": {"prompt": get("prompt_tokens_total"),
                   "generated": get("generation_tokens_total")},
        "metrics": samples,
    }, headers={"Cache-Control": "no-store"})
