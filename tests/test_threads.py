"""The engine runs fewer llama.cpp threads while other processes keep the cores busy, and the
answers do not depend on how many threads computed them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import httpx
import pytest

from fastrun_cpp.engine.threads import ThreadGovernor, busy_seconds
from tests.server import DEFAULT_MODEL, run_server, wait_until

pytestmark = pytest.mark.timeout(900)


class FakeMachine:
    """/proc/stat and the clocks of a machine whose other processes use `others` cores."""

    def __init__(self, cores: int) -> None:
        self.cores, self.others, self.own_per_s = cores, 0.0, 1.0
        self.now, self.busy, self.own = 0.0, 0.0, 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.own += self.own_per_s * seconds
        self.busy += (self.own_per_s + self.others) * seconds

    def stat(self) -> str:
        ticks = round(self.busy * os.sysconf("SC_CLK_TCK") / self.cores)
        lines = [f"cpu  {ticks * self.cores} 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{n} {ticks} 0 0 999 0 0 0 0 0 0" for n in range(self.cores)]
        return "\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n"

    def governor(self, most: int) -> ThreadGovernor:
        return ThreadGovernor(most, interval_s=0.5, cpus=frozenset(range(self.cores)), read_stat=self.stat,
                              clock=lambda: self.now, own_cpu=lambda: self.own)


def poll_for(machine: FakeMachine, governor: ThreadGovernor, seconds: float) -> list[int]:
    changes = []
    for _ in range(int(seconds / 0.1)):
        machine.advance(0.1)
        if (threads := governor.poll()) is not None:
            changes.append(threads)
    return changes


def test_threads_follow_the_cores_other_processes_leave_and_never_flap():
    machine = FakeMachine(cores=4)
    governor = machine.governor(most=4)
    assert poll_for(machine, governor, 3) == []  # idle: all four
    machine.others = 2.0  # two CPU-bound processes
    assert poll_for(machine, governor, 3) == [2]
    machine.others = 6.0  # more than the machine: still one thread
    assert poll_for(machine, governor, 3) == [1]
    machine.others = 0.0
    assert poll_for(machine, governor, 3) == [4]  # back up when they go, never past --threads
    for _ in range(10):  # a burst that can raise one poll's reading only changes nothing
        machine.others = 2.0
        assert poll_for(machine, governor, 0.2) == []
        machine.others = 0.0
        assert poll_for(machine, governor, 0.8) == []
    assert governor.current == 4


def test_busy_seconds_counts_only_the_cores_this_process_may_use():
    stat = "cpu  40 0 0 0\ncpu0 10 0 0 7 0 0 0 0\ncpu1 30 0 0 7 0 1 0 2\nintr 9\n"
    ticks = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(frozenset({0}), stat) == 10 / ticks
    assert busy_seconds(frozenset({1}), stat) == 33 / ticks  # irq and steal count as busy, idle not
    assert busy_seconds(frozenset({5}), stat) is None
    one = ThreadGovernor(1, read_stat=lambda: pytest.fail("one thread is never polled"))
    assert one.poll() is None


def engine_threads(server) -> int:
    text = httpx.get(f"{server.root_url}/metrics", timeout=60).text
    return int(float(re.search(r'^fastrun_engine_threads\{model="[^"]+"\} (\S+)$', text, re.MULTILINE).group(1)))


def test_a_server_beside_cpu_bound_processes_drops_to_the_cores_they_leave(tmp_path):
    cores = len(os.sched_getaffinity(0))
    with run_server("--threads", "2", "--spec-type", "none", log_dir=tmp_path) as server:
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
        stop = threading.Event()

        def keep_the_engine_busy():  # the engine looks at the machine between its steps
            with httpx.Client(timeout=600) as http:
                while not stop.is_set():
                    http.post(f"{server.base_url}/chat/completions", json={
                        "model": DEFAULT_MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]})

        worker = threading.Thread(target=keep_the_engine_busy)
        worker.start()
        try:
            wait_until(lambda: engine_threads(server) == 1, timeout=600)
            assert re.search(r"threads: 2 -> 1 \(other processes kept [\d.]+ of \d+ cores busy\)", server.log())
        finally:
            stop.set()
            for burner in burners:
                burner.kill()
                burner.wait()
            worker.join()


@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_answers_do_not_depend_on_the_thread_count(tmp_path, gemma_path, which):
    args = ["--model", str(gemma_path)] if which == "gemma" else []
    prompts = ["Write a long story about cats.", "Explain how a bicycle works in detail. " * 30]
    answers = {}
    for threads in ("1", "2"):
        with run_server(*args, "--threads", threads, "--no-adapt-threads", log_dir=tmp_path) as server:
            model = httpx.get(f"{server.base_url}/models", timeout=60).json()["data"][0]["id"]
            answers[threads] = []
            for prompt in prompts:
                choice = httpx.post(f"{server.base_url}/chat/completions", timeout=600, json={
                    "model": model, "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 3,
                    "messages": [{"role": "user", "content": prompt}]}).json()["choices"][0]
                answers[threads].append([(t["token"], t["logprob"], [top["logprob"] for top in t["top_logprobs"]])
                                         for t in choice["logprobs"]["content"]])
    assert all(answers["1"]), answers
    assert answers["1"] == answers["2"]  # bit for bit, logprobs included
