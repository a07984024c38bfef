"""/v1/batches: create, list, retrieve, cancel, as OpenAI's Batch API; the batches run on the
server (serve/batch_runs.py). More than FilesConfig.max_active_batches batches not yet final get
429."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve.batch_objects import (
    COMPLETION_WINDOW,
    ENDPOINTS,
    batch_object,
    new_batch_id,
    page,
)
from serve.batch_runs import BatchRuns, batch_not_found
from serve.body import read_json
from serve.errors import APIError
from serve.files_routes import FILE_ROUTES, answers_errors, query_limit

_MAX_BODY = 1 << 20
_MAX_METADATA = 16


async def create_batch(runs: BatchRuns, request: Request) -> Response:
    """Create a batch from an uploaded JSONL file."""
    body = await read_json(request, _MAX_BODY)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise APIError(400, f"Missing required parameter: '{name}' (a string).", param=name,
                           code="missing_required_parameter")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}",
                       param=unknown[0], code="unknown_parameter")
    if body["endpoint"] not in ENDPOINTS:
        raise APIError(400, f"'endpoint' must be one of {list(ENDPOINTS)}", param="endpoint",
                       code="invalid_value")
    if body["completion_window"] != COMPLETION_WINDOW:
        raise APIError(400, f"'completion_window' must be {COMPLETION_WINDOW!r}",
                       param="completion_window", code="invalid_value")
    metadata = body.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= _MAX_METADATA
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise APIError(400, f"'metadata' must map at most {_MAX_METADATA} strings to strings",
                       param="metadata", code="invalid_value")
    source = runs.store.get_file(body["input_file_id"])
    if source is None or source["purpose"] != "batch":
        raise APIError(400, f"input_file_id {body['input_file_id']!r} is not a file of purpose "
                            "'batch'", param="input_file_id", code="invalid_value")
    if runs.num_active() >= runs.config.max_active_batches:
        raise APIError(429, f"the server runs at most {runs.config.max_active_batches} batches "
                            "at once; wait for one to finish or cancel one",
                       code="batch_limit_reached", type="rate_limit_error")
    obj = batch_object(new_batch_id(), input_file_id=source["id"], endpoint=body["endpoint"],
                       completion_window=COMPLETION_WINDOW, metadata=metadata,
                       expiry_s=runs.config.expiry_s)
    runs.submit(obj)
    return JSONResponse(obj)


async def list_batches(runs: BatchRuns, request: Request) -> Response:
    """List batches, newest first (query: limit, after)."""
    return JSONResponse(page(runs.store.list_batches(), after=request.query_params.get("after"),
                             limit=query_limit(request, 100, default=20)))


async def retrieve_batch(runs: BatchRuns, request: Request) -> Response:
    """Retrieve a batch."""
    obj = runs.store.get_batch(request.path_params["batch_id"])
    if obj is None:
        raise batch_not_found(request.path_params["batch_id"])
    return JSONResponse(obj)


async def cancel_batch(runs: BatchRuns, request: Request) -> Response:
    """Cancel a batch: its requests stop, what is answered is kept."""
    return JSONResponse(runs.cancel(request.path_params["batch_id"]))


BATCH_ROUTES = tuple((path, method, answers_errors(handler)) for path, method, handler in (
    ("/v1/batches", "POST", create_batch),
    ("/v1/batches", "GET", list_batches),
    ("/v1/batches/{batch_id}", "GET", retrieve_batch),
    ("/v1/batches/{batch_id}/cancel", "POST", cancel_batch),
))

FILES_API_ROUTES = FILE_ROUTES + BATCH_ROUTES
