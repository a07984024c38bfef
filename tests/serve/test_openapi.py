"""GET /openapi.json: valid JSON, OpenAPI 3.1, every route, and request schemas that are the
pydantic models' own (generated, so the published schema is the enforced one)."""

from __future__ import annotations

import json

import pytest

from serve.app import ENDPOINTS
from serve.schemas import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.serve.conftest import app_client

REF = "#/components/schemas/{model}"


@pytest.fixture(scope="module")
def doc():
    with app_client() as c:
        r = c.get("/openapi.json")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        yield json.loads(r.text)


def _resolve(doc, schema):
    ref = schema["$ref"]
    assert ref.startswith("#/components/schemas/"), ref
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_document_lists_every_route(doc):
    assert doc["openapi"].startswith("3.1")
    assert doc["info"]["title"] == "jaxinfer" and doc["info"]["version"]
    want = {(path.replace(":path", ""), method.lower()) for path, method, _, _ in ENDPOINTS}
    have = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert want == have
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    for ops in doc["paths"].values():
        for op in ops.values():
            assert op["summary"]
            error = op["responses"]["default"]["content"]["application/json"]["schema"]
            assert set(_resolve(doc, error)["properties"]) == {"error"}


@pytest.mark.parametrize("path,model", [
    ("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
    ("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest)])
def test_request_bodies_are_the_models_schemas(doc, path, model):
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    schema = _resolve(doc, body["content"]["application/json"]["schema"])
    generated = model.model_json_schema(ref_template=REF)
    generated.pop("$defs", None)
    assert schema == generated
    for name, field in model.model_fields.items():  # every field documented
        assert name in schema["properties"]
        if field.is_required():
            assert name in schema["required"]


def test_every_reference_resolves(doc):
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.add(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    schemas = doc["components"]["schemas"]
    assert refs and all(ref.rsplit("/", 1)[1] in schemas for ref in refs)
    assert not any(name.startswith("_") for name in schemas)  # no internal-only members


def test_schema_states_the_strict_types(doc):
    props = _resolve(doc, {"$ref": REF.format(model="ChatCompletionRequest")})["properties"]
    assert {"type": "boolean"} in props["stream"]["anyOf"]
    assert {"type": "integer", "minimum": 1} in props["max_tokens"]["anyOf"]
    n = next(s for s in props["n"]["anyOf"] if s.get("type") == "integer")
    assert n["maximum"] == MAX_N
    roles = set()
    for member in props["messages"]["items"]["oneOf"]:
        message = _resolve(doc, member)
        roles.add(message["properties"]["role"]["const"])
        assert "content" in message["properties"]
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    user = _resolve(doc, {"$ref": REF.format(model="UserMessage")})
    tool = _resolve(doc, {"$ref": REF.format(model="ToolMessage")})
    assistant = _resolve(doc, {"$ref": REF.format(model="AssistantMessage")})
    assert set(user["required"]) == {"role", "content"}
    assert set(tool["required"]) == {"role", "content", "tool_call_id"}
    assert set(assistant["required"]) == {"role"}
