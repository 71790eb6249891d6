"""Killable workers stop a job at its limit in CPU time, the work it does: a job kept waiting
by a busy machine is not refused, a runaway is killed (grammar compiles and schema
conversions run this way)."""

from __future__ import annotations

import sys
import time

import pytest

from fastrun_cpp.killable import KillablePool, WorkerTimeout, serve


def _jobs(connection) -> None:
    def handle(message: tuple[str, float]):
        kind, seconds = message
        if kind == "wait":  # waits without working, as a worker starved of CPU does
            time.sleep(seconds)
        elif kind == "spin":
            while True:
                pass
        return kind

    serve(connection, handle)


@pytest.fixture
def pool():
    pool = KillablePool(_jobs, workers=1, name="test job")
    yield pool
    pool.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU time is read from /proc")
def test_a_job_that_waits_past_its_limit_without_working_is_answered(pool):
    assert pool.run(("wait", 1.5), timeout_s=0.5) == "wait"
    assert pool.killed == 0


def test_a_runaway_job_is_killed_and_the_next_one_gets_a_fresh_worker(pool):
    with pytest.raises(WorkerTimeout):
        pool.run(("spin", 0), timeout_s=0.5)
    assert pool.killed == 1
    assert pool.run(("wait", 0), timeout_s=5) == "wait"
