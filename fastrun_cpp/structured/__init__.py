"""Structured outputs: JSON Schema and JSON-object constraints as GBNF grammars (json_schema.py),
the grammars they build on (grammars.py) and what a request asks for (spec.py)."""
