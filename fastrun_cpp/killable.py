"""Work that could run away, done in processes that are killed when it passes its time limit.

A thread cannot be stopped: one stuck in a schema conversion or a grammar compile would burn a
core until the server exits. A process can. A pool here keeps a few worker processes (spawned,
never forked from a process running llama.cpp threads), hands each job to an idle one, and kills
a worker whose job passes its limit; the next job starts a fresh one.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

logger = logging.getLogger(__name__)


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
        self.connection.send(message)
        if not self.connection.poll(timeout_s):
            raise WorkerTimeout()
        return self.connection.recv()

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
