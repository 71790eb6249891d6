"""Cost of structured outputs: streamed chat at concurrency 8 constrained by a JSON schema
versus unconstrained, on one fastrun-cpp server, alternating the two workloads.

    python bench/structured.py [--rounds 3] [--concurrency 8]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ab_workloads  # noqa: E402

STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "characters": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["hero", "villain", "sidekick"]}},
            "required": ["name", "age", "role"], "additionalProperties": False}, "minItems": 1, "maxItems": 4},
        "story": {"type": "string"},
    },
    "required": ["title", "characters", "story"],
    "additionalProperties": False,
}
WORKLOADS = {
    "unconstrained": None,
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "story", "schema": STORY_SCHEMA}}},
}


if __name__ == "__main__":
    sys.exit(ab_workloads(__doc__, WORKLOADS))
