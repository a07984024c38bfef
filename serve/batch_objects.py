"""OpenAI's File and Batch objects as the Files and Batches API returns them (and stores them)."""

from __future__ import annotations

import time
import uuid

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOW = "24h"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def file_object(file_id: str, *, filename: str, size: int, purpose: str) -> dict:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": None, "status_details": None}


def batch_object(batch_id: str, *, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict | None, expiry_s: int = 24 * 3600) -> dict:
    now = int(time.time())
    return {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + expiry_s,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata}


def batch_errors(code: str, message: str) -> dict:
    return {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                        "line": None}]}


def page(objects: list[dict], *, after: str | None, limit: int) -> dict:
    """A list page (newest first): the `limit` objects after the one whose id is `after`."""
    if after is not None:
        ids = [o["id"] for o in objects]
        objects = objects[ids.index(after) + 1:] if after in ids else []
    data = objects[:limit]
    return {"object": "list", "data": data, "has_more": len(objects) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
