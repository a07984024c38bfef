"""/v1/files and /v1/batches on real server processes, driven by the official `openai` client:
files.create -> batches.create -> batches.retrieve until final -> files.content on the tiny random
Llama (`jaxinfer serve`), cancel; and a server SIGKILLed in the middle of a batch and started
again over the same --data-dir (the fake engine, which starts in a second), which finishes the
batch with every line answered exactly once.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time

import openai
import pytest

from tests.serve.conftest import free_port
from tests.serve.server_process import server_process

TIMEOUT = 600.0
MODEL = "tiny"


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def chat_lines(n: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Hello {i}"}],
                      "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
            for i in range(n)]


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.1)


def content_rows(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    port = free_port()
    cache = tmp_path_factory.mktemp("jax-cache")
    data = tmp_path_factory.mktemp("data")
    args = ["-m", "jaxinfer.cli", "serve", str(tiny_llama_dir), "--port", str(port),
            "--served-model-name", MODEL, "--num-pages", "96", "--page-size", "8",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "256",
            "--no-warmup", "--compilation-cache-dir", str(cache), "--data-dir", str(data),
            "--api-key", "sk-test"]
    with server_process(args, port, timeout=TIMEOUT) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="sk-test",
                       timeout=TIMEOUT, max_retries=0) as c:
        yield c


def test_openai_client_batch_round_trip_on_tiny_model(client):
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat_lines(4, 6)))),
                            purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"run": "test"})
    assert b.status in ("validating", "in_progress") and b.input_file_id == f.id
    b = wait_final(client, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (4, 4, 0)
    assert b.error_file_id is None and b.completed_at >= b.created_at
    rows = {r["custom_id"]: r for r in content_rows(client, b.output_file_id)}
    assert sorted(rows) == ["q0", "q1", "q2", "q3"]
    for row in rows.values():
        body = row["response"]["body"]
        assert row["response"]["status_code"] == 200 and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 6
    # the same greedy request asked interactively gives the same answer
    direct = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                            messages=[{"role": "user", "content": "Hello 2"}],
                                            extra_body={"ignore_eos": True})
    assert rows["q2"]["response"]["body"]["choices"][0]["message"]["content"] == \
        direct.choices[0].message.content
    assert b.id in [x.id for x in client.batches.list()]
    assert f.id in [x.id for x in client.files.list()]
    assert client.files.delete(b.output_file_id).deleted


def test_openai_client_cancel_on_tiny_model(client):
    f = client.files.create(file=("long.jsonl", io.BytesIO(jsonl(chat_lines(40, 200)))),
                            purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    b = client.batches.cancel(b.id)
    assert b.status == "cancelling"
    b = wait_final(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at is not None
    assert b.request_counts.completed < 40
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(b.id)
    assert client.models.list().data[0].id == MODEL  # the server still answers


def test_sigkilled_server_resumes_the_batch_without_losing_or_doubling_lines(tmp_path):
    data = tmp_path / "data"
    lines = [{"custom_id": f"k{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"line {i}", "max_tokens": 30, "temperature": 0}}
             for i in range(60)]

    def start(port):
        return server_process(["-m", "tests.serve.fake_server", "--port", str(port),
                               "--step-delay-s", "0.02", "--max-num-seqs", "4",
                               "--data-dir", str(data)], port, timeout=60.0)

    port = free_port()
    with start(port) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
        result = data / "batches" / f"{b.id}.jsonl"
        deadline = time.monotonic() + 60
        while not (result.exists() and result.read_bytes().count(b"\n") >= 10):
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.01)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
    before = [json.loads(x) for x in result.read_bytes().split(b"\n")[:-1]]
    assert 10 <= len(before) < 60
    assert client.batches.retrieve  # the client object outlives the server
    port = free_port()
    with start(port) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
        b = wait_final(client, b.id, timeout=120)
        assert b.status == "completed", b
        assert (b.request_counts.total, b.request_counts.completed) == (60, 60)
        rows = content_rows(client, b.output_file_id)
        ids = [r["custom_id"] for r in rows]
        assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # each once
        kept = {r["custom_id"]: r for r in rows}
        for row in before:  # the answers written before the kill are kept as they were
            assert kept[row["custom_id"]] == row
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 30 for r in rows)
        assert "resuming batch" in srv.log()
    assert not os.path.exists(result)
