"""What an engine counts and measures, read by /metrics, /health and the pool."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

GRAMMAR_STEP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)


@dataclass
class TimeHistogram:
    """Counts of durations (s) at or under each of GRAMMAR_STEP_BUCKETS (last: over them all),
    and their sum; adds up across replicas like the counters beside it."""

    counts: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(GRAMMAR_STEP_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(GRAMMAR_STEP_BUCKETS, seconds)] += 1
        self.total += seconds

    def __add__(self, other: TimeHistogram) -> TimeHistogram:
        return TimeHistogram([a + b for a, b in zip(self.counts, other.counts)], self.total + other.total)


@dataclass
class EngineStats:
    """Counters since start; read from other threads without locking (approximate is fine)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not evaluated, from either cache
    slot_hits: int = 0  # requests that reused a prefix left in their slot
    host_hits: int = 0  # requests that restored a prefix from the host-RAM cache
    misses: int = 0
    disk_hits: int = 0  # requests that restored a prefix loaded from the disk tier
    host_saves: int = 0
    host_evictions: int = 0
    generated_tokens: int = 0
    decode_failures: int = 0
    preemptions: int = 0  # running choices paused to host RAM for a more urgent or fairer one
    drafted_tokens: int = 0  # speculative drafts verified
    accepted_tokens: int = 0  # of which accepted
    steps: int = 0
    step_seconds: float = 0.0  # whole scheduler steps
    decode_seconds: float = 0.0  # of which inside llama_decode (the rest is Python and sampling)
    threads: int = 0  # llama.cpp runs with now (fewer than configured while other processes load the cores)
    thread_changes: int = 0
    adapter_switches: int = 0  # steps that changed the context's LoRA set
    grammar_steps: TimeHistogram = dataclasses.field(default_factory=TimeHistogram)  # grammar CPU time per token


class ThroughputMeter:
    """Exponentially weighted tokens/s of recent decode steps and tokens per answer."""

    def __init__(self, weight: float = 0.1) -> None:
        self._weight = weight
        self.tokens_per_s = 0.0
        self.tokens_per_answer = 64.0  # a prior until answers have been seen

    def step(self, tokens: int, seconds: float) -> None:
        if tokens and seconds > 0:
            rate = tokens / seconds
            self.tokens_per_s = rate if self.tokens_per_s == 0 else (
                self.tokens_per_s + self._weight * (rate - self.tokens_per_s))

    def answer(self, tokens: int) -> None:
        self.tokens_per_answer += self._weight * (tokens - self.tokens_per_answer)
