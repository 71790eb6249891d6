"""Anthropic's error shape, which every error on /v1/messages takes (the server's error
responses pick it by path: entrypoints/openai/errors.py)."""

from __future__ import annotations

from typing import Any

MESSAGES_PREFIX = "/v1/messages"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")


def anthropic_error_body(status_code: int, message: str) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}."""
    kind = _TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
