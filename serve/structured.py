"""A request's output constraint: OpenAI's `response_format` ({"type": "text" | "json_object" |
"json_schema"}), vLLM's `structured_outputs` extension ({"json" | "regex" | "choice" | "grammar" |
"json_object"}) and, in chat, a forced tool call (serve/tools.py) -> one `StructuredOutputs`.

Each problem is a 400 naming the request's field. The constraint is compiled here, on a worker
thread (the engine's grammar cache keeps it, so adding the request costs no compile on the engine
thread), so an invalid schema, regex or grammar is refused before the request is queued.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jaxinfer.sampling_params import StructuredOutputs
from serve.errors import APIError

_EXTENSION_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def from_response_format(value: dict[str, Any] | None) -> StructuredOutputs | None:
    """OpenAI's response_format -> a constraint (None for "text" or absent)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise _bad(f"response_format.type={kind!r} must be 'text', 'json_object' or 'json_schema'",
                   "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema must be an object with name and schema",
                   "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("response_format.json_schema.name must be a non-empty string", "response_format")
    schema = spec.get("schema", {})  # OpenAI: no schema allows any JSON object... of any shape
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be a JSON schema object",
                   "response_format")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise _bad("response_format.json_schema.strict must be a boolean", "response_format")
    return StructuredOutputs(json=schema or {"type": "object"})


def from_extension(value: dict[str, Any] | None) -> StructuredOutputs | None:
    """vLLM's structured_outputs object -> a constraint."""
    if value is None:
        return None
    given = {k: v for k, v in value.items() if k in _EXTENSION_KEYS and v not in (None, False)}
    try:
        return StructuredOutputs(**given)
    except (ValueError, TypeError) as e:
        raise _bad(f"{e}", "structured_outputs") from None


def request_constraint(response_format, structured_outputs) -> tuple[StructuredOutputs | None, str]:
    """(the constraint, the field it came from); at most one of the two may constrain."""
    a, b = from_response_format(response_format), from_extension(structured_outputs)
    if a is not None and b is not None:
        raise _bad("response_format and structured_outputs must not both constrain the output",
                   "structured_outputs")
    return (a, "response_format") if a is not None else (b, "structured_outputs")


async def precompile(engine: Any, constraint: StructuredOutputs | None, param: str) -> None:
    """Compiles the constraint into the engine's cache off the event loop; 400 naming `param`
    when the schema, regex or grammar is invalid. Engines without a grammar compiler: a no-op
    (adding the request then reports the problem)."""
    grammars = getattr(engine, "grammars", None)
    if constraint is None or grammars is None:
        return
    try:
        await asyncio.to_thread(grammars.compile, constraint)
    except ValueError as e:
        raise _bad(str(e), param) from None
