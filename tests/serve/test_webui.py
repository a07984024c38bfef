"""The web page on / and GET /v1/engine/stats, in process over the fake engine: the page and its
assets with their content types and Content-Security-Policy, served without the API key while
the API still needs it, `webui=False` (`--no-webui`) answering 404, and the stats' numbers being
/metrics' numbers."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from serve.page import CSP
from tests.serve.conftest import MODEL, app_client

CSP_WANTED = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
              "img-src 'self' data:; frame-ancestors 'none'")


def test_page_is_html_with_the_csp_and_no_inline_script():
    assert CSP == CSP_WANTED
    with app_client() as c:
        r = c.get("/")
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        assert r.headers["content-security-policy"] == CSP_WANTED
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["x-frame-options"] == "DENY"
        assert "access-control-allow-origin" not in r.headers
        html = r.text
        assert '<script src="/webui/app.js" defer></script>' in html
        assert html.count("<script") == 1  # no inline script
        assert "style=" not in html  # no inline style (style-src 'self')
        assert "http://" not in html and "https://" not in html  # nothing from elsewhere


def test_assets_have_their_content_types():
    with app_client() as c:
        js = c.get("/webui/app.js")
        assert js.status_code == 200
        assert js.headers["content-type"] == "text/javascript; charset=utf-8"
        assert js.headers["content-security-policy"] == CSP_WANTED
        assert "/v1/chat/completions" in js.text and "/v1/engine/stats" in js.text
        assert "innerHTML" not in js.text and "insertAdjacentHTML" not in js.text
        css = c.get("/webui/style.css")
        assert css.status_code == 200
        assert css.headers["content-type"] == "text/css; charset=utf-8"
        assert c.get("/webui/missing.js").status_code == 404
        assert c.get("/webui/../app.py").status_code == 404


def test_no_webui_is_404():
    with app_client(webui=False) as c:
        for path in ("/", "/webui/app.js", "/webui/style.css"):
            r = c.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found"
        assert c.get("/v1/engine/stats").status_code == 200  # the API stays


def test_page_is_open_but_the_api_needs_the_key():
    with app_client(api_key="sekrit") as c:
        for path in ("/", "/webui/app.js", "/webui/style.css"):
            assert c.get(path, headers={"Authorization": ""}).status_code == 200, path
        assert c.get("/v1/engine/stats", headers={"Authorization": ""}).status_code == 401
        assert c.get("/metrics", headers={"Authorization": ""}).status_code == 401
        assert c.get("/v1/engine/stats").status_code == 200
    with app_client(api_key="sekrit", webui=False) as c:
        assert c.get("/").status_code == 404


def _metrics(c) -> dict[str, float]:
    r = c.get("/metrics")
    assert r.status_code == 200
    return {s.name: s.value for family in text_string_to_metric_families(r.text)
            for s in family.samples if not s.labels and not s.name.endswith("_created")}


def test_engine_stats_shape_and_numbers_equal_metrics():
    with app_client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7})
        assert r.status_code == 200
        stats = c.get("/v1/engine/stats")
        assert stats.status_code == 200
        s = stats.json()
        metrics = _metrics(c)  # the engine is idle: nothing changes between the two reads
        assert s["object"] == "engine.stats" and s["model"] == MODEL and s["ready"] is True
        assert set(s) == {"object", "time", "model", "ready", "requests", "kv_pages",
                          "prefix_cache", "speculative", "tokens", "metrics"}
        assert s["metrics"] == metrics
        assert s["requests"] == {"running": 0, "waiting": 0, "in_flight": 0,
                                 "finished": metrics["jaxinfer_requests_finished_total"]}
        assert s["requests"]["finished"] >= 1
        assert s["kv_pages"] == {"used": 0, "cached": 0, "total": 1023}  # FakeEngine's pool
        assert s["kv_pages"]["total"] == metrics["jaxinfer_kv_pages_total"]
        assert s["prefix_cache"]["hit_rate"] == 0.25 == metrics["jaxinfer_prefix_cache_hit_rate"]
        assert s["speculative"]["draft_tokens"] == metrics["jaxinfer_spec_draft_tokens_total"]
        assert s["tokens"]["generated"] == 7 == metrics["jaxinfer_generation_tokens_total"]
        assert s["tokens"]["prompt"] == metrics["jaxinfer_prompt_tokens_total"] > 0
        assert s["metrics"]["jaxinfer_time_to_first_token_seconds_count"] == 1
