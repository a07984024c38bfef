"""`jaxinfer serve` on the tiny random Llama, SIGKILLed in the middle of a stream and of a batch,
then started again over the same --data-dir and caches: the new process answers /health 200,
gives the same greedy text as before the kill, still lists the file uploaded before it, and
resumes the unfinished batch (serve/batch_runs.py: every batch not final resumes at start) to
"completed" with each line answered exactly once.

The batch runs 2 lines at a time (--batch-max-in-flight) beside room for the stream; the server is
killed once the batch's first answer is out and the stream's first event came, so the restart has
lines to finish (checked on the batch's result file).
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.serve.conftest import free_port
from tests.serve.server_process import server_process

MODEL = "tiny"
TIMEOUT = 120.0
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
          "ignore_eos": True}
NUM_LINES = 12


def batch_input() -> bytes:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"Once upon a time {i}", "max_tokens": 48,
                       "temperature": 0, "ignore_eos": True}} for i in range(NUM_LINES)]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture
def start(tiny_llama_dir, tmp_path):
    """start() -> a context manager: a server over the same data dir and compilation cache."""
    data, cache = tmp_path / "data", tmp_path / "jax-cache"

    def start():
        port = free_port()
        return server_process(
            ["-m", "jaxinfer.cli", "serve", str(tiny_llama_dir), "--port", str(port),
             "--served-model-name", MODEL, "--num-pages", "96", "--page-size", "8",
             "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "256",
             "--batch-max-in-flight", "2", "--no-warmup", "--no-access-log", "--compilation-cache-dir", str(cache),
             "--data-dir", str(data)], port, timeout=TIMEOUT)

    start.data = data
    return start


def num_lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_mid_stream_then_restart_on_the_same_data_dir(start):
    with start() as srv, httpx.Client(base_url=srv.base_url, timeout=TIMEOUT) as http:
        r = http.post("/v1/completions", json=GREEDY)
        assert r.status_code == 200, r.text
        text_before = r.json()["choices"][0]["text"]
        r = http.post("/v1/files", data={"purpose": "batch"},
                      files={"file": ("in.jsonl", batch_input(), "application/jsonl")})
        assert r.status_code == 200, r.text
        file_id = r.json()["id"]
        r = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                           "completion_window": "24h"})
        assert r.status_code == 200, r.text
        batch_id = r.json()["id"]
        result = start.data / "batches" / f"{batch_id}.jsonl"
        deadline = time.monotonic() + TIMEOUT
        while num_lines(result) < 1:
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.01)

        with http.stream("POST", "/v1/completions",
                         json={**GREEDY, "max_tokens": 200, "stream": True}) as stream:
            assert stream.status_code == 200
            events = stream.iter_lines()
            assert next(line for line in events if line.startswith("data: "))
            srv.proc.send_signal(signal.SIGKILL)
            assert srv.proc.wait(10) == -signal.SIGKILL
            with pytest.raises(httpx.RemoteProtocolError):  # cut, without data: [DONE]
                for line in events:
                    assert line != "data: [DONE]"
        assert 1 <= num_lines(result) < NUM_LINES  # killed in the middle of the batch

    with start() as srv, httpx.Client(base_url=srv.base_url, timeout=TIMEOUT) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json=GREEDY)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text_before

        r = http.get("/v1/files")
        assert r.status_code == 200
        assert file_id in [f["id"] for f in r.json()["data"]]

        deadline = time.monotonic() + TIMEOUT
        while (batch := http.get(f"/v1/batches/{batch_id}").json())["status"] != "completed":
            assert batch["status"] == "in_progress", batch
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
        assert batch["request_counts"] == {"total": NUM_LINES, "completed": NUM_LINES,
                                           "failed": 0}
        r = http.get(f"/v1/files/{batch['output_file_id']}/content")
        assert r.status_code == 200
        rows = [json.loads(x) for x in r.text.splitlines()]
        assert sorted(row["custom_id"] for row in rows) == sorted(f"line-{i}"
                                                                  for i in range(NUM_LINES))
        assert all(row["response"]["body"]["usage"]["completion_tokens"] == 48 for row in rows)
        assert f"resuming batch {batch_id}" in srv.log()
