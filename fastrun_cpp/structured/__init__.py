"""Structured outputs: JSON Schema and JSON-object constraints as GBNF grammars."""

from fastrun_cpp.structured.grammars import base_grammar
from fastrun_cpp.structured.json_schema import SchemaError, closed_object_keys, schema_to_gbnf, tool_calls_gbnf

__all__ = ["SchemaError", "base_grammar", "closed_object_keys", "schema_to_gbnf", "tool_calls_gbnf"]
