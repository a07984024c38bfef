"""Request bodies of the JSON routes: read with a size limit (413), parsed as one JSON object
(400; NaN and Infinity are not JSON), validated by the route's strict schema (400 naming the
field's path, serve/schemas.py) and checked against the served model's name (404)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request

from serve.errors import APIError, from_validation_error, model_not_found
from serve.schemas import ModelRequest

Body = TypeVar("Body", bound=ModelRequest)


async def parse_body(request: Request, schema: type[Body], *, max_body_bytes: int,
                     model_name: str) -> Body:
    """The body validated by `schema`; APIError otherwise. A `model` other than `model_name` is
    a 404 (a body without `model` is fine)."""
    body = await read_json(request, max_body_bytes)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    if req.model is not None and req.model != model_name:
        raise model_not_found(req.model)
    return req


async def read_json(request: Request, max_body_bytes: int) -> Any:
    """The body as JSON, refused (413) past `max_body_bytes` whether or not Content-Length says
    so up front."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            too_big = int(length) > max_body_bytes
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
        if too_big:
            raise _too_large(max_body_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(max_body_bytes)
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(body, parse_constant=not_json_number)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and NaN/Infinity are ValueErrors
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body nests its arrays or objects too deeply") from None


def not_json_number(name: str):
    """Python's json reads NaN, Infinity and -Infinity; JSON has no such numbers."""
    raise ValueError(f"{name} is not a JSON number")


def _too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {max_body_bytes} bytes",
                    code="request_too_large")
