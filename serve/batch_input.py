"""The input of a batch job: a JSONL file read into one request or one bad line per line.

A line is an OpenAI batch line
  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
(any line with "body", "url" or "method"), or a plain request
  {"id"?: ..., "prompt" | "messages": ..., "max_tokens"?: ..., ...}.

Every line gets a key that no other line has, worked out from the file alone, so a rerun over the
same file finds the same keys in the output and skips what is answered:
- an OpenAI line: its "custom_id" (required);
- a plain line: its "id" (or "custom_id"), else "line-N", N its 1-based line number in the file;
- a line that cannot be read (not UTF-8, not JSON, not an object, no custom_id): "line-N";
- a second line with a key already taken (a duplicate custom_id): "line-N" too (with a suffix
  "~2", "~3"... if another line has that key), so it gets an error line of its own and the first
  line keeps its key; a plain line without an id whose "line-N" an earlier line took as its id
  is run under "line-N~2" (or the next free suffix).
Blank lines are skipped (they still count for N).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from serve.body import not_json_number

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """A request to post: `body` goes to `url` as it is (plus the job's model)."""

    number: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict
    openai: bool  # an OpenAI batch line (else a plain request)

    @property
    def kind(self) -> str:
        return URLS[self.url]


@dataclasses.dataclass(frozen=True)
class BadLine:
    """A line that is answered with an error line without being posted."""

    number: int
    custom_id: str
    code: str
    message: str


class _Refused(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def read_lines(path: str) -> list[BatchLine | BadLine]:
    """Every non-blank line of the JSONL file at `path`, in file order, with unique keys."""
    with open(path, "rb") as f:
        raw_lines = f.read().split(b"\n")
    lines: list[BatchLine | BadLine] = []
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        line = parse_line(raw, number)
        if line.custom_id in first_line_of:
            key = _free_key(f"line-{number}", first_line_of)
            if isinstance(line, BatchLine) and line.custom_id == f"line-{number}":
                # a plain line keyed by its number (no id given) whose key an earlier line took
                # as its own id: a key of its own, as for a line that cannot be read
                line = dataclasses.replace(line, custom_id=key)
            elif isinstance(line, BatchLine):
                line = BadLine(number, key, "duplicate_custom_id",
                               f"custom_id {line.custom_id!r} is already used on line "
                               f"{first_line_of[line.custom_id]}")
            else:  # already an error line: it keeps its own error, under a key of its own
                line = dataclasses.replace(line, custom_id=key)
        first_line_of[line.custom_id] = number
        lines.append(line)
    return lines


def parse_line(raw: bytes, number: int) -> BatchLine | BadLine:
    """One line's bytes -> the request it asks for, or why it cannot be posted."""
    fallback = f"line-{number}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadLine(number, fallback, "invalid_encoding", f"line {number} is not UTF-8: {e}")
    try:
        obj = json.loads(text, parse_constant=not_json_number)
        if "\\u" in text:  # an escaped lone surrogate ("\\ud800") reads as a str that no
            json.dumps(obj, ensure_ascii=False).encode("utf-8")  # UTF-8 request body can carry
    except ValueError as e:  # JSONDecodeError, NaN / Infinity, UnicodeEncodeError
        return BadLine(number, fallback, "invalid_json", f"line {number} is not JSON: {e}")
    except RecursionError:
        return BadLine(number, fallback, "invalid_json",
                       f"line {number} nests its arrays or objects too deeply to be read")
    if not isinstance(obj, dict):
        return BadLine(number, fallback, "invalid_request",
                       f"line {number} is a JSON {type(obj).__name__}, not an object")
    custom_id = _custom_id(obj, number)
    try:
        if custom_id is None:
            raise _Refused("missing_custom_id", f"line {number} is an OpenAI batch line without a "
                                                "'custom_id' (a non-empty string)")
        return _openai_line(obj, number, custom_id) if _is_openai(obj) else _plain_line(
            obj, number, custom_id)
    except _Refused as e:
        return BadLine(number, custom_id or fallback, e.code, str(e))


def _is_openai(obj: dict) -> bool:
    return any(k in obj for k in ("body", "url", "method"))


def _custom_id(obj: dict, number: int) -> str | None:
    if _is_openai(obj):
        custom_id = obj.get("custom_id")
        return custom_id if isinstance(custom_id, str) and custom_id else None
    given = obj.get("id", obj.get("custom_id"))
    return f"line-{number}" if given is None or given == "" else str(given)


def _openai_line(obj: dict, number: int, custom_id: str) -> BatchLine:
    method = obj.get("method", "POST")
    if method != "POST":
        raise _Refused("invalid_method", f"method {method!r} must be 'POST'")
    url = obj.get("url")
    if url not in URLS:
        raise _Refused("invalid_url", f"url {url!r} must be one of {sorted(URLS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Refused("invalid_request", "'body' must be a JSON object")
    return BatchLine(number, custom_id, url, body, openai=True)


def _plain_line(obj: dict, number: int, custom_id: str) -> BatchLine:
    body = {k: v for k, v in obj.items() if k not in ("id", "custom_id")}
    if "messages" in body:
        return BatchLine(number, custom_id, "/v1/chat/completions", body, openai=False)
    if "prompt" in body:
        return BatchLine(number, custom_id, "/v1/completions", body, openai=False)
    raise _Refused("invalid_request", "a plain line needs 'prompt' or 'messages'")


def _free_key(key: str, taken: dict[str, Any]) -> str:
    """`key`, or `key` with the smallest suffix "~k" (k >= 2) that no line has taken."""
    candidate, k = key, 2
    while candidate in taken:
        candidate, k = f"{key}~{k}", k + 1
    return candidate
