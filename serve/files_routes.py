"""/v1/files: upload (multipart: `file` and `purpose` "batch"), list, retrieve, content, delete,
as OpenAI's Files API, over the store (serve/store.py).

An upload that would take the stored bytes past FilesConfig.max_stored_bytes gets 413 (checked
against Content-Length before the body is read, and again as the bytes are copied in). A file
that a batch still running reads or writes cannot be deleted (409).
"""

from __future__ import annotations

import contextlib
import functools
import os

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from serve.batch_objects import file_object, new_file_id, page
from serve.batch_runs import BatchRuns
from serve.errors import APIError

UPLOAD_PURPOSES = ("batch",)
_CHUNK = 1 << 20
_MULTIPART_SLACK = 64 * 1024  # a multipart body's boundaries and headers, beyond the file


async def upload_file(runs: BatchRuns, request: Request) -> Response:
    """Upload a file (multipart form: file, purpose)."""
    room = runs.config.max_stored_bytes - runs.store.stored_bytes()
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > room + _MULTIPART_SLACK:
        raise _no_room(runs)
    try:
        form = await request.form(max_files=1, max_fields=16)
    except Exception as e:  # noqa: BLE001 - MultiPartException, or a body that is not a form
        raise APIError(400, f"the request body must be a multipart form with 'file' and "
                            f"'purpose': {e}") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"'purpose' must be one of {list(UPLOAD_PURPOSES)}, not "
                                f"{purpose!r}", param="purpose", code="invalid_value")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "Missing required parameter: 'file' (a file part).",
                           param="file", code="missing_required_parameter")
        file_id = new_file_id()
        temp, size = runs.store.temp_path(file_id), 0
        try:
            with open(temp, "wb") as f:  # noqa: ASYNC230 - a local disk, like the store
                while chunk := await upload.read(_CHUNK):
                    size += len(chunk)
                    if size > room:
                        raise _no_room(runs)
                    f.write(chunk)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
    finally:
        await form.close()
    obj = file_object(file_id, filename=os.path.basename(upload.filename or "upload.jsonl"),
                      size=size, purpose=purpose)
    runs.store.add_file(obj, temp)
    return JSONResponse(obj)


async def list_files(runs: BatchRuns, request: Request) -> Response:
    """List files (query: purpose, limit, after, order)."""
    q = request.query_params
    files = runs.store.list_files()
    if q.get("purpose"):
        files = [f for f in files if f["purpose"] == q["purpose"]]
    if q.get("order", "desc") == "asc":
        files.reverse()
    return JSONResponse(page(files, after=q.get("after"), limit=query_limit(request, 10000)))


async def retrieve_file(runs: BatchRuns, request: Request) -> Response:
    """Retrieve a file object."""
    return JSONResponse(_file(runs, request.path_params["file_id"]))


async def file_content(runs: BatchRuns, request: Request) -> Response:
    """A file's bytes."""
    obj = _file(runs, request.path_params["file_id"])
    return FileResponse(runs.store.file_path(obj["id"]), media_type="application/octet-stream",
                        filename=obj["filename"])


async def delete_file(runs: BatchRuns, request: Request) -> Response:
    """Delete a file."""
    obj = _file(runs, request.path_params["file_id"])
    for batch in runs.store.active_batches():
        if obj["id"] == batch["input_file_id"]:
            raise APIError(409, f"file {obj['id']} is the input of batch {batch['id']}, which "
                                f"is {batch['status']}", code="file_in_use")
    runs.store.delete_file(obj["id"])
    return JSONResponse({"id": obj["id"], "object": "file", "deleted": True})


def query_limit(request: Request, maximum: int, default: int | None = None) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default or maximum
    if not raw.isdigit() or not 1 <= int(raw) <= maximum:
        raise APIError(400, f"'limit' must be an integer from 1 to {maximum}", param="limit",
                       code="invalid_value")
    return int(raw)


def _file(runs: BatchRuns, file_id: str) -> dict:
    obj = runs.store.get_file(file_id)
    if obj is None:
        raise APIError(404, f"No such File object: {file_id}", param="id", code="not_found")
    return obj


def _no_room(runs: BatchRuns) -> APIError:
    return APIError(413, f"the stored files would pass the server's limit of "
                         f"{runs.config.max_stored_bytes} bytes; delete some files first",
                    code="storage_limit_exceeded")


def answers_errors(handler):
    """`handler` with its APIError answered as OpenAI's error response."""

    @functools.wraps(handler)
    async def route(runs: BatchRuns, request: Request) -> Response:
        try:
            return await handler(runs, request)
        except APIError as e:
            return e.response()

    return route


FILE_ROUTES = tuple((path, method, answers_errors(handler)) for path, method, handler in (
    ("/v1/files", "POST", upload_file),
    ("/v1/files", "GET", list_files),
    ("/v1/files/{file_id}", "GET", retrieve_file),
    ("/v1/files/{file_id}", "DELETE", delete_file),
    ("/v1/files/{file_id}/content", "GET", file_content),
))
