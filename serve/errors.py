"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with an HTTP status, and
the status each kind of failure gets (validation 400, unknown model 404, engine overload 503...)."""

from __future__ import annotations

import json
import logging
import re

from pydantic import ValidationError
from starlette.responses import Response

from jaxinfer.engine.async_engine import EngineError, EngineOverloaded, EngineShuttingDown
from serve.schemas import is_union_tag

logger = logging.getLogger(__name__)

_PARAM_RE = re.compile(r"^\s*(?:logit_bias\[\d+\]|([A-Za-z_][A-Za-z0-9_]*))\s*=")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return Response(json.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=headers)


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as OpenAI words it, `param` the field's path ("messages.0.content":
    field names and list indexes, without serve/schemas.py's union tags)."""
    err = e.errors(include_url=False)[0]
    path = [p for p in err.get("loc", ()) if not is_union_tag(p) and p != "[key]"]
    param = ".".join(str(p) for p in path) or None
    kind = err.get("type", "")
    where = f"'{param}'" if param else "the request body"
    if kind == "missing":
        return APIError(400, f"Missing required parameter: {where}.", param=param,
                        code="missing_required_parameter")
    expected = _EXPECTED_TYPES.get(kind)
    if expected is None and kind == "invalid_type":
        expected = err.get("msg", "").removeprefix("expected ")
    if expected is not None:
        return APIError(400, f"Invalid type for {where}: expected {expected}, but got "
                             f"{_json_type(err.get('input'))} instead.", param=param,
                        code="invalid_type")
    message = err.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"Invalid value for {where}: {message}.", param=param,
                    code="invalid_value")


_EXPECTED_TYPES = {  # pydantic's error type -> the JSON type the field takes
    "string_type": "a string", "int_type": "an integer", "float_type": "a number",
    "bool_type": "a boolean", "list_type": "an array", "dict_type": "an object",
    "model_type": "an object", "model_attributes_type": "an object",
}


def _json_type(value) -> str:
    """The JSON type of a request value, as OpenAI's errors name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def from_value_error(e: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A ValueError raised as `ValueError(f"{field=} must ...")`: `param` is that field, renamed to
    the API's name where it differs (e.g. max_tokens -> max_completion_tokens)."""
    message = str(e)
    m = _PARAM_RE.match(message)
    param = None
    if m:
        param = m.group(1) or "logit_bias"
        param = (renames or {}).get(param, param)
    elif message.startswith("logit_bias"):
        param = "logit_bias"
    return APIError(400, message, param=param, code="invalid_value")


def context_length_error(num_prompt_tokens: int, max_model_len: int, *, param: str,
                         source: str = "prompt", max_tokens: int | None = None,
                         min_tokens: int | None = None) -> APIError:
    """A request longer than the context (vLLM's wording): its prompt alone (`source`: "prompt"
    or "messages"), the prompt + `max_tokens`, or the prompt + `min_tokens`."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, you requested"
    if max_tokens is not None:
        message = (f"{head} {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                   f"{source}, {max_tokens} in the completion). Please reduce the length of the "
                   f"{source} or completion.")
    elif min_tokens is not None:
        message = (f"{head} at least {num_prompt_tokens + min_tokens} tokens ({num_prompt_tokens} "
                   f"in the {source}, min_tokens={min_tokens} in the completion). Please reduce "
                   f"the length of the {source} or min_tokens.")
    else:
        message = (f"{head} {num_prompt_tokens} tokens in the {source}, which leaves no room for "
                   f"the completion. Please reduce the length of the {source}.")
    return APIError(400, message, param=param, code="context_length_exceeded")


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model",
                    code="model_not_found")


def engine_api_error(e: BaseException, renames: dict[str, str] | None = None) -> APIError:
    """The APIError of a failed engine request: a full queue or a shutdown 503, a ValueError 400
    (naming the field, see from_value_error), an engine failure 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloaded):
        return APIError(503, str(e), code="server_overloaded")
    if isinstance(e, EngineShuttingDown):
        return APIError(503, str(e), code="server_shutting_down")
    if isinstance(e, ValueError):
        return from_value_error(e, renames)
    if isinstance(e, EngineError):
        return APIError(500, str(e), code="engine_error")
    logger.error("request failed", exc_info=e)
    return APIError(500, f"internal server error: {type(e).__name__}", code="internal_error")
