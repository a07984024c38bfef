"""`jaxinfer bench`: offline on the tiny random Llama and online against the fake-engine server,
each on a tiny workload: the JSON and the PNG are written, the token counts are the workload's,
and the latencies are ordered as they must be (p50 <= p90 <= p99, TTFT <= end-to-end)."""

from __future__ import annotations

import json

import pytest

from jaxinfer.bench.metrics import RequestRecord, summarize
from jaxinfer.bench.workload import Workload, arrival_offsets, make_requests
from jaxinfer.cli import main
from tests.serve.conftest import free_port
from tests.serve.server_process import server_process

ENGINE_FLAGS = ["--num-pages", "96", "--page-size", "8", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "64", "--max-model-len", "256"]
WORKLOAD = ["--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--range-ratio",
            "0.5", "--seed", "3"]


def expected_tokens() -> tuple[int, int]:
    reqs = make_requests(Workload(num_requests=6, input_len=12, output_len=5, range_ratio=0.5,
                                  seed=3))
    return sum(len(r.prompt_token_ids) for r in reqs), sum(r.output_len for r in reqs)


def check_report(tmp_path, mode: str, rates: list) -> None:
    report = json.loads((tmp_path / "b.json").read_text())
    png = (tmp_path / "b.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert report["mode"] == mode and report["workload"]["num_requests"] == 6
    assert [r["request_rate"] for r in report["runs"]] == rates
    want_in, want_out = expected_tokens()
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert (run["total_input_tokens"], run["total_output_tokens"]) == (want_in, want_out)
        assert run["request_throughput"] == pytest.approx(6 / run["duration"])
        assert run["output_throughput"] == pytest.approx(want_out / run["duration"])
        assert sum(run["output_tokens_over_time"]) == pytest.approx(want_out)
        for name in ("ttft", "tpot", "itl"):
            assert 0 <= run[f"p50_{name}_ms"] <= run[f"p90_{name}_ms"] <= run[f"p99_{name}_ms"]
        assert run["mean_ttft_ms"] <= run["mean_e2el_ms"] <= run["duration"] * 1000


def test_bench_offline_tiny_model(tiny_llama_dir, tmp_path, capsys):
    rc = main(["bench", "--model", str(tiny_llama_dir), *WORKLOAD, "--request-rate", "inf,20",
               "--result-json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"),
               *ENGINE_FLAGS])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Output token throughput (tok/s)" in out and "P99 ITL (ms)" in out
    check_report(tmp_path, "offline", ["inf", 20.0])


def test_bench_online_fake_server(tmp_path, capsys):
    port = free_port()
    with server_process(["-m", "tests.serve.fake_server", "--port", str(port),
                         "--step-delay-s", "0.005"], port, timeout=60.0) as srv:
        rc = main(["bench", "--url", srv.base_url, *WORKLOAD, "--request-rate", "50,inf",
                   "--max-concurrency", "3", "--result-json", str(tmp_path / "b.json"),
                   "--plot", str(tmp_path / "b.png")])
    assert rc == 0
    assert "Serving benchmark" in capsys.readouterr().out
    check_report(tmp_path, "online", [50.0, "inf"])


def test_metrics_by_hand():
    records = [RequestRecord(start=0.0, input_tokens=3, token_times=[0.1, 0.2, 0.4]),
               RequestRecord(start=0.5, input_tokens=2, token_times=[1.0]),
               RequestRecord(start=0.0, input_tokens=9, error="HTTP 500")]
    r = summarize(records, duration=2.0)
    assert (r["completed"], r["failed"]) == (2, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (5, 4)
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.0
    assert r["mean_ttft_ms"] == pytest.approx(300.0)  # (100 + 500) / 2
    assert r["mean_tpot_ms"] == pytest.approx(150.0)  # (400 - 100) / 2
    assert r["mean_itl_ms"] == pytest.approx(150.0)  # 100 and 200
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(200, 10.0)
    assert offsets == sorted(offsets) and 10 < offsets[-1] < 30
