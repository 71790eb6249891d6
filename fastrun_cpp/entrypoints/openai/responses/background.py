"""Background responses (`background: true`): answered at once with a queued response, run as
jobs of the server's one runner (`entrypoints/jobs.py`) at bulk priority behind every
interactive request, followed or replayed as a stream
(`GET /v1/responses/{id}?stream=true&starting_after=N`), cancelled, and run again after a
restart (the job is stored with the response; a run cut by a restart starts over, and at
temperature 0 or with a seed it gives the same answer).

Each run is admitted through the account's gate, as a request its key sent. A run refused for
now (the account's limits, a 429 or 503 of its model) waits out of its place, for an hour at
most; the job then fails with the last refusal. A job runs on the server that holds its lease:
one that lost it (deleted, or taken over) stops, and a cancel sent to another server reaches it
through its lease."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Hashable

from sse_starlette import ServerSentEvent

from fastrun_cpp.auth import ActiveKey
from fastrun_cpp.entrypoints.jobs import Job, JobKind, JobRunner
from fastrun_cpp.entrypoints.openai.errors import APIError
from fastrun_cpp.entrypoints.openai.responses.store import BackgroundJob, StoredResponse
from fastrun_cpp.entrypoints.request_context import RequestRecord, set_current_record
from fastrun_cpp.entrypoints.tenancy import RETRIED_STATUSES, AccountGate, LimitReached, UsageRecorder

if TYPE_CHECKING:
    from fastrun_cpp.entrypoints.openai.responses.serving import OpenAIServingResponses

logger = logging.getLogger(__name__)

RETRY_DEADLINE_S = 3600.0  # a job the server could not start for an hour fails with the last refusal
LIFECYCLE = frozenset({"response.created", "response.in_progress"})  # sent before the engine answers
ACTIVE = ("queued", "in_progress")


class BackgroundResponses(JobKind):
    """The background responses this server runs, as jobs of its runner."""

    def __init__(self, serving: OpenAIServingResponses, runner: JobRunner, *,
                 key_for: Callable[[int | None], ActiveKey | None], gate: AccountGate,
                 usage: UsageRecorder | None, per_account: int) -> None:
        self.job_type = RunningResponse
        self.serving = serving
        self.runner = runner
        self.key_for = key_for
        self.gate = gate  # the accounts' limits, shared with the requests keys send
        self.usage = usage
        self.per_account = per_account
        runner.add_kind(self)

    def run(self, job: BackgroundJob) -> None:
        self.runner.add(RunningResponse(self, job))

    def _running(self, response_id: str) -> RunningResponse | None:
        job = self.runner.get(response_id)
        return job if isinstance(job, RunningResponse) else None

    def progress(self) -> list[dict[str, Any]]:
        """Every background response queued or running, every account's: what the operator view lists."""
        return [{"id": r.id, "account": r.account, "status": r.status, "model": r.job.request.get("model"),
                 "events": len(r.events)}
                for r in self.runner.jobs(RunningResponse) if not r.done]

    async def owed(self, held: frozenset[str]) -> list[Job]:
        return [RunningResponse(self, job)
                for job in await self.serving.in_store(self.serving.store.owed_background, held)]

    async def renew(self, jobs: list[Job]) -> None:
        """Stop the jobs deleted or taken over by another server; cancel those a cancel sent to
        another server asks this one to."""
        held = await self.serving.in_store(self.serving.store.renew_background, [job.id for job in jobs])
        for job in jobs:
            if job.id not in held:
                self.runner.drop(job)
            elif held[job.id]:
                self.cancel(job.id)

    def cancel(self, response_id: str) -> bool:
        """Stop a job this server runs (it ends `cancelled`); False if it runs none."""
        running = self._running(response_id)
        if running is None or running.done:
            return False
        running.status = "cancelled"
        running.stop_runs()  # a run in flight stores the end; else the runner's next step does
        self.runner.wake()
        return True

    async def wait_cancelled(self, response_id: str) -> None:
        running = self._running(response_id)
        if running is not None:
            await running.ended.wait()

    async def settled(self, account: str | None, response_id: str) -> StoredResponse | None:
        """The stored response once it has ended (a job another server runs), or as it is after
        a few of that server's renewals."""
        return await self._stored_once_ended(account, response_id, 3 * self.serving.store.leases.renew_every_s)

    async def _stored_once_ended(self, account: str | None, response_id: str,
                                 within_s: float | None = None) -> StoredResponse | None:
        """The stored response once it is no longer queued or in progress (or gone), or as it is
        once `within_s` have passed."""
        give_up_at = time.monotonic() + within_s if within_s is not None else None
        while True:
            stored = await self.serving.in_store(self.serving.store.get, account, response_id)
            if stored is None or stored.response["status"] not in ACTIVE or \
                    (give_up_at is not None and time.monotonic() >= give_up_at):
                return stored
            await asyncio.sleep(0.25)

    # ------------------------------------------------------------------ following

    async def follow(self, account: str | None, response_id: str, after: int) -> AsyncIterator[ServerSentEvent]:
        """The response's events after sequence number `after`: the stored ones of a finished
        job, or the live job's so far, then each as it comes."""
        sent = after + 1
        running = self._running(response_id)
        if running is None:  # ended, or run by another server: its events are read once it ends
            await self._stored_once_ended(account, response_id)
            stored = await self.serving.in_store(self.serving.store.events, account, response_id) or []
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


class RunningResponse(Job):
    """A background response queued or running: one run, started again while it is refused."""

    kind = "background"

    def __init__(self, responses: BackgroundResponses, job: BackgroundJob) -> None:
        super().__init__(job.response_id, job.account)
        self.responses = responses
        self.job = job
        self.status = "queued"  # then in_progress; cancelled (stored so) or lost (nothing more stored here)
        self.started = False
        self.events: list[str] = []  # the data of each event so far
        self.changed = asyncio.Event()  # set on each event and at the end
        self.ended = asyncio.Event()
        self.give_up_at = time.monotonic() + RETRY_DEADLINE_S

    @property
    def done(self) -> bool:
        return self.ended.is_set()

    def may_run(self) -> bool:
        return self.status in ACTIVE and not self.done

    def has_new_run(self) -> bool:
        return not self.started

    async def next_run(self, free: int) -> str:
        self.started = True
        return "answer"

    def run_key(self, run: str) -> Hashable:
        return run

    def dropped(self) -> None:
        self.status = "lost"
        self._end()

    async def settle(self) -> bool:
        if self.status == "cancelled" and not self.in_flight and not self.done:
            # cancelled while it waited out a refusal, or before its first run
            await asyncio.shield(self.responses.serving.end_background(self.job, self.events, cancelled=True))
            self._end()
        return self.done and not self.in_flight

    def _end(self) -> None:
        self.ended.set()
        self.changed.set()

    async def run(self, _run: str, wait_s: float) -> float | None:
        serving = self.responses.serving
        try:
            key = self.responses.key_for(self.job.key_id)
        except Exception as exc:  # the key was revoked since (or the account unapproved)
            await serving.end_background(self.job, [], failed=APIError(401, str(exc), "authentication_error"))
            self._end()
            return None
        record = RequestRecord(request_id=self.id, account=key.account if key else None, key_id=self.job.key_id,
                               bulk=True)
        if key is not None:
            record.cache_namespace, record.weight, record.min_priority = key.cache_namespace, key.weight, \
                key.min_priority
        set_current_record(record)  # this run's own context: the engine reads the account from it
        last = True
        try:
            refused = await self._attempt(key, record)
            if refused is None:
                return None
            if time.monotonic() >= self.give_up_at:
                await serving.end_background(self.job, self.events, failed=refused)
                return None
            last = False
            return refused.retry_after or wait_s
        except asyncio.CancelledError:
            if self.status != "cancelled":
                raise  # lost, or the server stops: the job stays owed, and runs again after a restart
            await asyncio.shield(serving.end_background(self.job, self.events, cancelled=True))
            return None
        finally:
            record.release()
            if last:
                usage = self.responses.usage
                if usage is not None and record.account is not None and record.model is not None:
                    usage.count(record.account, record.prompt_tokens, record.cached_tokens,
                                record.completion_tokens, batch=True)
                self._end()

    async def _attempt(self, key: ActiveKey | None, record: RequestRecord) -> APIError | None:
        """Run the job once, as its account's request: admitted through the account's gate (its
        rpm, tpm and max_concurrent apply, as to a request the key sent), its tokens held while
        it runs. The refusal to wait out (429, 503), or None once the job has ended."""
        serving = self.responses.serving
        try:
            ticket = self.responses.gate.admit(key) if key is not None else None
        except LimitReached as exc:
            return APIError(429, exc.message, "rate_limit_error", retry_after=exc.retry_after_s)
        record.ticket = ticket
        try:
            try:
                events = await serving.answer_background(self.job)
            except APIError as exc:
                if exc.status_code in RETRIED_STATUSES:
                    return exc
                await serving.end_background(self.job, self.events, failed=exc)
                return None
            async for event in events:
                if self.status == "queued" and event.event not in LIFECYCLE:
                    # The answer's first item: the engine has given it a slot and is answering.
                    self.status = "in_progress"
                    await serving.mark_background(self.job, "in_progress")
                self.events.append(event.data)
                self.changed.set()
            await serving.end_background(self.job, self.events)
            return None
        finally:
            record.ticket = None
            if ticket is not None:
                ticket.finish(record.prompt_tokens + record.completion_tokens)


def _event(data: str) -> ServerSentEvent:
    return ServerSentEvent(data=data, event=json.loads(data)["type"])


def request_for_background(request: Any) -> dict[str, Any]:
    """The request as it is stored to be run again: validated fields only, answered as a stream
    (its events are what followers read)."""
    body = request.model_dump(mode="json", exclude_unset=True, by_alias=True)
    body.update(background=False, stream=True)
    return body
