"""Batch job files: the input's lines and their keys (serve/batch_input.py), the output file's
recovery, torn last line, lock and fsync (serve/batch_output.py), the row shapes."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from serve import batch_output
from serve.batch_input import BadLine, BatchLine, read_lines
from serve.batch_output import ResultFile
from serve.batch_rows import answer_row, completion_tokens, error_row, is_failure


def write_lines(path, *lines: bytes | str | dict):
    data = b""
    for x in lines:
        if isinstance(x, dict):
            x = json.dumps(x)
        data += (x.encode() if isinstance(x, str) else x) + b"\n"
    path.write_bytes(data)
    return str(path)


def openai_line(custom_id, url="/v1/completions", **body):
    line = {"method": "POST", "url": url, "body": {"prompt": "x", **body}}
    if custom_id is not None:
        line["custom_id"] = custom_id
    return line


def test_keys_of_every_kind_of_line(tmp_path):
    path = write_lines(
        tmp_path / "in.jsonl",
        openai_line("a"),                                   # 1
        {"prompt": "plain, no id"},                         # 2 -> line-2
        "",                                                 # 3 blank: skipped, still counted
        {"id": 7, "messages": [{"role": "user", "content": "hi"}]},  # 4 -> "7"
        "{not json",                                        # 5
        b"\xff\xfe not utf-8",                              # 6
        openai_line("a"),                                   # 7 duplicate of line 1
        openai_line("u", url="/v1/embeddings"),             # 8
        openai_line(None),                                  # 9 no custom_id
        "[1, 2]",                                           # 10
        {"id": "line-12", "prompt": "takes line 12's key"},  # 11
        {"prompt": "its own key is taken"},                 # 12 -> runs as line-12~2
        {"custom_id": "m", "method": "GET", "url": "/v1/completions", "body": {}},  # 13
        {"id": "q", "max_tokens": 3},                       # 14 neither prompt nor messages
    )
    lines = read_lines(path)
    by_number = {line.number: line for line in lines}
    assert 3 not in by_number and len(lines) == 13
    keys = [line.custom_id for line in lines]
    assert len(set(keys)) == len(keys)

    a = by_number[1]
    assert isinstance(a, BatchLine) and a.openai and a.kind == "completion"
    assert a.custom_id == "a" and a.body == {"prompt": "x"}
    plain = by_number[2]
    assert isinstance(plain, BatchLine) and not plain.openai and plain.custom_id == "line-2"
    chat = by_number[4]
    assert chat.custom_id == "7" and chat.kind == "chat" and "id" not in chat.body
    expected_bad = {5: ("line-5", "invalid_json"), 6: ("line-6", "invalid_encoding"),
                    7: ("line-7", "duplicate_custom_id"), 8: ("u", "invalid_url"),
                    9: ("line-9", "missing_custom_id"), 10: ("line-10", "invalid_request"),
                    13: ("m", "invalid_method"),
                    14: ("q", "invalid_request")}
    for number, (key, code) in expected_bad.items():
        line = by_number[number]
        assert isinstance(line, BadLine) and (line.custom_id, line.code) == (key, code), line
    assert "line 1" in by_number[7].message and "'a'" in by_number[7].message
    assert by_number[11].custom_id == "line-12" and isinstance(by_number[11], BatchLine)
    # no id given, its number taken by line 11's own id: it runs, under a key of its own
    assert isinstance(by_number[12], BatchLine) and by_number[12].custom_id == "line-12~2"
    assert by_number[12].body == {"prompt": "its own key is taken"}


def test_lines_json_reads_but_cannot_post_are_bad_lines(tmp_path):
    """NaN / Infinity (Python's json reads them; JSON has none), a lone surrogate (no UTF-8
    body can carry it) and nesting too deep to parse are each that line's error, as any line that
    is not JSON, and the lines around them are read as usual."""
    path = write_lines(
        tmp_path / "in.jsonl",
        openai_line("ok"),
        '{"custom_id": "n", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "x", "temperature": NaN}}',
        '{"custom_id": "i", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "x", "top_p": -Infinity}}',
        '{"custom_id": "s", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "x\\ud800"}}',
        "[" * 100_000,
        '{"custom_id": "e", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "an emoji \\ud83d\\ude00 is a valid pair"}}',
    )
    lines = read_lines(path)
    assert [type(line) for line in lines] == [BatchLine, BadLine, BadLine, BadLine, BadLine,
                                              BatchLine]
    assert [line.custom_id for line in lines] == ["ok", "line-2", "line-3", "line-4", "line-5", "e"]
    assert {line.code for line in lines[1:5]} == {"invalid_json"}
    assert "NaN is not a JSON number" in lines[1].message
    assert "-Infinity is not a JSON number" in lines[2].message
    assert "surrogates not allowed" in lines[3].message
    assert "nests its arrays or objects too deeply" in lines[4].message
    assert lines[5].body["prompt"] == "an emoji \U0001f600 is a valid pair"


def test_keys_are_the_same_on_every_read(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", {"prompt": "a"}, "oops", {"prompt": "b"})
    assert read_lines(path) == read_lines(path)
    assert [line.custom_id for line in read_lines(path)] == ["line-1", "line-2", "line-3"]


def test_row_shapes():
    line = BatchLine(1, "c", "/v1/completions", {"prompt": "x"}, openai=False)
    ok = {"id": "cmpl-1", "choices": [{"text": "yz", "finish_reason": "length"}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    row = answer_row(line, 200, ok)
    assert row == {"custom_id": "c", "text": "yz", "finish_reason": "length",
                   "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    assert not is_failure(row) and completion_tokens(row) == 2
    refused = answer_row(line, 400, {"error": {"message": "bad", "type": "invalid_request_error",
                                               "param": "x", "code": "invalid_value"}})
    assert set(refused) == {"id", "custom_id", "response", "error"}
    assert refused["response"] is None and refused["error"] == {"code": "invalid_value",
                                                                "message": "bad"}
    assert is_failure(refused) and completion_tokens(refused) == 0
    openai = answer_row(BatchLine(1, "o", "/v1/completions", {}, openai=True), 200, ok)
    assert openai["response"] == {"status_code": 200, "request_id": "cmpl-1", "body": ok}
    assert openai["error"] is None and openai["id"].startswith("batch_req_")
    assert not is_failure(openai) and completion_tokens(openai) == 2
    openai_400 = answer_row(BatchLine(1, "o", "/v1/completions", {}, openai=True), 400, {})
    assert is_failure(openai_400)
    err = error_row("e", "invalid_json", "nope")
    assert err["response"] is None and err["error"] == {"code": "invalid_json", "message": "nope"}


# -- the output file ---------------------------------------------------------------------------
ROW_A = {"custom_id": "a", "text": "x", "finish_reason": "length", "usage": {}}
ROW_B = error_row("b", "invalid_json", "nope")


def test_new_output_file(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultFile(str(path)) as out:
        assert out.answers == {} and out.torn_bytes == 0
        out.write(ROW_A)
        assert path.read_text() == json.dumps(ROW_A) + "\n"  # flushed at once
        out.write(ROW_B)
        assert out.answers == {"a": False, "b": True}
    with ResultFile(str(path)) as again:
        assert again.answers == {"a": False, "b": True} and again.torn_bytes == 0


@pytest.mark.parametrize("tail", [b'{"custom_id": "c", "te', b'{"custom_id": "c"}\n', b"garbage\n",
                                  json.dumps(ROW_A | {"custom_id": "c"}).encode(), b"  "])
def test_torn_last_line_is_cut(tmp_path, tail):
    """A last line without its newline (what a kill mid-write leaves: a row goes out with its
    newline in one write) is cut away, a complete-looking row without its newline too (its
    request is redone); a last line with its newline that is not a result row is not torn, and
    the file is refused untouched."""
    path = tmp_path / "out.jsonl"
    good = (json.dumps(ROW_A) + "\n" + json.dumps(ROW_B) + "\n").encode()
    path.write_bytes(good + tail)
    if tail.endswith(b"\n"):
        with pytest.raises(ValueError, match="line 3 is not a batch result line"):
            ResultFile(str(path))
        assert path.read_bytes() == good + tail
        return
    with ResultFile(str(path)) as out:
        assert out.answers == {"a": False, "b": True} and out.torn_bytes == len(tail)
        assert path.read_bytes() == good
        out.write(ROW_A | {"custom_id": "c"})
    assert path.read_bytes() == good + (json.dumps(ROW_A | {"custom_id": "c"}) + "\n").encode()


def test_only_the_last_line_may_be_torn(tmp_path):
    path = tmp_path / "out.jsonl"
    data = (json.dumps(ROW_A) + "\n{torn\n" + json.dumps(ROW_B) + "\n").encode()
    path.write_bytes(data)
    with pytest.raises(ValueError, match="line 2 is not a batch result line"):
        ResultFile(str(path))
    assert path.read_bytes() == data  # untouched
    requests = tmp_path / "requests.jsonl"  # an input file given as the output
    requests.write_text(json.dumps(openai_line("a")) + "\n")
    with pytest.raises(ValueError, match="line 1 is not a batch result line"):
        ResultFile(str(requests))


@pytest.mark.parametrize("content", [b"my notes\n", b"my notes", b"{\n", b"\n\nnotes"])
def test_a_file_of_something_else_is_refused_not_cut(tmp_path, content):
    """A one-line file that is no result file, given as the output, is refused and left as it
    was: only a tail that starts a row (or follows result rows) counts as torn."""
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a batch result line"):
        ResultFile(str(path))
    assert path.read_bytes() == content


def test_a_torn_first_row_is_cut(tmp_path):
    """A job killed while writing its first row: that tail alone in the file is cut."""
    path = tmp_path / "out.jsonl"
    path.write_bytes(json.dumps(ROW_A).encode()[:17])
    with ResultFile(str(path)) as out:
        assert out.answers == {} and out.torn_bytes == 17
    assert path.read_bytes() == b""


def test_output_usage_errors(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        ResultFile(str(tmp_path))
    with pytest.raises(ValueError, match="cannot write"):
        ResultFile(str(tmp_path / "missing-dir" / "out.jsonl"))
    path = tmp_path / "out.jsonl"
    with open(path, "ab") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="in use by another batch job"):
            ResultFile(str(path))
    ResultFile(str(path)).close()  # free again once the other holder is gone


def test_fsync_at_most_every_interval_and_at_close(tmp_path, monkeypatch):
    import stat

    synced, folders = [], []  # fsyncs of the file, of its folder
    monkeypatch.setattr(batch_output.os, "fsync", lambda fd: (
        folders if stat.S_ISDIR(os.fstat(fd).st_mode) else synced).append(fd))
    now = [100.0]
    monkeypatch.setattr(batch_output.time, "monotonic", lambda: now[0])
    out = ResultFile(str(tmp_path / "out.jsonl"), sync_interval_s=1.0)
    out.write(ROW_A)
    out.write(ROW_B)
    assert synced == []
    out.sync_due()
    assert synced == []
    now[0] += 1.0
    out.sync_due()  # a line written, the last fsync 1 s old
    assert len(synced) == 1 and len(folders) == 1  # a new file: its folder entry too, once
    now[0] += 5.0
    out.sync_due()  # nothing new written: no fsync
    assert len(synced) == 1
    out.write(ROW_A | {"custom_id": "c"})  # the last fsync is old: this write syncs at once
    assert len(synced) == 2
    out.write(ROW_A | {"custom_id": "d"})
    out.close()  # the last line is synced on close
    assert len(synced) == 3 and len(folders) == 1
    again = ResultFile(str(tmp_path / "out.jsonl"))  # the file exists: its folder is not synced
    again.write(ROW_A | {"custom_id": "e"})
    again.close()
    assert len(synced) == 4 and len(folders) == 1
