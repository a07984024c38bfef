"""Batch jobs in process: every bad line (and a line whose handling raises in the app) gets one
error line and the job goes on; answers are written as they finish; a rerun skips what is answered
and redoes a torn last line; exit statuses. On the fake engine, and once on the tiny model."""

from __future__ import annotations

import asyncio
import json

import pytest

from jaxinfer.cli import main
from serve.batch import BatchOptions, post_lines, run_batch, run_batch_with
from serve.batch_input import read_lines
from serve.batch_output import ResultFile
from tests.serve.fake_engine import FakeEngine, FakeTokenizer

QUIET = BatchOptions(progress=False)
GREEDY = {"temperature": 0, "ignore_eos": True}


class RaisingTokenizer(FakeTokenizer):
    """Raises (an unexpected error, not a refusal) on any text with "boom" in it."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "boom" in text:
            raise RuntimeError("the tokenizer blew up")
        return super().encode(text, add_special_tokens)


class RaisingEngine(FakeEngine):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokenizer = RaisingTokenizer()


def write_jsonl(path, lines) -> str:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n"
                              for x in lines))
    return str(path)


def read_rows(path) -> dict[str, dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in rows}
    assert len(by_id) == len(rows), "one line per custom_id"
    return by_id


def openai(custom_id, url="/v1/completions", **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_bad_lines_fail_alone(tmp_path, capsys):
    lines = [
        openai("ok", prompt="hello", max_tokens=3, **GREEDY),
        {"id": "plain", "prompt": "hi", "max_tokens": 2, **GREEDY},
        b'{"custom_id": "torn", "method": "PO',                          # invalid JSON: line-3
        b'{"prompt": "\xff\xfe"}',                                        # not UTF-8: line-4
        openai("ok", prompt="again", max_tokens=1),                        # duplicate: line-5
        openai("emb", url="/v1/embeddings", input="x"),                    # unknown url
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},  # no custom_id
        openai("boom-openai", prompt="boom", max_tokens=2),               # the app raises
        {"id": "boom-plain", "prompt": "boom", "max_tokens": 2},           # the app raises
        {"id": "refused", "prompt": "x", "max_tokens": 2, "temperature": -1},  # a 400
        {"id": "last", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **GREEDY},
    ]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_batch_with(RaisingEngine(), inp, str(out), QUIET) == 1
    rows = read_rows(out)
    assert set(rows) == {"ok", "plain", "line-3", "line-4", "line-5", "emb", "line-7",
                         "boom-openai", "boom-plain", "refused", "last"}

    def error_code(custom_id):
        row = rows[custom_id]
        assert set(row) == {"id", "custom_id", "response", "error"} and row["response"] is None
        assert set(row["error"]) == {"code", "message"} and row["error"]["message"]
        return row["error"]["code"]

    assert rows["ok"]["error"] is None and rows["ok"]["response"]["status_code"] == 200
    assert rows["ok"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert rows["plain"]["finish_reason"] == "length" and rows["last"]["usage"]["completion_tokens"] == 2
    assert error_code("line-3") == "invalid_json"
    assert error_code("line-4") == "invalid_encoding"
    assert error_code("line-5") == "duplicate_custom_id"
    assert error_code("emb") == "invalid_url"
    assert error_code("line-7") == "missing_custom_id"
    assert error_code("boom-plain") == "internal_error"
    assert error_code("refused") == "invalid_value"
    boom = rows["boom-openai"]  # the app's own 500 answer, as OpenAI's batch output gives it
    assert boom["error"] is None and boom["response"]["status_code"] == 500
    assert boom["response"]["body"]["error"]["code"] == "internal_error"
    err = capsys.readouterr().err
    assert "11 done now, 0 already done, 8 failed, of 11 lines" in err

    # a rerun has nothing left to do: no engine is built, the output is untouched, still 1
    before = out.read_bytes()

    def no_engine():
        raise AssertionError("the engine was built with nothing left to do")

    assert run_batch(inp, str(out), no_engine, QUIET) == 1
    assert out.read_bytes() == before
    assert "0 done now, 11 already done, 8 failed" in capsys.readouterr().err


def test_bad_lines_alone_need_no_engine(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [b"{oops", openai("u", url="/v1/files")])
    out = tmp_path / "out.jsonl"

    def no_engine():
        raise AssertionError("no line to post: the engine is not needed")

    assert run_batch(inp, str(out), no_engine, QUIET) == 1
    assert {k: r["error"]["code"] for k, r in read_rows(out).items()} == {
        "line-1": "invalid_json", "u": "invalid_url"}
    assert "2 done now, 0 already done, 2 failed, of 2 lines" in capsys.readouterr().err


def test_an_app_that_raises_without_answering(tmp_path):
    """The transport turns an exception escaping the app into that line's error line."""

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if b"boom" in body:
            raise RuntimeError("no answer at all")
        answer = {"id": "c1", "choices": [{"text": "fine", "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "boom"},
                                              {"id": "b", "prompt": "fine"}])
    with ResultFile(str(tmp_path / "out.jsonl")) as out:
        asyncio.run(post_lines(app, read_lines(inp), out))
        assert out.answers == {"a": True, "b": False}
    rows = read_rows(tmp_path / "out.jsonl")
    assert rows["a"]["error"]["code"] == "internal_error" and rows["a"]["response"] is None
    assert rows["b"]["text"] == "fine"


def test_each_answer_is_written_when_it_finishes(tmp_path):
    """A line is in the file (complete, flushed) while a line before it still runs."""
    release = asyncio.Event()
    answer = {"id": "c1", "choices": [{"text": "t", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    async def app(scope, receive, send):
        message = await receive()
        if b"slow" in message["body"]:
            await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "slow", "prompt": "slow"},
                                              {"id": "fast", "prompt": "fast"}])
    path = tmp_path / "out.jsonl"

    async def run():
        with ResultFile(str(path)) as out:
            job = asyncio.create_task(post_lines(app, read_lines(inp), out))
            for _ in range(500):
                if path.read_text():
                    break
                await asyncio.sleep(0.01)
            assert list(read_rows(path)) == ["fast"]
            assert not job.done()
            release.set()
            await job

    asyncio.run(run())
    assert [json.loads(x)["custom_id"] for x in path.read_text().splitlines()] == ["fast", "slow"]


def test_rerun_skips_answered_lines_and_redoes_a_torn_one(tmp_path, capsys):
    lines = [{"id": f"r{i}", "prompt": f"prompt number {i}", "max_tokens": 2 + i, **GREEDY}
             for i in range(8)]
    lines.append(openai("o", url="/v1/chat/completions", max_tokens=4,
                        messages=[{"role": "user", "content": "hi"}], **GREEDY))
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    full = tmp_path / "full.jsonl"
    assert run_batch_with(FakeEngine(), inp, str(full), QUIET) == 0
    reference = read_rows(full)

    # as if killed after three lines, in the middle of writing the fourth
    out = tmp_path / "out.jsonl"
    written = full.read_bytes().splitlines(keepends=True)
    kept = b"".join(written[:3])
    out.write_bytes(kept + written[3][:17])
    assert run_batch_with(FakeEngine(), inp, str(out), QUIET) == 0
    data = out.read_bytes()
    assert data.startswith(kept)
    rows = read_rows(out)
    assert set(rows) == set(reference)
    for key, row in rows.items():
        assert strip_ids(row) == strip_ids(reference[key]), key
    err = capsys.readouterr().err
    assert "6 done now, 3 already done, 0 failed, of 9 lines" in err
    assert f"cut a torn last line ({len(written[3][:17])} bytes)" in err


def strip_ids(row: dict) -> dict:
    """A row without what differs between two runs (ids, creation times)."""
    row = dict(row)
    row.pop("id", None)
    if row.get("response"):
        body = dict(row["response"]["body"])
        for k in ("id", "created", "system_fingerprint"):
            body.pop(k, None)
        row["response"] = {**row["response"], "body": body, "request_id": None}
    return row


def test_usage_errors_exit_2(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    assert main(["batch", str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["batch", str(tmp_path), str(tmp_path / "out.jsonl")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["batch", inp, str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["batch", inp, inp]) == 2
    assert "must not be the input" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text("some notes\nnot results\n")
    assert main(["batch", inp, str(other)]) == 2
    assert "line 1 is not a batch result line" in capsys.readouterr().err
    assert other.read_text() == "some notes\nnot results\n"
    assert not (tmp_path / "out.jsonl").exists()


def test_batch_flags():
    from jaxinfer.cli import build_parser

    args = build_parser().parse_args(["batch", "in.jsonl", "out.jsonl", "--max-in-flight", "8",
                                      "--no-progress", "--page-size", "16"])
    assert (args.input, args.output, args.max_in_flight, args.no_progress) == (
        "in.jsonl", "out.jsonl", 8, True)
    assert args.page_size == 16 and not args.no_compilation_cache
    assert args.func.__name__ == "cmd_batch"
    with pytest.raises(ValueError, match="max_in_flight"):
        BatchOptions(max_in_flight=0)


def test_a_line_of_more_choices_than_lines_in_flight_runs(tmp_path):
    """--max-in-flight bounds the lines posted at once, not which lines may run: a line asking
    for more choices (n x prompts) than that gets them."""
    inp = write_jsonl(tmp_path / "in.jsonl", [
        openai("many", prompt=["a", "b"], n=3, max_tokens=2, **GREEDY),
        openai("one", prompt="c", max_tokens=2, **GREEDY)])
    out = tmp_path / "out.jsonl"
    options = BatchOptions(progress=False, max_in_flight=2)
    assert run_batch_with(FakeEngine(), inp, str(out), options) == 0
    rows = read_rows(out)
    assert rows["many"]["response"]["status_code"] == 200
    assert len(rows["many"]["response"]["body"]["choices"]) == 6
    assert rows["one"]["response"]["status_code"] == 200


def test_batch_job_mixed_lines_on_the_tiny_model(tiny_llm, tmp_path):
    """OpenAI batch lines get OpenAI batch output lines (the server's own response bodies: n,
    logprobs, echo, 4xx answers); plain lines get {custom_id, text, finish_reason, usage}; bad
    lines fail alone; every page is free afterwards."""
    from jaxinfer import SamplingParams

    lines = [
        openai("a", url="/v1/chat/completions", model="gpt-4o-mini",
               messages=[{"role": "user", "content": "Hello"}], max_tokens=4, n=2,
               logprobs=True, top_logprobs=1, **GREEDY),
        {"id": "b", "prompt": "The quick brown fox", "max_tokens": 3, **GREEDY},
        {"id": "c", "prompt": "bad", "temperature": -2},
        "not an object",
        openai("e", prompt="The quick brown fox", max_tokens=3, echo=True, logprobs=0, stream=True,
               **GREEDY),
        openai("f", prompt="x", max_tokens=0),
        openai("g", url="/v1/embeddings", input="x"),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert run_batch_with(tiny_llm.engine, inp, str(out), QUIET) == 1  # some lines failed
    rows = read_rows(out)
    assert set(rows) == {"a", "b", "c", "line-4", "e", "f", "g"}
    expected = tiny_llm.generate(["The quick brown fox"], SamplingParams(max_tokens=3, **GREEDY),
                                 use_tqdm=False)[0]
    text = expected.outputs[0].text

    a = rows["a"]
    assert a["error"] is None and a["response"]["status_code"] == 200
    body = a["response"]["body"]
    assert body["object"] == "chat.completion" and a["response"]["request_id"] == body["id"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"]["content"] == body["choices"][1]["message"]["content"]
    assert len(body["choices"][0]["logprobs"]["content"]) == 4
    assert body["usage"]["completion_tokens"] == 8

    assert rows["b"] == {"custom_id": "b", "text": text, "finish_reason": "length",
                         "usage": {"prompt_tokens": len(expected.prompt_token_ids),
                                   "completion_tokens": 3}}
    assert rows["c"]["response"] is None and "temperature" in rows["c"]["error"]["message"]
    assert rows["line-4"]["error"]["code"] == "invalid_request"

    e = rows["e"]["response"]["body"]["choices"][0]
    assert e["text"] == "The quick brown fox" + text
    n = len(expected.prompt_token_ids)
    assert len(e["logprobs"]["token_logprobs"]) == n + 3 and e["logprobs"]["token_logprobs"][0] is None
    assert rows["f"]["response"]["status_code"] == 400
    assert rows["f"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert rows["g"]["response"] is None and "url" in rows["g"]["error"]["message"]
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.engine.scheduler.pool.num_free_pages == tiny_llm.engine.num_pages - 1
