"""/v1/files and /v1/batches in process (TestClient over the fake engine): the object shapes, a
batch run to completion, the output and error files, cancel, the limits (413, 429), the API key,
and a restarted app that finishes a batch from its result file without redoing answered lines."""

from __future__ import annotations

import json
import time

from serve.files_config import FilesConfig
from tests.serve.conftest import app_client
from tests.serve.fake_engine import FakeEngine

TIMEOUT = 30.0


def batch_lines(n: int, *, max_tokens: int = 4, url: str = "/v1/chat/completions") -> bytes:
    lines = []
    for i in range(n):
        body = ({"messages": [{"role": "user", "content": f"hi {i}"}]}
                if url == "/v1/chat/completions" else {"prompt": f"hi {i}"})
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": url,
                      "body": {"model": "whatever", "max_tokens": max_tokens, "temperature": 0,
                               **body}})
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def upload(client, data: bytes, purpose: str = "batch"):
    return client.post("/v1/files", files={"file": ("in.jsonl", data)},
                       data={"purpose": purpose})


def wait_final(client, batch_id: str, timeout: float = TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        obj = client.get(f"/v1/batches/{batch_id}").json()
        if obj["status"] in ("completed", "failed", "cancelled", "expired"):
            return obj
        assert time.monotonic() < deadline, obj
        time.sleep(0.02)


def rows(client, file_id: str) -> list[dict]:
    r = client.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200
    return [json.loads(line) for line in r.text.splitlines()]


def test_file_upload_list_retrieve_content_delete(tmp_path):
    with app_client(files=FilesConfig(data_dir=str(tmp_path))) as client:
        data = batch_lines(2)
        r = upload(client, data)
        assert r.status_code == 200, r.text
        f = r.json()
        assert f["object"] == "file" and f["id"].startswith("file-")
        assert (f["bytes"], f["filename"], f["purpose"]) == (len(data), "in.jsonl", "batch")
        assert client.get(f"/v1/files/{f['id']}").json() == f
        assert client.get(f"/v1/files/{f['id']}/content").content == data
        listed = client.get("/v1/files").json()
        assert listed["object"] == "list" and [x["id"] for x in listed["data"]] == [f["id"]]
        assert client.delete(f"/v1/files/{f['id']}").json() == {
            "id": f["id"], "object": "file", "deleted": True}
        r = client.get(f"/v1/files/{f['id']}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert upload(client, data, purpose="fine-tune").status_code == 400
        assert client.post("/v1/files", data={"purpose": "batch"}).status_code == 400


def test_batch_runs_to_completion_with_error_file(tmp_path):
    with app_client(files=FilesConfig(data_dir=str(tmp_path))) as client:
        data = batch_lines(3) + b"not json\n" + batch_lines(1, url="/v1/completions").replace(
            b'"r0"', b'"other"')
        f = upload(client, data).json()
        r = client.post("/v1/batches", json={"input_file_id": f["id"],
                                             "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h",
                                             "metadata": {"k": "v"}})
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["object"] == "batch" and b["status"] in ("validating", "in_progress")
        b = wait_final(client, b["id"])
        assert b["status"] == "completed", b
        assert b["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
        assert b["completed_at"] >= b["created_at"] and b["metadata"] == {"k": "v"}
        done = rows(client, b["output_file_id"])
        assert sorted(r["custom_id"] for r in done) == ["r0", "r1", "r2"]
        for row in done:
            assert row["response"]["status_code"] == 200 and row["error"] is None
            assert row["response"]["body"]["object"] == "chat.completion"
        errors = {r["custom_id"]: r["error"]["code"] for r in rows(client, b["error_file_id"])}
        assert errors == {"line-4": "invalid_json", "other": "invalid_url"}
        for row in rows(client, b["error_file_id"]):  # OpenAI's shape, as every row
            assert set(row) == {"id", "custom_id", "response", "error"}
        out = client.get(f"/v1/files/{b['output_file_id']}").json()
        assert out["purpose"] == "batch_output"
        assert client.get("/v1/batches").json()["data"][0]["id"] == b["id"]
        assert client.post(f"/v1/batches/{b['id']}/cancel").status_code == 400


def test_batch_validation_and_limits(tmp_path):
    cfg = FilesConfig(data_dir=str(tmp_path), max_stored_bytes=4000, max_active_batches=1)
    engine = FakeEngine(step_delay_s=0.05)
    with app_client(engine, files=cfg) as client:
        f = upload(client, batch_lines(3, max_tokens=200)).json()
        bad = {"input_file_id": f["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
        assert client.post("/v1/batches", json=bad).status_code == 400
        assert client.post("/v1/batches", json={**bad, "input_file_id": "file-nope",
                                                "endpoint": "/v1/completions"}).status_code == 400
        ok = {**bad, "endpoint": "/v1/chat/completions"}
        first = client.post("/v1/batches", json=ok).json()
        r = client.post("/v1/batches", json=ok)
        assert r.status_code == 429 and r.json()["error"]["code"] == "batch_limit_reached"
        assert client.delete(f"/v1/files/{f['id']}").status_code == 409
        r = upload(client, b"x" * 5000)
        assert r.status_code == 413 and r.json()["error"]["code"] == "storage_limit_exceeded"
        r = client.post(f"/v1/batches/{first['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelling"
        b = wait_final(client, first["id"])
        assert b["status"] == "cancelled" and b["cancelled_at"] is not None
        assert b["request_counts"]["total"] == 3


def test_a_batch_past_its_expiry_ends_expired_with_its_unanswered_lines_failed(tmp_path):
    # r0, r1 take 3 steps of 20 ms and have the whole 3 s; r2..r5 would take 20 s
    cfg = FilesConfig(data_dir=str(tmp_path), expiry_s=3, max_in_flight=2)
    engine = FakeEngine(step_delay_s=0.02, max_model_len=2048)
    with app_client(engine, files=cfg) as client:
        short, long = batch_lines(6, max_tokens=3), batch_lines(6, max_tokens=1000)
        lines = short.splitlines(keepends=True)[:2] + long.splitlines(keepends=True)[2:]
        f = upload(client, b"".join(lines)).json()  # r0, r1 finish at once; r2..r5 cannot
        b = client.post("/v1/batches", json={"input_file_id": f["id"],
                                             "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"}).json()
        assert b["expires_at"] == b["created_at"] + 3
        b = wait_final(client, b["id"])
        assert b["status"] == "expired" and b["expired_at"] >= b["expires_at"]
        assert b["completed_at"] is None
        done = {r["custom_id"] for r in rows(client, b["output_file_id"])}
        failed = {r["custom_id"]: r["error"]["code"] for r in rows(client, b["error_file_id"])}
        assert done == {"r0", "r1"}  # 2 in flight at once: r2, r3 were running, r4, r5 waiting
        assert failed == {f"r{i}": "batch_expired" for i in range(2, 6)}
        assert b["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
        deadline = time.monotonic() + TIMEOUT  # r2's and r3's requests were aborted
        while len(engine.aborted_ids) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.aborted_ids) == 2


def test_api_key_covers_files_and_batches(tmp_path):
    with app_client(files=FilesConfig(data_dir=str(tmp_path)), api_key="k") as client:
        f = upload(client, batch_lines(2)).json()
        b = client.post("/v1/batches", json={"input_file_id": f["id"],
                                             "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"}).json()
        assert wait_final(client, b["id"])["request_counts"]["completed"] == 2  # key passed on
        del client.headers["Authorization"]
        assert client.get("/v1/files").status_code == 401
        assert client.get(f"/v1/batches/{b['id']}").status_code == 401


def test_restart_resumes_from_the_result_file(tmp_path):
    """A batch left in_progress with 2 answers in its result file (as a kill leaves it): the next
    app skips them and answers the 3 others."""
    cfg = FilesConfig(data_dir=str(tmp_path))
    with app_client(files=cfg) as client:
        f = upload(client, batch_lines(5)).json()
    from serve.store import Store

    store = Store(str(tmp_path))
    obj = {"id": "batch_x", "object": "batch", "endpoint": "/v1/chat/completions",
           "errors": None, "input_file_id": f["id"], "completion_window": "24h",
           "status": "in_progress", "output_file_id": None, "error_file_id": None,
           "created_at": 1, "in_progress_at": 1, "expires_at": int(time.time()) + 3600,
           "finalizing_at": None,
           "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
           "cancelled_at": None, "request_counts": {"total": 5, "completed": 0, "failed": 0},
           "metadata": None}
    store.put_batch(obj)
    earlier = [{"id": f"batch_req_{i}", "custom_id": f"r{i}", "error": None,
                "response": {"status_code": 200, "request_id": "old", "body": {"old": True}}}
               for i in (1, 3)]
    with open(tmp_path / "batches" / "batch_x.jsonl", "w") as out:
        out.write("".join(json.dumps(r) + "\n" for r in earlier) + '{"custom_id": "r4", "resp')
    store.close()
    with app_client(files=cfg) as client:
        b = wait_final(client, "batch_x")
        assert b["status"] == "completed" and b["request_counts"]["completed"] == 5
        done = {r["custom_id"]: r for r in rows(client, b["output_file_id"])}
        assert sorted(done) == ["r0", "r1", "r2", "r3", "r4"]
        assert done["r1"]["response"]["body"] == {"old": True}
        assert done["r4"]["response"]["body"]["object"] == "chat.completion"
    assert not (tmp_path / "batches" / "batch_x.jsonl").exists()


def test_batch_lines_run_in_the_background_with_the_batch_priority_under_priority(tmp_path):
    import types

    from jaxinfer.engine.async_engine import AsyncEngine
    from serve.batch_runs import make_batch_runs

    cfg = FilesConfig(data_dir=str(tmp_path), batch_priority=7)
    for policy, want in (("priority", {"service_tier": "flex", "priority": 7}),
                         ("fcfs", {"service_tier": "flex"})):
        engine = FakeEngine()
        engine.engine_config = types.SimpleNamespace(scheduling_policy=policy)
        runs = make_batch_runs(cfg, AsyncEngine(engine), model_name="m", api_key=None)
        assert runs._overrides == want
        runs.store.close()


def test_a_plain_line_is_an_error_line_in_a_batch(tmp_path):
    """The Batches API takes OpenAI batch lines only: a plain request (which `jaxinfer batch`
    also reads) gets an error row of OpenAI's shape; the other lines run."""
    with app_client(files=FilesConfig(data_dir=str(tmp_path))) as client:
        plain = {"custom_id": "p", "messages": [{"role": "user", "content": "hi"}]}
        data = batch_lines(1) + (json.dumps(plain) + "\n").encode()
        f = upload(client, data).json()
        b = client.post("/v1/batches", json={"input_file_id": f["id"],
                                             "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"}).json()
        b = wait_final(client, b["id"])
        assert b["status"] == "completed" and b["request_counts"] == {
            "total": 2, "completed": 1, "failed": 1}
        [row] = rows(client, b["error_file_id"])
        assert set(row) == {"id", "custom_id", "response", "error"} and row["custom_id"] == "p"
        assert row["error"]["code"] == "invalid_request"
        assert "not an OpenAI batch line" in row["error"]["message"]
        assert [r["custom_id"] for r in rows(client, b["output_file_id"])] == ["r0"]


def test_request_counts_follow_the_answers_while_the_rest_still_run(tmp_path):
    """Answers that came in a burst show in request_counts within about a second, though no
    other answer follows them for much longer (the counts are written on a timer too)."""
    engine = FakeEngine(step_delay_s=0.01, max_model_len=2048)
    data = b"".join(
        (json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                     "body": {"prompt": f"p{i}", "temperature": 0, "ignore_eos": True,
                              "max_tokens": 3 if i < 4 else 1500}}) + "\n").encode()
        for i in range(6))
    with app_client(engine, files=FilesConfig(data_dir=str(tmp_path))) as client:
        f = upload(client, data).json()
        b = client.post("/v1/batches", json={"input_file_id": f["id"],
                                             "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()
        deadline = time.monotonic() + 5.0  # r4, r5 take ~15 s: far longer
        while True:
            obj = client.get(f"/v1/batches/{b['id']}").json()
            if obj["request_counts"]["completed"] == 4:
                break
            assert time.monotonic() < deadline, obj
            time.sleep(0.05)
        assert obj["status"] == "in_progress"
        client.post(f"/v1/batches/{b['id']}/cancel")
        assert wait_final(client, b["id"])["status"] == "cancelled"


def test_paging_batches_while_they_progress_skips_none(tmp_path):
    """A batch updated while a client pages through the list keeps its place (batches created in
    the same second are listed by creation, not by their last update)."""
    from serve.batch_objects import batch_object, page
    from serve.store import Store

    store = Store(str(tmp_path))
    first = batch_object("batch_A", input_file_id="f", endpoint="/v1/completions",
                         completion_window="24h", metadata=None)
    second = dict(first, id="batch_B")
    store.put_batch(first)
    store.put_batch(second)
    page1 = page(store.list_batches(), after=None, limit=1)
    assert [x["id"] for x in page1["data"]] == ["batch_B"] and page1["has_more"]
    first["request_counts"]["completed"] = 1
    store.put_batch(first)  # batch_A's counts move on between the two pages
    page2 = page(store.list_batches(), after=page1["last_id"], limit=1)
    assert [x["id"] for x in page2["data"]] == ["batch_A"]
    assert page2["data"][0]["request_counts"]["completed"] == 1
    store.close()
