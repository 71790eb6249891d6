"""How many threads llama.cpp runs with while other processes share the cores.

ggml's threads meet at a barrier after every operation, hundreds of times per token. When
other processes keep the cores busy, a thread that reaches a barrier while its partner is
descheduled spins away its turn. On a 2-core machine beside two CPU-bound processes, SmolLM2
decoded at 6-14 tok/s with 2 threads and at 20-26 with 1 (78 and 45 idle). So the engine runs
with the cores the other processes leave it: never more than `--threads`, never fewer than
one, and back up as they go. Answers do not depend on the count (each dot product is summed by
one thread in one order; tests/test_threads.py checks it).

The other processes' load is what the cores this process may run on were busy with, less this
process's own CPU time, both read from the kernel (/proc/stat and the process clock)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# user nice system idle iowait irq softirq steal: the busy ones (guest time is inside user).
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def busy_seconds(cpus: frozenset[int], stat: str) -> float | None:
    """CPU seconds these cores have been busy since boot, from /proc/stat's text."""
    total, seen = 0, 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = rest.split()
        total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
        seen += 1
    return total / _TICKS_PER_SECOND if seen else None


def _read_stat() -> str | None:
    try:
        return PROC_STAT.read_text(encoding="ascii")
    except OSError:
        return None


class ThreadGovernor:
    """Polled by the scheduler thread before each step; says when the thread count should change.

    A change needs the same target at two polls in a row, `interval_s` apart, so a burst of
    another process's work does not flap the count."""

    def __init__(self, most: int, *, interval_s: float = 0.5, cpus: frozenset[int] | None = None,
                 read_stat: Callable[[], str | None] = _read_stat,
                 clock: Callable[[], float] = time.monotonic,
                 own_cpu: Callable[[], float] = time.process_time) -> None:
        self.most = most
        self.current = most
        self._interval_s = interval_s
        self._cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self._read_stat, self._clock, self._own_cpu = read_stat, clock, own_cpu
        self._last: tuple[float, float, float] | None = None  # (wall, busy, own) at the last poll
        self._proposed: int | None = None
        self._unavailable = False
        self.others_cores = 0.0  # what the other processes used, in cores, over the last interval

    def poll(self) -> int | None:
        """The new thread count when it should change now, else None."""
        if self.most <= 1 or self._unavailable:
            return None
        now = self._clock()
        if self._last is not None and now - self._last[0] < self._interval_s:
            return None
        stat = self._read_stat()
        busy = busy_seconds(self._cpus, stat) if stat is not None else None
        if busy is None:  # no /proc here: keep what was configured
            self._unavailable = True
            return None
        own = self._own_cpu()
        last, self._last = self._last, (now, busy, own)
        if last is None:
            return None
        wall = now - last[0]
        self.others_cores = max(0.0, (busy - last[1]) - (own - last[2])) / wall
        free = len(self._cpus) - self.others_cores
        target = max(1, min(self.most, int(free + 0.5)))
        if target == self.current:
            self._proposed = None
            return None
        if self._proposed != target:
            self._proposed = target
            return None
        self._proposed = None
        logger.info("threads: %d -> %d (other processes kept %.1f of %d cores busy)", self.current, target,
                    self.others_cores, len(self._cpus))
        self.current = target
        return target
