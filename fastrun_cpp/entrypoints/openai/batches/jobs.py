"""Batches as jobs of the server's one runner (`entrypoints/jobs.py`): a run per line, each one
sent through this server's own routes, in process, as the account's key that created the batch,
at bulk priority.

Going through the routes gives a line everything a request gets (validation, the body checks,
the account's rate limits, usage, the access log) and nothing else to keep in step. Bulk priority
puts lines behind every interactive request on the fair share: they take idle slots, and an
interactive request preempts them (the exact resume keeps their answers the same).

A line that finds the server or its account full (429) or its model not ready (503) is sent
again later, out of its place, until the batch's completion window closes. A line that timed out
(504) is not sent again: it ran, and was billed, to its timeout; its 504 is its result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Hashable

from starlette.types import ASGIApp, Receive, Scope, Send

from fastrun_cpp.auth import ActiveKey
from fastrun_cpp.entrypoints.jobs import Job, JobKind, JobRunner
from fastrun_cpp.entrypoints.leases import LeaseLost
from fastrun_cpp.entrypoints.openai.batches.store import (
    BatchStore,
    LineOutcome,
    OwedBatch,
    PendingLine,
    error_line,
    new_id,
)
from fastrun_cpp.entrypoints.openai.utils import StoreThread
from fastrun_cpp.entrypoints.request_context import SENT_AS_KEY
from fastrun_cpp.entrypoints.tenancy import RETRIED_STATUSES

logger = logging.getLogger(__name__)

FINALIZE_TRIES = 3
EXPIRED = {"code": "batch_expired", "message": "this line was not run within the batch's completion window"}


def _with_key(app: ASGIApp, key: ActiveKey | None) -> ASGIApp:
    async def call(scope: Scope, receive: Receive, send: Send) -> None:
        await app({**scope, SENT_AS_KEY: (key,)}, receive, send)

    return call


class Batches(JobKind):
    """The batches this server runs, as jobs of its runner."""

    def __init__(self, runner: JobRunner, app: ASGIApp, store: BatchStore, store_thread: StoreThread, *,
                 key_for: Callable[[int | None], ActiveKey | None]) -> None:
        self.job_type = RunningBatch
        self.runner = runner
        self.app = app
        self.store = store
        self.in_store = store_thread.run
        self.key_for = key_for  # a batch's key by id (raises AuthError once it is revoked)
        runner.add_kind(self)

    def add(self, owed: OwedBatch) -> None:
        self.runner.add(RunningBatch(self, owed))

    def cancel(self, batch: dict[str, Any]) -> None:
        """The batch is now `cancelling`: its lines in flight stop, and it ends `cancelled`."""
        running = self.runner.get(batch["id"])
        if isinstance(running, RunningBatch):
            running.batch.update(status=batch["status"], cancelling_at=batch.get("cancelling_at"))
        self.runner.wake()

    def progress(self) -> list[dict[str, Any]]:
        """Every batch with work left, every account's: what the operator view lists."""
        return [{"id": r.id, "account": r.account, "status": r.batch["status"],
                 "endpoint": r.batch.get("endpoint"), "created_at": r.batch.get("created_at"),
                 "request_counts": dict(r.batch["request_counts"]), "lines_in_flight": len(r.in_flight)}
                for r in self.runner.jobs(RunningBatch)]

    async def owed(self, held: frozenset[str]) -> list[Job]:
        return [RunningBatch(self, owed) for owed in await self.in_store(self.store.owed_batches, held)]

    async def renew(self, jobs: list[Job]) -> None:
        """Drop the batches another server took; learn of cancels sent to another server."""
        held = await self.in_store(self.store.renew, [job.id for job in jobs])
        for job in jobs:
            assert isinstance(job, RunningBatch)
            status = held.get(job.id)
            if status is None:
                self.runner.drop(job)
            elif status == "cancelling" and job.batch["status"] == "in_progress":
                job.batch["status"] = status


class RunningBatch(Job):
    """A batch with work left: its pending lines are read a few at a time, each one a run."""

    kind = "batch"

    def __init__(self, batches: Batches, owed: OwedBatch) -> None:
        super().__init__(owed.batch["id"], owed.account)
        self.batches = batches
        self.owed = owed
        self.next_line = 0  # the line after which pending lines are read
        self.queued: list[PendingLine] = []
        self.exhausted = False  # every pending line has been read
        self.finalize_failures = 0
        self.ending: tuple[dict[str, Any], dict[str, Any] | None] | None = None  # cancelled or expired: (change, error)

    @property
    def batch(self) -> dict[str, Any]:
        return self.owed.batch

    def may_run(self) -> bool:
        return self.batch["status"] == "in_progress" and self.ending is None

    def has_new_run(self) -> bool:
        return bool(self.queued) or not self.exhausted

    async def next_run(self, free: int) -> PendingLine | None:
        if not self.queued:
            self.queued = await self.batches.in_store(self.batches.store.pending_lines, self.id, self.next_line,
                                                      max(free, 16))
            if not self.queued:
                self.exhausted = True
                return None
            self.next_line = self.queued[-1].line
        return self.queued.pop(0)

    def run_key(self, run: PendingLine) -> Hashable:
        return run.line

    async def settle(self) -> bool:
        batch, now = self.batch, int(time.time())
        if self.ending is None:
            if batch["status"] == "cancelling":
                self.ending = ({"status": "cancelled", "cancelled_at": now}, None)
            elif batch["status"] == "in_progress" and now >= batch["expires_at"]:
                self.ending = ({"status": "expired", "expired_at": now}, EXPIRED)
            if self.ending is not None:
                self.stop_runs()
        if self.in_flight:
            return False
        if self.ending is not None:
            return await self._finalize(*self.ending)
        if batch["status"] == "finalizing" or (self.exhausted and not self.queued and not self.refused):
            batch.update(status="finalizing", finalizing_at=batch.get("finalizing_at") or now)
            await self.batches.in_store(self.batches.store.update_batch, batch)
            return await self._finalize({"status": "completed", "completed_at": int(time.time())}, None)
        return False

    async def _finalize(self, change: dict[str, Any], unfinished: dict[str, Any] | None) -> bool:
        in_store, store = self.batches.in_store, self.batches.store
        try:
            final = await in_store(store.finalize, self.account, self.batch, change, unfinished)
        except LeaseLost:
            raise
        except Exception as exc:  # tried again on the next step, a few times, then the batch fails saying why
            self.finalize_failures += 1
            if self.finalize_failures < FINALIZE_TRIES:
                raise
            logger.exception("batch %s: its files could not be written; it fails", self.id)
            final = await in_store(store.fail_batch, self.batch, {
                "code": "finalize_failed",
                "message": f"the batch's output could not be written ({type(exc).__name__}: {exc})"})
        counts = final["request_counts"]
        logger.info("batch %s %s: %d completed, %d failed of %d", final["id"], final["status"],
                    counts["completed"], counts["failed"], counts["total"])
        return True

    # ------------------------------------------------------------------ one line

    async def run(self, line: PendingLine, wait_s: float) -> float | None:
        try:
            outcome = await self._outcome(line, wait_s)
            if isinstance(outcome, float):
                return outcome
        except (asyncio.CancelledError, LeaseLost):
            raise  # cancelled, expired or shut down: the line stays pending
        except Exception as exc:  # behind the read position: a line left pending would be skipped
            logger.exception("batch %s line %d failed", self.id, line.line)
            outcome = LineOutcome(False, error_line(line.custom_id, None, {
                "code": "server_error", "message": f"the line could not be run ({type(exc).__name__})"}))
        try:
            await self.batches.in_store(self.batches.store.finish_line, self.batch, line.line, outcome)
        except (asyncio.CancelledError, LeaseLost):
            raise
        except Exception:  # the store failed: the line stays pending, and runs again after a restart
            logger.exception("batch %s line %d: its result could not be stored", self.id, line.line)
        return None

    async def _outcome(self, line: PendingLine, wait_s: float) -> LineOutcome | float:
        """The line's result, or the seconds to wait before sending it again (a 429 or 503 with
        time left in the batch's window: Retry-After, or `wait_s`)."""
        batch = self.batch
        try:
            key = self.batches.key_for(self.owed.key_id)
        except Exception as exc:  # the key was revoked or the account unapproved since
            return LineOutcome(False, error_line(line.custom_id, None, {"code": "unauthorized", "message": str(exc)}))
        import httpx  # here, not at the top: a fifth of a second off every server start

        transport = httpx.ASGITransport(app=_with_key(self.batches.app, key))
        async with httpx.AsyncClient(transport=transport, base_url="http://batch.fastrun", timeout=None) as client:
            response = await client.post(batch["endpoint"], content=line.body,
                                         headers={"content-type": "application/json"})
        if response.status_code in RETRIED_STATUSES:
            retry_after = response.headers.get("retry-after", "")
            delay = float(retry_after) if retry_after.isdigit() else wait_s
            if time.time() + delay < batch["expires_at"]:
                return delay  # else the answer it got is its result
        parsed = await asyncio.to_thread(_json_or_text, response.content)  # an embeddings list can be 25 MB
        result = {"status_code": response.status_code, "request_id": response.headers.get("x-request-id"),
                  "body": parsed}
        if response.status_code >= 400:
            return LineOutcome(False, error_line(line.custom_id, result, None))
        prompt, cached, completion = _usage(parsed)
        return LineOutcome(True, {"id": new_id("batch_req"), "custom_id": line.custom_id, "response": result,
                                  "error": None}, prompt, cached, completion)


def _json_or_text(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")


def _usage(body: Any) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of a chat, completion, embeddings or Responses answer."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    completion = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    return int(prompt), int(details.get("cached_tokens") or 0), int(completion)
