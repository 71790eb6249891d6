"""Runs the batches' lines: each one is sent through this server's own routes, in process, as the
account's key that created the batch, at bulk priority.

Going through the routes gives a line everything a request gets (validation, the body checks,
the account's rate limits, usage, the access log) and nothing else to keep in step. Bulk priority
puts lines behind every interactive request on the fair share: they take idle slots, and an
interactive request preempts them (the exact resume keeps their answers the same).

Lines are sent a few at a time (about one per slot), in turn over the accounts and then their
batches, so batches keep the slots busy without filling the queue interactive requests wait in. A line that
finds the server or its account full (429) or its model not ready (503) is sent again later, until
the batch's completion window closes; it waits out of its place, so one account's rate limit never
holds the places other accounts' lines run in. A line that timed out (504) is not sent again: it
ran, and was billed, to its timeout; its 504 is its result.

The runner works on the batches whose lease it holds (`leases.py`), renews those leases as it
goes, takes over the batches of a server that died, and drops a batch whose lease another
server took: servers sharing a data directory never run a batch twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from fastrun_cpp.auth import ActiveKey
from fastrun_cpp.entrypoints.openai.batches.store import (
    BatchStore,
    LineOutcome,
    OwedBatch,
    PendingLine,
    error_line,
    new_id,
)
from fastrun_cpp.entrypoints.leases import LeaseLost
from fastrun_cpp.entrypoints.openai.utils import StoreThread
from fastrun_cpp.entrypoints.request_context import SENT_AS_KEY
from fastrun_cpp.entrypoints.tenancy import RETRIED_STATUSES, RETRY_S

logger = logging.getLogger(__name__)

FINALIZE_TRIES = 3
EXPIRED = {"code": "batch_expired", "message": "this line was not run within the batch's completion window"}


@dataclass
class _Running:
    """A batch the runner is working on."""

    owed: OwedBatch
    next_line: int = 0  # the line after which pending lines are read
    queued: list[PendingLine] = field(default_factory=list)
    in_flight: dict[int, asyncio.Task] = field(default_factory=dict)  # by line
    # Lines refused for now (429, 503), to be sent again: (when, the wait after that, the line).
    refused: list[tuple[float, float, PendingLine]] = field(default_factory=list)
    exhausted: bool = False  # every pending line has been read
    finalize_failures: int = 0
    ending: tuple[dict[str, Any], dict[str, Any] | None] | None = None  # cancelled or expired: (change, error)

    @property
    def batch(self) -> dict[str, Any]:
        return self.owed.batch


def _with_key(app: ASGIApp, key: ActiveKey | None) -> ASGIApp:
    async def call(scope: Scope, receive: Receive, send: Send) -> None:
        await app({**scope, SENT_AS_KEY: (key,)}, receive, send)

    return call


class BatchRunner:
    def __init__(self, app: ASGIApp, store: BatchStore, store_thread: StoreThread, *,
                 key_for: Callable[[int | None], ActiveKey | None], in_flight: int) -> None:
        self.app = app
        self.store = store
        self._in_store = store_thread.run
        self._key_for = key_for  # a batch's key by id (raises AuthError once it is revoked)
        self.in_flight = in_flight
        self._running: dict[str, _Running] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._renew_at = 0.0

    async def start(self) -> None:
        await self._take_owed()
        self._task = asyncio.create_task(self._run_forever(), name="fastrun-batches")

    async def stop(self) -> None:
        """Stop sending lines; those in flight are abandoned, and run again after a restart."""
        if self._task is not None:
            self._task.cancel()
        tasks = [task for running in self._running.values() for task in running.in_flight.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *(t for t in [self._task] if t is not None), return_exceptions=True)

    def add(self, owed: OwedBatch) -> None:
        self._start(owed)
        self._wake.set()

    def _start(self, owed: OwedBatch) -> bool:
        """Work on the batch; False if it is worked on already (a batch created here while owed
        work was read)."""
        if owed.batch["id"] in self._running:
            return False
        self._running[owed.batch["id"]] = _Running(owed)
        return True

    def cancel(self, batch: dict[str, Any]) -> None:
        """The batch is now `cancelling`: stop its lines in flight; it ends `cancelled`."""
        running = self._running.get(batch["id"])
        if running is not None:
            running.batch.update(status=batch["status"], cancelling_at=batch.get("cancelling_at"))
        self._wake.set()

    def progress(self) -> list[dict[str, Any]]:
        """Every batch with work left, every account's: what the operator view lists."""
        return [{"id": r.batch["id"], "account": r.owed.account, "status": r.batch["status"],
                 "endpoint": r.batch.get("endpoint"), "created_at": r.batch.get("created_at"),
                 "request_counts": dict(r.batch["request_counts"]), "lines_in_flight": len(r.in_flight)}
                for r in list(self._running.values())]

    # ------------------------------------------------------------------ the loop

    async def _run_forever(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a store error must not stop every batch for good
                logger.exception("batch runner step failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)  # expiry is checked each second
            except asyncio.TimeoutError:
                pass

    async def _take_owed(self) -> None:
        """Take the batches with work left that no live server holds: at start, a restart's
        work; later, that of a server that died."""
        owed = await self._in_store(self.store.owed_batches, frozenset(self._running))
        started = [batch for batch in owed if self._start(batch)]
        if started:
            logger.info("resuming %d batches", len(started))
        self._renew_at = time.monotonic() + self.store.leases.renew_every_s

    async def _renew(self) -> None:
        """Renew the leases of the batches this runner works on; drop those another server took,
        and learn of cancels sent to another server."""
        held = await self._in_store(self.store.renew, list(self._running))
        for batch_id, running in list(self._running.items()):
            status = held.get(batch_id)
            if status is None:
                self._drop(running)
            elif status == "cancelling" and running.batch["status"] == "in_progress":
                running.batch["status"] = status
        await self._take_owed()

    def _drop(self, running: _Running) -> None:
        """Another server holds the batch now: stop its lines here, and write nothing more of it."""
        if self._running.pop(running.batch["id"], None) is not None:
            logger.warning("batch %s is run by another server now", running.batch["id"])
        for task in running.in_flight.values():
            if task is not asyncio.current_task():
                task.cancel()

    async def _tick(self) -> None:
        if time.monotonic() >= self._renew_at:
            await self._renew()
        now = int(time.time())
        for running in list(self._running.values()):
            batch = running.batch
            if running.ending is None:
                if batch["status"] == "cancelling":
                    running.ending = ({"status": "cancelled", "cancelled_at": now}, None)
                elif batch["status"] == "in_progress" and now >= batch["expires_at"]:
                    running.ending = ({"status": "expired", "expired_at": now}, EXPIRED)
                if running.ending is not None:
                    for task in running.in_flight.values():
                        task.cancel()
            if running.in_flight:
                continue
            if running.ending is not None:
                await self._finalize(running, *running.ending)
            elif batch["status"] == "finalizing" or (running.exhausted and not running.queued and not running.refused):
                batch.update(status="finalizing", finalizing_at=batch.get("finalizing_at") or now)
                try:
                    await self._in_store(self.store.update_batch, batch)
                except LeaseLost:
                    self._drop(running)
                    continue
                await self._finalize(running, {"status": "completed", "completed_at": int(time.time())}, None)
        await self._fill()

    async def _fill(self) -> None:
        """Start lines up to the limit in flight, one batch at a time in turn."""
        while (free := self.in_flight - sum(len(r.in_flight) for r in self._running.values())) > 0:
            now = time.monotonic()
            candidates = [r for r in self._running.values() if r.batch["status"] == "in_progress"
                          and r.ending is None and (r.queued or not r.exhausted or _due(r, now))]
            if not candidates:
                return
            by_account: dict[str, int] = {}
            for r in self._running.values():
                by_account[r.owed.account] = by_account.get(r.owed.account, 0) + len(r.in_flight)
            # Accounts take turns, then their batches: a second batch does not double an account's lines.
            running = min(candidates, key=lambda r: (by_account[r.owed.account], len(r.in_flight)))
            due = _due(running, now)
            if due is not None:  # a refused line whose wait is over goes first
                running.refused.remove(due)
                _, wait_s, line = due
                running.in_flight[line.line] = asyncio.create_task(self._run_line(running, line, wait_s))
                continue
            if not running.queued:
                running.queued = await self._in_store(self.store.pending_lines, running.batch["id"],
                                                      running.next_line, max(free, 16))
                if not running.queued:
                    running.exhausted = True
                    self._wake.set()  # its end is decided on the next tick
                    continue
                running.next_line = running.queued[-1].line
            line = running.queued.pop(0)
            task = asyncio.create_task(self._run_line(running, line, RETRY_S[0]))
            running.in_flight[line.line] = task

    async def _finalize(self, running: _Running, change: dict[str, Any], unfinished: dict[str, Any] | None) -> None:
        try:
            final = await self._in_store(self.store.finalize, running.owed.account, running.batch, change, unfinished)
        except LeaseLost:
            self._drop(running)
            return
        except Exception as exc:  # tried again next tick, a few times, then the batch fails saying why
            running.finalize_failures += 1
            if running.finalize_failures < FINALIZE_TRIES:
                raise
            logger.exception("batch %s: its files could not be written; it fails", running.batch["id"])
            try:
                final = await self._in_store(self.store.fail_batch, running.batch, {
                    "code": "finalize_failed",
                    "message": f"the batch's output could not be written ({type(exc).__name__}: {exc})"})
            except LeaseLost:
                self._drop(running)
                return
        self._running.pop(final["id"], None)
        counts = final["request_counts"]
        logger.info("batch %s %s: %d completed, %d failed of %d", final["id"], final["status"],
                    counts["completed"], counts["failed"], counts["total"])

    # ------------------------------------------------------------------ one line

    async def _run_line(self, running: _Running, line: PendingLine, wait_s: float) -> None:
        try:
            try:
                outcome = await self._outcome(running, line, wait_s)
                if isinstance(outcome, float):  # refused for now: sent again after that wait, out of its place
                    running.refused.append((time.monotonic() + outcome, min(RETRY_S[1], wait_s * 2), line))
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # behind the read position: a line left pending would be skipped
                logger.exception("batch %s line %d failed", running.batch["id"], line.line)
                outcome = LineOutcome(False, error_line(line.custom_id, None, {
                    "code": "server_error", "message": f"the line could not be run ({type(exc).__name__})"}))
            await self._in_store(self.store.finish_line, running.batch, line.line, outcome)
        except LeaseLost:  # another server took the batch over: it runs the line, this answer is not kept
            self._drop(running)
        except asyncio.CancelledError:
            pass  # cancelled, expired or shut down: the line stays pending
        except Exception:  # the store failed: the line stays pending, and runs again after a restart
            logger.exception("batch %s line %d: its result could not be stored", running.batch["id"], line.line)
        finally:
            running.in_flight.pop(line.line, None)
            self._wake.set()

    async def _outcome(self, running: _Running, line: PendingLine, wait_s: float = RETRY_S[0]) -> LineOutcome | float:
        """The line's result, or the seconds to wait before sending it again (a 429 or 503 with
        time left in the batch's window: Retry-After, or `wait_s`)."""
        batch = running.batch
        try:
            key = self._key_for(running.owed.key_id)
        except Exception as exc:  # the key was revoked or the account unapproved since
            return LineOutcome(False, error_line(line.custom_id, None, {"code": "unauthorized", "message": str(exc)}))
        transport = httpx.ASGITransport(app=_with_key(self.app, key))
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


def _due(running: _Running, now: float) -> tuple[float, float, PendingLine] | None:
    """The refused line of `running` whose wait is over first, or None."""
    return min((entry for entry in running.refused if entry[0] <= now), key=lambda entry: entry[0], default=None)


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
