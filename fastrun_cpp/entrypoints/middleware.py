"""ASGI middleware: request ids, the access log and request metrics; API-key checks."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastrun_cpp.auth import ActiveKey
from fastrun_cpp.entrypoints.auth import AuthError, Authenticator
from fastrun_cpp.entrypoints.metrics import ServerMetrics
from fastrun_cpp.entrypoints.openai.errors import APIError, error_type_for
from fastrun_cpp.entrypoints.request_context import SENT_AS_KEY, RequestRecord, current_record, set_current_record
from fastrun_cpp.entrypoints.tenancy import AccountGate, LimitReached, UsageRecorder

access_log = logging.getLogger("fastrun_cpp.access")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                     "/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/rerank",
                     "/v1/reranking", "/v2/rerank", "/v1/models", "/v1/files", "/v1/batches",
                     "/health", "/ready", "/metrics"})
def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestContextMiddleware:
    """Gives each request an id (the client's `X-Request-ID` when it is sane), echoes it,
    writes one JSON access-log line and records request metrics when the response ends, and
    aborts any generation the request leaves running."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics | None, usage: UsageRecorder | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.usage = usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        record = RequestRecord(request_id=given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex)
        set_current_record(record)
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", record.request_id.encode())]
                if record.replica is not None:
                    headers.append((b"x-fastrun-replica", record.replica.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            record.release()
            self._finish(scope, record, status)

    def _finish(self, scope: Scope, record: RequestRecord, status: int) -> None:
        duration = time.perf_counter() - record.started
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        error_type = record.error_type or (error_type_for(status) if status >= 400 else None)
        if self.metrics is not None:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.request_seconds.labels(route).observe(duration)
            if error_type is not None:
                self.metrics.errors.labels(error_type).inc()
            if record.account is not None and record.model is not None:
                self.metrics.count_account(record.account, record.prompt_tokens, record.cached_tokens,
                                           record.completion_tokens)
        if self.usage is not None and record.account is not None and record.model is not None:
            self.usage.count(record.account, record.prompt_tokens, record.cached_tokens, record.completion_tokens,
                             batch=record.bulk)
        line = {
            "request_id": record.request_id,
            "method": scope.get("method"),
            "path": path,
            "status": status,
            "duration_ms": round(duration * 1000, 1),
        }
        if record.model is not None:
            line.update(
                model=record.model,
                prompt_tokens=record.prompt_tokens,
                cached_tokens=record.cached_tokens,
                completion_tokens=record.completion_tokens,
            )
        if record.ttft_s is not None:
            line["ttft_ms"] = round(record.ttft_s * 1000, 1)
        if record.drafted_tokens:
            line["spec_accepted"] = round(record.accepted_tokens / record.drafted_tokens, 3)
        if record.account is not None:
            line["account"] = record.account
        if record.bulk:
            line["batch"] = True
        if record.replica is not None:
            line["replica"] = record.replica
        if error_type is not None:
            line["error_type"] = error_type
        access_log.info("%s", json.dumps(line))


class BodyLimitMiddleware:
    """Caps request bodies (the spec: 64 MiB) without buffering past the cap.

    A declared Content-Length over the cap is refused before anything is read; a body that
    grows past it while streaming in (chunked uploads) stops being read at the cap. Both get
    a 413 in the spec's error shape (Starlette's own limiter answers in plain text).
    """

    def __init__(self, app: ASGIApp, max_body_size: int, timeout_s: float = 60.0) -> None:
        self.app = app
        self.max_body_size = max_body_size
        self.timeout_s = timeout_s

    @property
    def _message(self) -> str:
        return f"the request body is over the {self.max_body_size // 2**20} MiB limit"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_size:
            await APIError(413, self._message).response(scope.get("path", ""))(scope, receive, send)
            return
        received = 0
        complete = False
        deadline: float | None = None

        async def counting_receive() -> Message:
            nonlocal received, complete, deadline
            if complete:  # the body is in: what comes now is the client leaving, whenever
                return await receive()
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                # A client sending its body byte by byte would hold the connection for ever.
                raise HTTPException(408, f"the request body took over {self.timeout_s:g} s to arrive "
                                         "(limit --limit-body-timeout-s)") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_body_size:
                    # Raised inside the app's body read: FastAPI passes HTTP exceptions on to
                    # the error handlers (anything else there would become a 400).
                    raise HTTPException(413, self._message)
            else:
                complete = True
            return message

        await self.app(scope, counting_receive, send)


# Outside /v1, what needs a key once keys exist: the API's docs, and the metrics, which show
# every account's use. An admin key (`fastrun-cpp keys admin`) for those, and for loading,
# unloading and pulling models, which change what every account is served.
KEYED_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
ADMIN_PATHS = frozenset({"/metrics", "/v1/models/load", "/v1/models/unload", "/v1/models/pull",
                         "/v1/server/status"})


class APIKeyMiddleware:
    """Checks the bearer key of every /v1 request (and of the docs and metrics) before its body
    is read, so unauthenticated clients cannot make the server read (or parse) anything."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator, gate: AccountGate | None = None,
                 prefix: str = "/v1") -> None:
        self.app = app
        self.authenticator = authenticator
        self.gate = gate or AccountGate()
        self.prefix = prefix

    def _keyed(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/") or path in KEYED_PATHS or path in ADMIN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self._keyed(path):
            await self.app(scope, receive, send)
            return
        record = current_record()
        if SENT_AS_KEY in scope:  # work the server owns (a batch line), sent by this process as its key
            (key,) = scope[SENT_AS_KEY]
            if record is not None:
                record.bulk = True
            await self._serve(key, path, record, scope, receive, send)
            return
        authorization = _header(scope, b"authorization")
        api_key = _header(scope, b"x-api-key")  # how Anthropic's SDKs send a key
        if authorization is None and api_key is not None:
            authorization = f"Bearer {api_key}"
        try:
            key = self.authenticator.authenticate(authorization, host=_header(scope, b"host"))
        except AuthError as exc:
            api_error = APIError(exc.status_code, exc.message, error_type_for(exc.status_code),
                                 retry_after=5 if exc.status_code == 503 else None)
            response = api_error.response(path)
            if exc.status_code == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        if key is not None and path in ADMIN_PATHS and not key.admin:
            message = f"{path} needs the key of an admin account (`fastrun-cpp keys admin ACCOUNT`)"
            await APIError(403, message, "authentication_error").response(path)(scope, receive, send)
            return
        await self._serve(key, path, record, scope, receive, send)

    async def _serve(self, key: ActiveKey | None, path: str, record: RequestRecord | None, scope: Scope,
                     receive: Receive, send: Send) -> None:
        """Serve the request as `key`'s, within its account's limits."""
        if key is None:
            await self.app(scope, receive, send)
            return
        if record is not None:
            record.account = key.account
            record.key_id = key.key_id
            record.admin = key.admin
            record.cache_namespace = key.cache_namespace
            record.weight = key.weight
            record.min_priority = key.min_priority
        # Listings, docs and cancels are outside the account's limits: a cancel must get through
        # when the account's places are all taken, by the very work it stops.
        if scope.get("method") != "POST" or path.endswith("/cancel"):
            await self.app(scope, receive, send)
            return
        try:
            ticket = self.gate.admit(key)
        except LimitReached as exc:
            await APIError(429, exc.message, "rate_limit_error", retry_after=exc.retry_after_s).response(path)(
                scope, receive, send)
            return
        if ticket is None:
            await self.app(scope, receive, send)
            return
        if record is not None:
            record.ticket = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.finish(record.prompt_tokens + record.completion_tokens if record is not None else 0)
