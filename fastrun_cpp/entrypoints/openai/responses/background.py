"""Background responses (`background: true`): answered at once with a queued response, run at
bulk priority behind every interactive request, followed or replayed as a stream
(`GET /v1/responses/{id}?stream=true&starting_after=N`), cancelled, and run again after a
restart (the job is stored with the response; a run cut by a restart starts over, and at
temperature 0 or with a seed it gives the same answer).

A job runs on the server that holds its lease (`leases.py`): servers sharing a data directory
never run one twice. Each renews its leases as it runs, takes over the jobs of a server that
died, stops a job whose lease it lost (or that was deleted), and cancels a job when a cancel
sent to another server asks it to."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from sse_starlette import ServerSentEvent

from fastrun_cpp.auth import ActiveKey
from fastrun_cpp.entrypoints.leases import LeaseLost
from fastrun_cpp.entrypoints.openai.errors import APIError
from fastrun_cpp.entrypoints.openai.responses.store import BackgroundJob, StoredResponse
from fastrun_cpp.entrypoints.request_context import RequestRecord, set_current_record
from fastrun_cpp.entrypoints.tenancy import RETRIED_STATUSES, RETRY_S, AccountGate, LimitReached, UsageRecorder

if TYPE_CHECKING:
    from fastrun_cpp.entrypoints.openai.responses.serving import OpenAIServingResponses

logger = logging.getLogger(__name__)

RETRY_DEADLINE_S = 3600.0  # a job the server could not start for an hour fails with the last refusal
LIFECYCLE = frozenset({"response.created", "response.in_progress"})  # sent before the engine answers


@dataclass
class _Running:
    job: BackgroundJob
    task: asyncio.Task | None = None
    events: list[str] = field(default_factory=list)  # the data of each event so far
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set on each event and at the end
    done: bool = False
    status: str = "queued"


class BackgroundResponses:
    def __init__(self, serving: OpenAIServingResponses, *, key_for: Callable[[int | None], ActiveKey | None],
                 gate: AccountGate, usage: UsageRecorder | None, in_flight: int, per_account: int) -> None:
        self.serving = serving
        self._key_for = key_for
        self._gate = gate  # the accounts' limits, shared with the requests keys send
        self._usage = usage
        self._turns = asyncio.Semaphore(in_flight)  # jobs in the engine at once: the queue stays for interactive work
        self.per_account = per_account
        self._running: dict[str, _Running] = {}
        self._leases_task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._take_owed()
        self._leases_task = asyncio.create_task(self._keep_leases(), name="fastrun-background-leases")

    async def _take_owed(self) -> None:
        """Run the jobs not done that no live server holds: at start, a restart's work; later,
        that of a server that died."""
        owed = await self.serving.in_store(self.serving.store.owed_background, frozenset(self._running))
        started = [job for job in owed if self.run(job)]
        if started:
            logger.info("running %d background responses again", len(started))

    async def _keep_leases(self) -> None:
        store = self.serving.store
        while True:
            await asyncio.sleep(store.leases.renew_every_s)
            try:
                held = await self.serving.in_store(store.renew_background, list(self._running))
                for response_id, running in list(self._running.items()):
                    if response_id not in held:  # deleted, or taken over by another server
                        self._stop(running, "lost")
                    elif held[response_id]:  # a cancel sent to another server
                        self.cancel(response_id)
                await self._take_owed()
            except asyncio.CancelledError:
                raise
            except Exception:  # a store error must not end the renewals for good
                logger.exception("background leases could not be renewed")

    async def stop(self) -> None:
        if self._leases_task is not None:
            self._leases_task.cancel()
        tasks = [running.task for running in self._running.values() if running.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def run(self, job: BackgroundJob) -> bool:
        """Start the job; False if it runs already (a job queued here while owed work was read)."""
        if job.response_id in self._running:
            return False
        running = _Running(job)
        self._running[job.response_id] = running
        running.task = asyncio.create_task(self._run(running), name=f"fastrun-background-{job.response_id}")
        return True

    def is_running(self, response_id: str) -> bool:
        running = self._running.get(response_id)
        return running is not None and not running.done

    def progress(self) -> list[dict[str, Any]]:
        """Every background response queued or running, every account's: what the operator view lists."""
        return [{"id": r.job.response_id, "account": r.job.account, "status": r.status,
                 "model": r.job.request.get("model"), "events": len(r.events)}
                for r in list(self._running.values()) if not r.done]

    # ------------------------------------------------------------------ a job

    async def _run(self, running: _Running) -> None:
        job = running.job
        try:
            key = self._key_for(job.key_id)
        except Exception as exc:  # the key was revoked since (or the account unapproved)
            await self.serving.end_background(job, [], failed=APIError(401, str(exc), "authentication_error"))
            running.done = True
            running.changed.set()
            return
        record = RequestRecord(request_id=job.response_id, account=key.account if key else None,
                               key_id=job.key_id, bulk=True)
        if key is not None:
            record.cache_namespace, record.weight, record.min_priority = key.cache_namespace, key.weight, \
                key.min_priority
        set_current_record(record)  # this task's own context: the engine reads the account from it
        wait_s = RETRY_S[0]
        give_up_at = time.monotonic() + RETRY_DEADLINE_S
        try:
            while True:
                async with self._turns:
                    refused = await self._attempt(running, key, record)
                if refused is None:
                    return
                if time.monotonic() >= give_up_at:
                    await self.serving.end_background(job, running.events, failed=refused)
                    return
                # Waited out of turn: a job its model cannot take now (not loaded, or failing to
                # load), or its account's limits, leaves its place to every other account's jobs.
                await asyncio.sleep(refused.retry_after or wait_s)
                wait_s = min(RETRY_S[1], wait_s * 2)
        except asyncio.CancelledError:
            if running.status != "cancelled":
                raise  # the server stops: the job stays owed, and runs again after the restart
            await asyncio.shield(self.serving.end_background(job, running.events, cancelled=True))
        except LeaseLost:  # its end is another server's to write
            logger.warning("background response %s is run by another server now", job.response_id)
        finally:
            record.release()
            if self._usage is not None and record.account is not None and record.model is not None:
                self._usage.count(record.account, record.prompt_tokens, record.cached_tokens,
                                  record.completion_tokens, batch=True)
            running.done = True
            running.changed.set()
            self._running.pop(job.response_id, None)

    async def _attempt(self, running: _Running, key: ActiveKey | None, record: RequestRecord) -> APIError | None:
        """Run the job once, as its account's request: admitted through the account's gate (its
        rpm, tpm and max_concurrent apply, as to a request the key sent), its tokens held while
        it runs. The refusal to wait out (429, 503), or None once the job has ended."""
        job = running.job
        try:
            ticket = self._gate.admit(key) if key is not None else None
        except LimitReached as exc:
            return APIError(429, exc.message, "rate_limit_error", retry_after=exc.retry_after_s)
        record.ticket = ticket
        try:
            try:
                events = await self.serving.answer_background(job)
            except APIError as exc:
                if exc.status_code in RETRIED_STATUSES:
                    return exc
                await self.serving.end_background(job, running.events, failed=exc)
                return None
            async for event in events:
                if running.status == "queued" and event.event not in LIFECYCLE:
                    # The answer's first item: the engine has given it a slot and is answering.
                    running.status = "in_progress"
                    await self.serving.mark_background(job, "in_progress")
                running.events.append(event.data)
                running.changed.set()
            await self.serving.end_background(job, running.events)
            return None
        finally:
            record.ticket = None
            if ticket is not None:
                ticket.finish(record.prompt_tokens + record.completion_tokens)

    def cancel(self, response_id: str) -> bool:
        """Stop a job this server runs (it ends `cancelled`); False if it runs none."""
        running = self._running.get(response_id)
        if running is None or running.done or running.task is None:
            return False
        self._stop(running, "cancelled")
        return True

    @staticmethod
    def _stop(running: _Running, status: str) -> None:
        """`cancelled`: the job ends so, stored; `lost`: it ends here, and nothing of it is stored."""
        if running.task is not None and not running.done:
            running.status = status
            running.task.cancel()

    async def settled(self, account: str | None, response_id: str) -> StoredResponse | None:
        """The stored response once it has ended (a job another server runs), or as it is after
        a few of that server's renewals."""
        store = self.serving.store
        give_up_at = time.monotonic() + 3 * store.leases.renew_every_s
        while True:
            stored = await self.serving.in_store(store.get, account, response_id)
            if stored is None or stored.response["status"] not in ("queued", "in_progress") or \
                    time.monotonic() >= give_up_at:
                return stored
            await asyncio.sleep(0.25)

    async def wait_cancelled(self, response_id: str) -> None:
        running = self._running.get(response_id)
        if running is not None and running.task is not None:
            await asyncio.wait([running.task])

    # ------------------------------------------------------------------ following

    async def follow(self, account: str | None, response_id: str, after: int) -> AsyncIterator[ServerSentEvent]:
        """The response's events after sequence number `after`: the stored ones of a finished
        job, or the live job's so far, then each as it comes."""
        sent = after + 1
        running = self._running.get(response_id)
        if running is None:  # ended, or run by another server: its events are read once it ends
            while (stored := await self.serving.in_store(self.serving.store.events, account, response_id)) is None:
                response = await self.serving.in_store(self.serving.store.get, account, response_id)
                if response is None or response.response["status"] not in ("queued", "in_progress"):
                    return
                await asyncio.sleep(0.5)
            for data in stored[sent:]:
                yield _event(data)
            return
        while True:
            running.changed.clear()
            while sent < len(running.events):
                yield _event(running.events[sent])
                sent += 1
            if running.done:
                return
            await running.changed.wait()


def _event(data: str) -> ServerSentEvent:
    return ServerSentEvent(data=data, event=json.loads(data)["type"])


def request_for_background(request: Any) -> dict[str, Any]:
    """The request as it is stored to be run again: validated fields only, answered as a stream
    (its events are what followers read)."""
    body = request.model_dump(mode="json", exclude_unset=True, by_alias=True)
    body.update(background=False, stream=True)
    return body
