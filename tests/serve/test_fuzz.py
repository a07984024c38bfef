"""Property-based fuzzing of the API from its own /openapi.json (schemathesis + hypothesis):
requests that fit the schema and requests that break it, to every route of a uvicorn server (in
a thread) over the fake engine; seeded (derandomized) and bounded (MAX_EXAMPLES per route and
mode). No request may get a 5xx; afterwards the server is healthy and the engine has every page
back. benchmarks/fuzz.py runs longer fuzzing against a real server."""

from __future__ import annotations

import collections

import httpx
import hypothesis
import schemathesis
from schemathesis import GenerationMode

from tests.serve.conftest import MODEL
from tests.serve.fake_engine import FakeEngine
from tests.serve.uvicorn_thread import serving

MAX_EXAMPLES = 25  # per route and mode (fewer where hypothesis runs out of distinct cases)


def fuzz(base_url: str, max_examples: int) -> tuple[collections.Counter, list[str]]:
    """(requests per status, one line per 5xx) of fuzzing every route of the server's schema.
    A valid body names the served model, so that it reaches the engine rather than a 404."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    statuses: collections.Counter = collections.Counter()
    server_errors: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            @hypothesis.given(operation.as_strategy(generation_mode=mode))
            @hypothesis.settings(max_examples=max_examples, derandomize=True, deadline=None,
                                 database=None, suppress_health_check=list(hypothesis.HealthCheck),
                                 phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
            def send(case):
                if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and \
                        "model" in case.body:
                    case.body["model"] = MODEL
                response = case.call(base_url=base_url, timeout=30)
                statuses[response.status_code] += 1
                if response.status_code >= 500:
                    server_errors.append(f"{operation.label} ({mode}): {response.status_code} "
                                         f"{response.text[:300]} <- {case.body!r:.300}")

            try:
                send()
            except hypothesis.errors.Unsatisfiable:
                pass  # nothing to break (a GET without parameters has no invalid requests)
    return statuses, server_errors


def test_fuzzing_every_route_gets_no_server_error_and_leaves_the_server_healthy():
    engine = FakeEngine(max_model_len=256, max_num_seqs=8)
    with serving(engine, max_waiting=64) as (base, ae):
        statuses, server_errors = fuzz(base, MAX_EXAMPLES)
        assert not server_errors, "\n".join(server_errors)
        assert sum(statuses.values()) >= 100, statuses
        assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0
        assert httpx.get(f"{base}/health").status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200
        assert ae.num_in_flight == 0 and ae.num_waiting == 0
    assert engine._used_pages == 0 and not engine._running and not engine._waiting
