"""The Batch API: a batch is validated line by line when it is created, then its lines are run
as a job of the server's one runner (`batches/jobs.py`)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Awaitable, Callable
from typing import Any

from fastrun_cpp.entrypoints.openai.batches.protocol import (
    BATCH_ENDPOINTS,
    MAX_WINDOW_S,
    BatchCreateRequest,
    window_seconds,
)
from fastrun_cpp.entrypoints.openai.batches.jobs import Batches
from fastrun_cpp.entrypoints.openai.batches.store import OwedBatch, ParsedLine, error_line
from fastrun_cpp.entrypoints.openai.files.store import lines_of, new_id
from fastrun_cpp.entrypoints.tenancy import AccountAtCap
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.files.serving import OpenAIServingFiles, _page, account
from fastrun_cpp.entrypoints.request_context import current_record

MAX_CUSTOM_ID = 512
MAX_EMBEDDING_INPUTS = 50_000  # over all lines of an embeddings batch, as OpenAI's (its output stays bounded)


def parse_lines(content: bytes, endpoint: str) -> list[ParsedLine]:
    """Each line of a batch file as a request to run, or as the error that keeps it from running
    (reported in the batch's error file: one bad line never fails the batch)."""
    parsed: list[ParsedLine] = []
    seen: set[str] = set()
    embedding_inputs = 0

    def refuse(number: int, custom_id: str | None, code: str, message: str) -> None:
        parsed.append(ParsedLine(number, custom_id, None, error_line(
            custom_id, None, {"code": code, "message": message, "line": number})))

    for number, raw in lines_of(content):
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):
            refuse(number, None, "invalid_json_line", f"line {number} is not JSON")
            continue
        if not isinstance(line, dict):
            refuse(number, None, "invalid_request", f"line {number} is not a JSON object")
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
            refuse(number, None, "invalid_custom_id",
                   f"line {number}: custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
            continue
        if custom_id in seen:
            refuse(number, custom_id, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is repeated")
            continue
        seen.add(custom_id)
        if line.get("method", "POST") != "POST":
            refuse(number, custom_id, "invalid_method", f"line {number}: method must be POST")
        elif line.get("url") != endpoint:
            refuse(number, custom_id, "mismatched_endpoint",
                   f"line {number}: url {str(line.get('url'))[:100]!r} is not the batch's endpoint {endpoint}")
        elif not isinstance(line.get("body"), dict):
            refuse(number, custom_id, "invalid_body", f"line {number}: body must be a JSON object")
        else:
            body = dict(line["body"])
            body.pop("stream", None)  # a batch line is answered whole
            # and within the batch: a background response would "complete" the line as `queued`
            # and run outside the batch's window and usage (the batch is the background already).
            body.pop("background", None)
            if endpoint == "/v1/embeddings":
                inputs = body.get("input")
                embedding_inputs += len(inputs) if isinstance(inputs, list) and inputs and \
                    not isinstance(inputs[0], int) else 1
                if embedding_inputs > MAX_EMBEDDING_INPUTS:
                    refuse(number, custom_id, "too_many_inputs", f"line {number}: the batch's lines hold more than "
                           f"{MAX_EMBEDDING_INPUTS} embedding inputs together")
                    continue
            parsed.append(ParsedLine(number, custom_id, body))
    return parsed


class OpenAIServingBatches:
    def __init__(self, files: OpenAIServingFiles, batches: Batches, *, per_account: int,
                 parse: Callable[..., Awaitable[Any]]) -> None:
        self.parse = parse  # the serving layer's body reader (checked, decoded off the loop)
        self.files = files
        self.store = batches.store
        self.batches = batches
        self.per_account = per_account

    async def create(self, request: BatchCreateRequest) -> dict[str, Any]:
        if request.endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"endpoint: {request.endpoint[:100]!r} is not served in batches; one of "
                              f"{', '.join(BATCH_ENDPOINTS)}")
        window = window_seconds(request.completion_window)
        if window > MAX_WINDOW_S:
            raise bad_request(f"completion_window: at most 24h, not {request.completion_window}")
        stored = await self.files.stored(request.input_file_id)
        if stored.purpose != "batch":
            raise bad_request(f"input_file_id: {stored.id} was uploaded with purpose {stored.purpose!r}, not 'batch'")
        owner = account()
        # Checked before the file is read and parsed, and again where the batch is added (requests
        # sent together all pass this first check).
        await self._within_cap(self.store.check_room, owner, self.per_account)
        if await self.files.in_store(self.store.files.full, owner):
            raise APIError(429, "this account's files fill its budget (batch outputs count); delete some first: "
                                "DELETE /v1/files/{file_id}", "rate_limit_error")
        content = await self.files.whole(stored.id)
        lines = await asyncio.to_thread(parse_lines, content, request.endpoint)
        now = int(time.time())
        failed = sum(1 for line in lines if line.error is not None)
        batch = {
            "id": new_id("batch"), "object": "batch", "endpoint": request.endpoint, "model": _model_of(lines),
            "errors": None, "input_file_id": stored.id, "completion_window": request.completion_window,
            "status": "in_progress", "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": now, "expires_at": now + window, "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": len(lines), "completed": 0, "failed": failed},
            "usage": None, "metadata": request.metadata,
        }
        record = current_record()
        key_id = record.key_id if record is not None else None
        await self._within_cap(self.store.create_batch, owner, key_id, batch, lines, per_account=self.per_account)
        self.batches.add(OwedBatch(owner or "", key_id, dict(batch)))
        return batch

    async def _within_cap(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`function` in the store's thread; an account at its cap of running batches is a 429."""
        try:
            return await self.files.in_store(function, *args, **kwargs)
        except AccountAtCap as exc:
            raise APIError(429, str(exc), "rate_limit_error", retry_after=60) from None

    async def batch(self, batch_id: str) -> dict[str, Any]:
        batch = await self.files.in_store(self.store.batch, account(), batch_id)
        if batch is None:
            raise APIError(404, f"no batch with id {batch_id!r}")
        return batch

    async def list(self, *, after: str | None, limit: int) -> dict[str, Any]:
        batches, has_more = await self.files.in_store(self.store.batches, account(), after=after, limit=limit)
        return _page(batches, has_more)

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        now = int(time.time())
        batch = await self.files.in_store(self.store.set_status_if, account(), batch_id, ("in_progress",),
                                          {"status": "cancelling", "cancelling_at": now})
        if batch is None:
            raise APIError(404, f"no batch with id {batch_id!r}")
        if batch["status"] == "cancelling":
            self.batches.cancel(batch)
        elif batch["status"] not in ("cancelled",):
            raise APIError(409, f"the batch is {batch['status']} and cannot be cancelled")
        return batch


def _model_of(lines: list[ParsedLine]) -> str | None:
    """The model the lines name, when they all name one."""
    models = {line.request.get("model") for line in lines if line.request is not None}
    return models.pop() if len(models) == 1 and all(isinstance(m, str) for m in models) else None
