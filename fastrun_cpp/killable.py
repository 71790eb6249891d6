"""Work that could run away, done in processes that are killed when it passes its time limit
(CPU time where the platform tells it: a busy machine does not refuse what fits).

A thread cannot be stopped: one stuck in a schema conversion or a grammar compile would burn a
core until the server exits. A process can. A pool here keeps a few worker processes (spawned,
never forked from a process running llama.cpp threads), hands each job to an idle one, and kills
a worker whose job passes its limit; the next job starts a fresh one.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a running job's CPU time is read
# A job's limit is CPU time; wall time stops it at this multiple (a job blocked on nothing).
WALL_TIME_FACTOR = 10
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class WorkerTimeout(Exception):
    """The job passed its time limit; its worker was killed."""


class WorkerDied(Exception):
    """The worker process ended during the job (killed from outside, out of memory)."""


def serve(connection: Connection, handle: Callable[[Any], Any]) -> None:
    """A worker's loop: answer each message with `handle(message)` until the pipe closes."""
    connection.send("ready")
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        connection.send(handle(message))


class _Worker:
    def __init__(self, context, target: Callable[..., None], args: tuple, name: str, start_timeout_s: float) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, *args), daemon=True, name=name)
        self.process.start()
        child.close()
        if not self.connection.poll(start_timeout_s) or self.connection.recv() != "ready":
            self.kill()
            raise WorkerDied(f"a {name} process did not start")

    def call(self, message: Any, timeout_s: float) -> Any:
        """The answer to `message`, or WorkerTimeout once the job has taken `timeout_s` of the
        worker's CPU: the work it does, not the time a busy machine kept it waiting. Where the
        CPU time cannot be read, and as a backstop for a job that waits on nothing forever,
        wall time counts (WALL_TIME_FACTOR times the limit)."""
        self.connection.send(message)
        started_cpu = self.cpu_seconds()
        deadline = time.monotonic() + (timeout_s if started_cpu is None else WALL_TIME_FACTOR * timeout_s)
        while not self.connection.poll(min(POLL_S, max(0.0, deadline - time.monotonic()))):
            used = self.cpu_seconds()
            if time.monotonic() >= deadline or (used is not None and started_cpu is not None
                                                and used - started_cpu > timeout_s):
                raise WorkerTimeout()
        return self.connection.recv()

    def cpu_seconds(self) -> float | None:
        """The worker's CPU time so far (Linux's /proc), or None where it cannot be read."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return None
        # utime and stime: fields 14 and 15 of stat(5), the 12th and 13th after the name.
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.connection.close()


class KillablePool:
    """Up to `workers` processes running `target(connection, *args)` (which calls `serve`).
    `run` is blocking: call it from a thread."""

    def __init__(self, target: Callable[..., None], args: tuple = (), *, workers: int, name: str,
                 start_timeout_s: float = 120.0) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._target = target
        self._args = args
        self._name = name
        self._start_timeout_s = start_timeout_s
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(workers)
        self._closed = False
        self.killed = 0  # jobs stopped at their time limit (their workers killed)

    def run(self, message: Any, timeout_s: float) -> Any:
        """The worker's answer to `message`; raises WorkerTimeout or WorkerDied."""
        with self._slots:
            worker = self._take()
            try:
                answer = worker.call(message, timeout_s)
            except WorkerTimeout:
                worker.kill()
                self.killed += 1
                logger.warning("a %s job passed its %g s limit; its process was killed", self._name, timeout_s)
                raise
            except (EOFError, OSError) as exc:
                worker.kill()
                raise WorkerDied(f"the {self._name} process failed: {exc}") from None
            self._give_back(worker)
            return answer

    def warm(self) -> None:
        """Start a worker now (a process takes a while to start), so the first job does not wait."""
        with self._slots:
            self._give_back(self._take())

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return _Worker(self._context, self._target, self._args, self._name, self._start_timeout_s)

    def _give_back(self, worker: _Worker) -> None:
        if self._closed:
            worker.kill()
        else:
            self._idle.put(worker)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
