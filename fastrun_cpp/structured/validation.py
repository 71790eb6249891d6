"""Checking a generated value against the whole of a schema whose grammar left some keywords
out (lenient tools and response formats)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from jsonschema.validators import extend

# Patterns are enforced by the grammar already; Python's `re` on model output could backtrack
# for ever on a pattern like (a+)+ - so they are not run again here.
_Validator = extend(jsonschema.Draft202012Validator, {"pattern": None, "patternProperties": None})


def check_instance(text: str, schema: dict[str, Any]) -> str | None:
    """Why the JSON `text` does not follow `schema`, or None when it does."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return f"not JSON: {exc}"
    try:
        error = jsonschema.exceptions.best_match(_Validator(schema).iter_errors(value))
    except (jsonschema.exceptions.SchemaError, RecursionError, TypeError) as exc:
        return f"cannot check: {exc}"
    return None if error is None else f"{error.message} (at {'/'.join(map(str, error.absolute_path)) or 'the top'})"
