"""The lines a batch job writes: one JSON object per input line, keyed by "custom_id".

- an OpenAI batch line answered by the server gets OpenAI's batch output line
    {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}
  (a 4xx or 5xx answer is a response with that status and the server's error body);
- a plain line answered 200 gets {"custom_id", "text", "finish_reason", "usage"} (its first
  choice; usage: prompt_tokens, completion_tokens);
- anything else gets OpenAI's batch error line
    {"id", "custom_id", "response": null, "error": {"code", "message"}}:
  a line that cannot be posted (serve/batch_input.py), a plain line the server refused, a request
  whose handling failed without an answer.
A line is a failure when its "error" is set or its response's status is not 200.
"""

from __future__ import annotations

import uuid

from serve.batch_input import BatchLine


def error_row(custom_id: str, code: str, message: str) -> dict:
    return {"id": _row_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def answer_row(line: BatchLine, status_code: int, body: dict) -> dict:
    """The row of a request the server answered with `status_code` and the JSON `body`."""
    if line.openai:
        return {"id": _row_id(), "custom_id": line.custom_id,
                "response": {"status_code": status_code, "request_id": body.get("id"),
                             "body": body},
                "error": None}
    if status_code != 200:
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
        code = error.get("code") or error.get("type") or f"http_{status_code}"
        return error_row(line.custom_id, code,
                         error.get("message") or f"the server answered {status_code}")
    choice = body["choices"][0]
    return {"custom_id": line.custom_id,
            "text": choice["message"]["content"] if line.kind == "chat" else choice["text"],
            "finish_reason": choice["finish_reason"],
            "usage": {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}}


def is_result_row(row) -> bool:
    """Whether a parsed output line is one of the shapes above (not, say, an input line)."""
    return (isinstance(row, dict) and isinstance(row.get("custom_id"), str)
            and any(k in row for k in ("response", "error", "text")))


def is_failure(row: dict) -> bool:
    if row.get("error") is not None:
        return True
    response = row.get("response")
    return isinstance(response, dict) and response.get("status_code") != 200


def completion_tokens(row: dict) -> int:
    """Output tokens of a row (0 for failures)."""
    if is_failure(row):
        return 0
    usage = row.get("usage") or (row.get("response") or {}).get("body", {}).get("usage") or {}
    return int(usage.get("completion_tokens") or 0)


def _row_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"
