"""One runner for the work the server owns: batches (a run per line) and background responses
(one run each) are jobs of one queue, run a few at a time at bulk priority.

The runner owns what every job shares: how many runs are in flight at once (about one per slot,
so jobs keep the slots busy without filling the queue interactive requests wait in), whose run
starts next (accounts take turns, then their jobs, so a second batch does not double an
account's share), a refused run's wait (a 429 or 503 waits out of its place, holding no run
slot, with a wait that doubles up to a bound), and the leases (`leases.py`): each kind's leases
are renewed every third of the lease, the jobs of a server that died are taken over, and a job
whose lease another server took is dropped.

A job says what is its own: its next run, how a run is done, its deadline, and how it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Hashable, TypeVar

from fastrun_cpp.entrypoints.leases import LeaseLost
from fastrun_cpp.entrypoints.tenancy import RETRY_S

logger = logging.getLogger(__name__)


@dataclass(order=True)
class Refused:
    """A run refused for now, started again once `due` (time.monotonic()) has come."""

    due: float
    wait_s: float = field(compare=False)  # its wait if it is refused again
    run: Any = field(compare=False)


class Job(ABC):
    """A unit of the server's own work, run by `JobRunner` one run at a time or several."""

    kind: str  # "batch" or "background"

    def __init__(self, job_id: str, account: str) -> None:
        self.id = job_id
        self.account = account
        self.in_flight: dict[Hashable, asyncio.Task] = {}  # by run_key(run)
        self.refused: list[Refused] = []
        self.last_turn = -1  # when it last started a run, in the runner's turns

    @abstractmethod
    def may_run(self) -> bool:
        """Whether runs may start now (False once it is ending)."""

    @abstractmethod
    def has_new_run(self) -> bool:
        """Whether a run not yet started may be left (next_run is asked for it)."""

    @abstractmethod
    async def next_run(self, free: int) -> Any | None:
        """The next run to start, or None when there is none left; `free`: run slots free now."""

    @abstractmethod
    def run_key(self, run: Any) -> Hashable:
        ...

    @abstractmethod
    async def run(self, run: Any, wait_s: float) -> float | None:
        """Do the run; the seconds to wait before it is started again if it was refused for now
        (Retry-After, else `wait_s`) and the job's deadline allows, else None."""

    @abstractmethod
    async def settle(self) -> bool:
        """Called on each of the runner's steps: end the job if it is over (finalize, store its
        end); True once it is, and the runner forgets it."""

    def dropped(self) -> None:
        """Another server holds the job now (or it was deleted): nothing more of it is written here."""

    def due(self, now: float) -> Refused | None:
        return min((refused for refused in self.refused if refused.due <= now), default=None)

    def stop_runs(self) -> None:
        for task in self.in_flight.values():
            if task is not asyncio.current_task():
                task.cancel()


J = TypeVar("J", bound=Job)


class JobKind(ABC):
    """Where the jobs of one kind are kept: their leases are renewed, and owed ones found, here."""

    job_type: type[Job]

    @abstractmethod
    async def renew(self, jobs: list[Job]) -> None:
        """Renew the leases of this kind's jobs this server runs; drop (`JobRunner.drop`) those it
        lost, and act on what other servers asked of the others (a cancel)."""

    @abstractmethod
    async def owed(self, held: frozenset[str]) -> list[Job]:
        """The jobs with work left that no live server holds, their leases now taken: at start,
        a restart's work; later, that of a server that died."""


class JobRunner:
    def __init__(self, *, in_flight: int, renew_every_s: float) -> None:
        self.in_flight = in_flight
        self.renew_every_s = renew_every_s
        self._kinds: list[JobKind] = []
        self._jobs: dict[str, Job] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._renew_at = 0.0
        self._turns = itertools.count()

    def add_kind(self, kind: JobKind) -> None:
        self._kinds.append(kind)

    async def start(self) -> None:
        await self._take_owed()
        self._task = asyncio.create_task(self._run_forever(), name="fastrun-jobs")

    async def stop(self) -> None:
        """Stop every run: those in flight are abandoned, and run again after a restart."""
        if self._task is not None:
            self._task.cancel()
        tasks = [task for job in self._jobs.values() for task in job.in_flight.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *(t for t in [self._task] if t is not None), return_exceptions=True)

    def add(self, job: Job) -> bool:
        """Run the job; False if it runs already (one added here while owed work was read)."""
        if job.id in self._jobs:
            return False
        self._jobs[job.id] = job
        self._wake.set()
        return True

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def jobs(self, kind: type[J]) -> list[J]:
        return [job for job in list(self._jobs.values()) if isinstance(job, kind)]

    def drop(self, job: Job) -> None:
        """Another server holds the job now: stop its runs here, and write nothing more of it."""
        if self._jobs.pop(job.id, None) is not None:
            logger.warning("%s %s is run by another server now", job.kind, job.id)
        job.stop_runs()
        job.dropped()

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    async def _run_forever(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a store error must not stop every job for good
                logger.exception("job runner step failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)  # deadlines are checked each second
            except asyncio.TimeoutError:
                pass

    async def _take_owed(self) -> None:
        for kind in self._kinds:
            started = [job for job in await kind.owed(frozenset(self._jobs)) if self.add(job)]
            if started:
                logger.info("running %d %s jobs owed", len(started), started[0].kind)
        self._renew_at = time.monotonic() + self.renew_every_s

    async def _step(self) -> None:
        if time.monotonic() >= self._renew_at:
            for kind in self._kinds:
                await kind.renew(self.jobs(kind.job_type))
            await self._take_owed()
        for job in list(self._jobs.values()):
            try:
                over = await job.settle()
            except LeaseLost:
                self.drop(job)
                continue
            except Exception:  # tried again on the next step; the job decides when to give up
                logger.exception("%s %s could not be ended", job.kind, job.id)
                continue
            if over:
                self._jobs.pop(job.id, None)
        await self._fill()

    async def _fill(self) -> None:
        """Start runs up to the limit in flight: accounts take turns, then their jobs. The account
        with the fewest runs in flight goes first, and of those the one whose last turn is the
        oldest (so one run in flight at a time still goes round the accounts)."""
        while (free := self.in_flight - sum(len(job.in_flight) for job in self._jobs.values())) > 0:
            now = time.monotonic()
            candidates = [job for job in self._jobs.values()
                          if job.may_run() and (job.has_new_run() or job.due(now) is not None)]
            if not candidates:
                return
            in_flight: dict[str, int] = {}
            last_turn: dict[str, int] = {}
            for job in self._jobs.values():
                in_flight[job.account] = in_flight.get(job.account, 0) + len(job.in_flight)
                last_turn[job.account] = max(last_turn.get(job.account, -1), job.last_turn)
            job = min(candidates, key=lambda job: (in_flight[job.account], last_turn[job.account],
                                                   len(job.in_flight), job.last_turn))
            due = job.due(now)
            if due is not None:  # a refused run whose wait is over goes first
                job.refused.remove(due)
                self._start(job, due.run, due.wait_s)
                continue
            run = await job.next_run(free)
            if run is None:
                self._wake.set()  # its end is decided on the next step
                continue
            self._start(job, run, RETRY_S[0])

    def _start(self, job: Job, run: Any, wait_s: float) -> None:
        job.last_turn = next(self._turns)
        key = job.run_key(run)
        task = asyncio.create_task(self._run(job, run, wait_s), name=f"fastrun-{job.kind}-{job.id}")
        job.in_flight[key] = task

        def ended(task: asyncio.Task) -> None:  # also for a task cancelled before it started running
            if job.in_flight.get(key) is task:
                del job.in_flight[key]
            self._wake.set()

        task.add_done_callback(ended)

    async def _run(self, job: Job, run: Any, wait_s: float) -> None:
        try:
            wait = await job.run(run, wait_s)
            if wait is not None:  # refused for now: started again after that wait, out of its place
                job.refused.append(Refused(time.monotonic() + wait, min(RETRY_S[1], wait_s * 2), run))
        except LeaseLost:  # another server took the job over: it runs it, this answer is not kept
            self.drop(job)
        except asyncio.CancelledError:
            pass  # cancelled, dropped or shut down: the job says what stays owed
        except Exception:
            logger.exception("%s %s: a run failed", job.kind, job.id)
