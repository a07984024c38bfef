"""benchmarks/structured_openai.py's constraints and checker, without a server: every schema is a
valid Draft 2020-12 schema whose strings all have maxLength and arrays all maxItems (so outputs
are bounded), llguidance compiles every schema, regex and choice list (the engine's
GrammarCompiler, over the tiny tokenizer), the workload has its shares and greedy / sampled
halves, and the checker accepts conforming outputs and refuses others."""

from __future__ import annotations

import importlib.util
import os
import sys

import jsonschema
import pytest

from jaxinfer.sampling_params import StructuredOutputs
from jaxinfer.structured.compiler import GrammarCompiler

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "structured_openai.py")
_spec = importlib.util.spec_from_file_location("structured_openai", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up there
_spec.loader.exec_module(bench)


def _subschemas(schema: dict):
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _subschemas(sub)
    for key in ("items",):
        if isinstance(schema.get(key), dict):
            yield from _subschemas(schema[key])
    for sub in schema.get("anyOf", ()):
        yield from _subschemas(sub)


def _types(schema: dict) -> set:
    t = schema.get("type", ())
    return {t} if isinstance(t, str) else set(t)


@pytest.fixture(scope="module")
def compiler():
    from tests.tiny_models import TINY_VOCAB, make_tokenizer

    return GrammarCompiler(make_tokenizer(), TINY_VOCAB, [2])


def test_schemas_are_valid_and_bounded():
    assert len(bench.SCHEMAS) >= 20
    assert len({name for name, _, _ in bench.SCHEMAS}) == len(bench.SCHEMAS)
    for name, _, schema in bench.SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        for sub in _subschemas(schema):
            if "string" in _types(sub) and "enum" not in sub:
                assert "maxLength" in sub, (name, sub)
            if "array" in _types(sub):
                assert "maxItems" in sub, (name, sub)
            if "object" in _types(sub):
                assert sub.get("additionalProperties") is False, (name, sub)


def test_every_constraint_compiles(compiler):
    for _, _, schema in bench.SCHEMAS:
        compiler.compile(StructuredOutputs(json=schema))
    for _, _, regex in bench.REGEXES:
        compiler.compile(StructuredOutputs(regex=regex))
    for _, _, choices in bench.CHOICES:
        compiler.compile(StructuredOutputs(choice=choices))
    compiler.compile(StructuredOutputs(json_object=True))
    assert compiler.num_compiled == len(bench.SCHEMAS) + len(bench.REGEXES) + len(bench.CHOICES) + 1


def test_workload_shares_and_halves():
    specs = bench.make_specs(200, seed=0)
    assert [s.kind for s in specs].count("json_schema") == 140
    for kind in bench.KINDS:
        mine = [s for s in specs if s.kind == kind]
        assert sum(s.sampled for s in mine) == len(mine) // 2
        assert all(0.8 <= s.temperature <= 1.0 and s.seed is not None for s in mine if s.sampled)
    assert {s.name for s in specs if s.kind == "json_schema"} == {n for n, _, _ in bench.SCHEMAS}
    assert bench.make_specs(200, seed=0) == specs  # the seed fixes the workload
    kw = bench.request_kwargs(next(s for s in specs if s.kind == "regex"), "m", 64)
    assert set(kw["extra_body"]["structured_outputs"]) == {"regex"}


def test_checker():
    geo = next(s for n, _, s in bench.SCHEMAS if n == "geo_point")
    spec = bench.Spec("json_schema", "geo_point", "", geo)
    assert bench.check_output(spec, '{"lat": 48.85, "lon": 2.35}') is None
    assert "lat" in bench.check_output(spec, '{"lat": 91, "lon": 2.35}')
    assert "not JSON" in bench.check_output(spec, '{"lat": 48.85, "lon"')
    assert "additional" in bench.check_output(spec, '{"lat": 1, "lon": 2, "x": 3}').lower()
    obj = bench.Spec("json_object", "object", "", None)
    assert bench.check_output(obj, '{"a": [1]}') is None
    assert bench.check_output(obj, "[1]") is not None
    rx = bench.Spec("regex", "phone", "", dict((n, r) for n, _, r in bench.REGEXES)["phone"])
    assert bench.check_output(rx, "555-123-4567") is None
    assert bench.check_output(rx, "555-123-4567 ") is not None
    ch = bench.Spec("choice", "prefixes", "", ["New York", "New"])
    assert bench.check_output(ch, "New") is None
    assert bench.check_output(ch, "New Y") is not None
