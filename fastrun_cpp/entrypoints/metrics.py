"""Prometheus metrics of the server, on a registry of its own, served at /metrics."""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from fastrun_cpp.engine.stats import GRAMMAR_STEP_BUCKETS

disable_created_metrics()  # no `_created` series: they double the output and nobody graphs them

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
MAX_ACCOUNT_LABELS = 1000  # accounts named in per-account series; the rest are counted as "other"


class ServerMetrics:
    def __init__(self, engines: Callable[[], Iterable[tuple[str, object]]],
                 grammar_failures: Callable[[], tuple[dict[str, int], int]] = lambda: ({}, 0)) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fastrun_requests", "HTTP requests by route and status.", ["route", "status"], registry=r)
        self.request_seconds = Histogram(
            "fastrun_request_duration_seconds", "Time to serve a request, to its last byte.", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.errors = Counter("fastrun_errors", "Error responses and stream error events by type.", ["type"], registry=r)
        self.prompt_tokens = Counter("fastrun_prompt_tokens", "Prompt tokens of served requests.", ["model"], registry=r)
        self.cached_tokens = Counter(
            "fastrun_cached_prompt_tokens", "Prompt tokens served from the prefix caches.", ["model"], registry=r
        )
        self.generation_tokens = Counter("fastrun_generation_tokens", "Generated tokens.", ["model"], registry=r)
        self.ttft = Histogram(
            "fastrun_time_to_first_token_seconds", "From arrival to the first generated token.", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.inter_token = Histogram(
            "fastrun_inter_token_latency_seconds", "Gap between consecutive generated tokens.", ["model"],
            buckets=TOKEN_GAP_BUCKETS, registry=r,
        )
        # Per account (keys on; /metrics then needs an admin key): what each tenant used.
        self.account_requests = Counter("fastrun_account_requests", "Requests served per account.", ["account"],
                                        registry=r)
        self.account_tokens = Counter("fastrun_account_tokens", "Tokens per account: prompt, cached (of the prompt) "
                                      "and completion.", ["account", "kind"], registry=r)
        self._accounts: set[str] = set()
        r.register(_EngineCollector(engines, grammar_failures))

    def count_account(self, account: str, prompt: int, cached: int, completion: int) -> None:
        if account not in self._accounts and len(self._accounts) >= MAX_ACCOUNT_LABELS:
            account = "other"
        else:
            self._accounts.add(account)
        self.account_requests.labels(account).inc()
        for kind, tokens in (("prompt", prompt), ("cached", cached), ("completion", completion)):
            self.account_tokens.labels(account, kind).inc(tokens)


class _EngineCollector(Collector):
    """Engine state read at scrape time: slots, queue and prefix-cache counters."""

    def __init__(self, engines: Callable[[], Iterable[tuple[str, object]]],
                 grammar_failures: Callable[[], tuple[dict[str, int], int]]) -> None:
        self._engines = engines
        self._grammar_failures = grammar_failures  # ({model: (compiles stuck, killed)}, conversions killed)

    def collect(self):
        slots = GaugeMetricFamily("fastrun_slots", "Parallel slots of the model's engine.", labels=["model"])
        busy = GaugeMetricFamily("fastrun_busy_slots", "Slots serving a request now.", labels=["model"])
        queue = GaugeMetricFamily("fastrun_queue_depth", "Requests waiting for a slot.", labels=["model"])
        hits = CounterMetricFamily(
            "fastrun_prompt_cache_lookups", "Prefix-cache lookups by outcome (slot, host, miss).",
            labels=["model", "outcome"],
        )
        disk_bytes = GaugeMetricFamily("fastrun_prompt_cache_disk_bytes", "Bytes of the disk prompt cache.",
                                       labels=["model"])
        disk_events = CounterMetricFamily(
            "fastrun_prompt_cache_disk", "Disk prompt-cache events (hit, miss, write, dropped write, eviction, skipped file).",
            labels=["model", "event"],
        )
        # Per replica, what Kubernetes inference gateways score on (vLLM's vllm:num_requests_running,
        # vllm:num_requests_waiting and vllm:kv_cache_usage_perc).
        running = GaugeMetricFamily("fastrun_num_requests_running", "Requests decoding on a replica.",
                                    labels=["model", "replica"])
        waiting_gauge = GaugeMetricFamily("fastrun_num_requests_waiting", "Requests waiting for a slot on a replica.",
                                          labels=["model", "replica"])
        kv = GaugeMetricFamily("fastrun_kv_cache_usage_ratio", "Share of a replica's KV cache its requests hold (0-1).",
                               labels=["model", "replica"])
        decoded = CounterMetricFamily(
            "fastrun_engine_generated_tokens", "Tokens the engines generated, with those of choices stopped early "
            "or abandoned by their client (fastrun_generation_tokens counts what was served).", labels=["model"])
        step_time = CounterMetricFamily(
            "fastrun_engine_step_seconds", "Wall time of the engines' decode steps: inside llama_decode, and the "
            "host's own work around it (batch building, sampling, grammars, detokenizing).", labels=["model", "part"])
        preempted = CounterMetricFamily(
            "fastrun_engine_preemptions", "Running choices paused to host RAM for a more urgent request or an "
            "account under its fair share (each resumes where it stopped).", labels=["model"])
        drafted = CounterMetricFamily("fastrun_spec_draft_tokens", "Speculative draft tokens verified, and accepted.",
                                      labels=["model", "outcome"])
        grammar = HistogramMetricFamily(
            "fastrun_grammar_step_seconds", "CPU time a grammar took for one constrained token (check, mask, accept).",
            labels=["model"])
        threads = GaugeMetricFamily(
            "fastrun_engine_threads", "CPU threads the model's engines run llama.cpp with now: fewer than --threads "
            "while other processes keep the cores busy.", labels=["model"])
        for model_id, engine in self._engines():
            for replica in engine.replica_status():
                running.add_metric([model_id, replica["replica"]], replica["busy_slots"])
                waiting_gauge.add_metric([model_id, replica["replica"]], replica["waiting"])
                kv.add_metric([model_id, replica["replica"]], replica["kv_usage"])
            busy_slots, waiting = engine.load()
            slots.add_metric([model_id], engine.slots)
            busy.add_metric([model_id], busy_slots)
            queue.add_metric([model_id], waiting)
            stats = engine.stats
            hits.add_metric([model_id, "slot"], stats.slot_hits)
            hits.add_metric([model_id, "host"], stats.host_hits)
            hits.add_metric([model_id, "disk"], stats.disk_hits)
            hits.add_metric([model_id, "miss"], stats.misses)
            decoded.add_metric([model_id], stats.generated_tokens)
            preempted.add_metric([model_id], stats.preemptions)
            threads.add_metric([model_id], stats.threads)
            step_time.add_metric([model_id, "llama_decode"], stats.decode_seconds)
            step_time.add_metric([model_id, "host"], max(0.0, stats.step_seconds - stats.decode_seconds))
            drafted.add_metric([model_id, "drafted"], stats.drafted_tokens)
            drafted.add_metric([model_id, "accepted"], stats.accepted_tokens)
            steps = stats.grammar_steps
            cumulative = list(itertools.accumulate(steps.counts))
            grammar.add_metric([model_id], [(repr(le), count) for le, count in zip(GRAMMAR_STEP_BUCKETS, cumulative)]
                               + [("+Inf", cumulative[-1])], steps.total)
            disk = engine.disk_stats
            if disk is not None:
                disk_bytes.add_metric([model_id], disk.bytes)
                for event, value in (("hit", disk.hits), ("miss", disk.misses), ("write", disk.writes),
                                     ("dropped", disk.dropped), ("eviction", disk.evictions),
                                     ("skipped", disk.skipped)):
                    disk_events.add_metric([model_id, event], value)
        per_model, killed = self._grammar_failures()
        stuck = CounterMetricFamily("fastrun_grammar_compiles_stuck", "Grammar compilations abandoned at their time "
                                    "limit in a thread of the server (the thread is lost).", labels=["model"])
        trials_killed = CounterMetricFamily("fastrun_grammar_compiles_killed", "Grammar compilations killed at "
                                            "their time limit in their trial process.", labels=["model"])
        for model_id, (stuck_count, killed_count) in per_model.items():
            stuck.add_metric([model_id], stuck_count)
            trials_killed.add_metric([model_id], killed_count)
        conversions = CounterMetricFamily("fastrun_schema_conversions_killed",
                                          "Schema-to-grammar conversions killed at their time limit.")
        conversions.add_metric([], killed)
        yield from (slots, busy, queue, hits, disk_bytes, disk_events, running, waiting_gauge, kv, decoded, preempted,
                    step_time, drafted, grammar, threads, stuck, trials_killed, conversions)
