"""Pydantic models of OpenAI's Batch and Files APIs (the shapes the OpenAI SDK reads)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from fastrun_cpp.entrypoints.openai.protocol_base import RequestModel, ResponseModel

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# OpenAI takes only "24h"; shorter windows ("30m", "90s") are for jobs that are stale sooner.
COMPLETION_WINDOW = r"^[1-9][0-9]{0,5}[smh]$"
MAX_WINDOW_S = 24 * 3600


class OutputExpiresAfter(RequestModel):
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=3600, le=30 * 86400)]


class BatchCreateRequest(RequestModel):
    input_file_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    endpoint: str
    completion_window: Annotated[str, StringConstraints(pattern=COMPLETION_WINDOW)]
    metadata: Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                             Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)] | None = None
    output_expires_after: OutputExpiresAfter | None = None


def window_seconds(window: str) -> int:
    return int(window[:-1]) * {"s": 1, "m": 60, "h": 3600}[window[-1]]


class RequestCounts(ResponseModel):
    total: int
    completed: int
    failed: int


class BatchError(ResponseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(ResponseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class Batch(ResponseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts | None = None
    usage: dict | None = None
    metadata: dict[str, str] | None = None


class BatchList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class FileObject(ResponseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class FileDeleted(ResponseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool
