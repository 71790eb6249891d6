"""Micro-benchmarks of hot Python paths (pytest-benchmark). Not part of `make test`:

    .venv/bin/python -m pytest bench/test_micro.py --benchmark-enable
"""

from __future__ import annotations

import json

from fastrun_cpp.structured import json_schema


def wide_schema(properties: int = 60) -> dict:
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0, "maximum": 10000},
        {"type": "number", "minimum": -100, "maximum": 100},
        {"type": "boolean"},
        {"type": "string", "enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5},
        {"type": "string", "format": "date"},
        {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    ]
    return {
        "type": "object",
        "properties": {f"field_{i}": kinds[i % len(kinds)] for i in range(properties)},
        "required": [f"field_{i}" for i in range(0, properties, 2)],
        "additionalProperties": False,
    }


def test_schema_to_grammar_conversion_of_60_properties(benchmark):
    schema_json = json.dumps(wide_schema())
    # Uncached: the cost a new schema pays once.
    grammar = benchmark(json_schema._convert.__wrapped__, schema_json)
    assert "field_59" in grammar


def test_schema_to_grammar_cached(benchmark):
    schema = wide_schema()
    json_schema.schema_to_gbnf(schema)
    benchmark(json_schema.schema_to_gbnf, schema)
