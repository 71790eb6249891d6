"""Errors in the spec's shape: {"error": {"message", "type", "code"}}, for every failure."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastrun_cpp.entrypoints.anthropic.errors import anthropic_error_body, is_messages_path
from fastrun_cpp.entrypoints.openai.protocol import ErrorBody, ErrorResponse, ErrorType

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: ErrorType = "invalid_request_error",
        *,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.error_type)

    def json(self) -> str:
        return json.dumps(self.body())

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API at `path` shapes it (Anthropic's on /v1/messages, else the spec's)."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return error_response(path, self.status_code, self.message, self.error_type, headers)


def error_response(path: str, status_code: int, message: str, error_type: ErrorType,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    if is_messages_path(path):
        body = anthropic_error_body(status_code, message)
    else:
        body = error_body(status_code, message, error_type)
    return JSONResponse(body, status_code=status_code, headers=headers)


def error_body(status_code: int, message: str, error_type: ErrorType) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorBody(message=message, type=error_type, code=status_code)
    ).model_dump()


_ERROR_TYPES: dict[int, ErrorType] = {401: "authentication_error", 429: "rate_limit_error", 503: "unavailable"}


def error_type_for(status: int) -> ErrorType:
    """The spec's error type of an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "upstream_error" if status >= 500 else "invalid_request_error"


def bad_request(message: str) -> APIError:
    return APIError(400, message)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist")


def upstream_error(message: str) -> APIError:
    return APIError(502, message, "upstream_error", retry_after=1)


_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
# pydantic names the member of a union it tried in the error location; those are not fields.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
# Errors that only say "not this type": with a union, another member's error says more.
_TYPE_MISMATCH = frozenset(
    {"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type",
     "model_type", "model_attributes_type", "literal_error", "union_tag_invalid", "is_instance_of"}
)


def _field_path(location: tuple[Any, ...]) -> str:
    path = ""
    for part in location[1:] if location[:1] == ("body",) else location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD_NAME.match(str(part)) and part not in _UNION_TAGS:
            path += f".{part}" if path else str(part)
    return path


def validation_message(exc: RequestValidationError) -> str:
    """One sentence naming the offending field, e.g. `temperature: ... less than or equal to 2`."""
    errors = exc.errors()
    if not errors:
        return "invalid request"
    field = _field_path(tuple(errors[0].get("loc", ())))
    same_field = [e for e in errors if _field_path(tuple(e.get("loc", ()))).startswith(field)]
    # A value of the wrong type everywhere (each branch of a union refusing it): the error
    # deepest inside names what was meant (a prompt object's `multimodal_data`, not "a string").
    error = next((e for e in same_field if e.get("type") not in _TYPE_MISMATCH),
                 max(same_field, key=lambda e: len(_field_path(tuple(e.get("loc", ())))), default=errors[0]))
    kind = error.get("type", "")
    field = _field_path(tuple(error.get("loc", ())))
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON{': ' + detail if detail else ''}"
    if not field:
        if kind == "missing":
            return "the request body is required and must be a JSON object"
        if kind in _TYPE_MISMATCH:
            return "the request body must be a JSON object"
    if kind == "missing":
        return f"{field} is required"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{field}: {message}"


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(request.url.path, 400, validation_message(exc), "invalid_request_error")


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response(request.url.path)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        message = ("no such route; the API is served under /v1 (chat/completions, completions, responses, "
                   "messages, embeddings, models)")
    else:
        message = str(exc.detail)
    return error_response(request.url.path, status, message, error_type_for(status), exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(request.url.path, 500, "internal server error", "upstream_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
