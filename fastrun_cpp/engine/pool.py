"""A pool of engine replicas serving one model (one per GPU, several per GPU, or several on
the CPU): among the replicas with a free slot (all of them if none has one), requests go to the
one that already holds the longest prefix of their prompt, else to the least loaded; a replica
that fails is taken out for a while and what it failed is retried on another."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from fastrun_cpp.engine.async_engine import AsyncEngine, RequestStream
from fastrun_cpp.engine.disk_cache import DiskPromptCache, DiskStats
from fastrun_cpp.engine.stats import EngineStats
from fastrun_cpp.engine.errors import CapacityError, EngineError
from fastrun_cpp.engine.failover import FailoverStream
from fastrun_cpp.engine.request import GenerationRequest
from fastrun_cpp.engine.routing import ReplicaLoad, SessionMemory, rank_replicas

logger = logging.getLogger(__name__)

FAILED_REPLICA_COOLDOWN_S = 30.0


class _Replica:
    def __init__(self, index: int, engine: AsyncEngine) -> None:
        self.index = index
        self.engine = engine
        self.down_until = 0.0
        self.submitting = 0  # requests routed here and not queued yet (their grammar or disk prefix loads)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    def take_out(self) -> None:
        self.down_until = time.monotonic() + FAILED_REPLICA_COOLDOWN_S


class EnginePool:
    """The face of a model's engines; the serving layer sees the same interface as one
    AsyncEngine."""

    def __init__(self, engines: list[AsyncEngine], disk_cache: DiskPromptCache | None = None) -> None:
        if not engines:
            raise ValueError("a pool needs at least one engine")
        self._replicas = [_Replica(i, engine) for i, engine in enumerate(engines)]
        self.disk_cache = disk_cache  # shared by the replicas
        self._sessions = SessionMemory()

    # ------------------------------------------------------------------ what one engine offers

    @property
    def replicas(self) -> int:
        return len(self._replicas)

    @property
    def slots(self) -> int:
        return sum(r.engine.slots for r in self._replicas)

    @property
    def stats(self) -> EngineStats:
        total = EngineStats()
        for replica in self._replicas:
            for field in dataclasses.fields(EngineStats):
                setattr(total, field.name, getattr(total, field.name) + getattr(replica.engine.stats, field.name))
        return total

    @property
    def disk_stats(self) -> DiskStats | None:
        return self.disk_cache.stats if self.disk_cache is not None and self.disk_cache.enabled else None

    def load(self) -> tuple[int, int]:
        busy = waiting = 0
        for replica in self._replicas:
            b, w = replica.engine.load()
            busy, waiting = busy + b, waiting + w
        return busy, waiting

    def replica_status(self) -> list[dict[str, object]]:
        status = []
        for replica in self._replicas:
            busy, waiting = replica.engine.load()
            status.append({"replica": replica.engine.name, "busy_slots": busy, "waiting": waiting,
                           "kv_usage": round(replica.engine.engine.kv_usage(), 4), "healthy": replica.healthy})
        return status

    async def submit(self, request: GenerationRequest) -> FailoverStream:
        """Queue the request on the best replica; one that fails it before its first token is
        taken out for a while and the request moves to another (each replica tried once)."""
        return await FailoverStream.open(request, self._submit, retries=len(self._replicas) - 1,
                                         on_replica_failed=self._take_out)

    def _take_out(self, name: str) -> None:
        for replica in self._replicas:
            if replica.engine.name == name:
                replica.take_out()

    # What a Ray replica reports of the pool it runs (one engine there).

    def held_sequences(self) -> list[tuple[str, list[int]]]:
        return [sequence for replica in self._replicas for sequence in replica.engine.engine.kv_cache.held_sequences()]

    def retry_after_s(self) -> int:
        return min(replica.engine.engine.retry_after_s() for replica in self._replicas)

    def kv_usage(self) -> float:
        return round(sum(r.engine.engine.kv_usage() for r in self._replicas) / len(self._replicas), 4)

    @property
    def alive(self) -> bool:
        return any(replica.engine.engine.alive for replica in self._replicas)

    def shutdown_now(self) -> None:
        """shutdown(), blocking (a Ray replica's destructor)."""
        for replica in self._replicas:
            replica.engine.shutdown()
        if self.disk_cache is not None:
            self.disk_cache.close()

    async def shutdown(self) -> None:
        """Stop every replica (each keeps its slots' prefixes in the disk tier), then wait for
        the disk writes."""
        for replica in self._replicas:
            await asyncio.to_thread(replica.engine.shutdown)
        if self.disk_cache is not None:
            await asyncio.to_thread(self.disk_cache.close)

    # ------------------------------------------------------------------ routing

    async def _submit(self, request: GenerationRequest, exclude: frozenset[str]) -> RequestStream:
        candidates = [r for r in self._replicas if r.engine.name not in exclude and r.healthy]
        if not candidates:
            candidates = [r for r in self._replicas if r.engine.name not in exclude]  # all down: try anyway
        if not candidates:
            raise EngineError("no replica left to serve the request")
        ranked = self._ranked(candidates, request) if len(candidates) > 1 else candidates
        retry_after, over_share = None, True
        for replica in ranked:
            replica.submitting += 1
            try:
                stream = await replica.engine.submit(request)
                self._sessions.remember(request.cache_namespace, request.session, replica.index)
                return stream
            except CapacityError as exc:  # this one is full: the next may not be
                retry_after = exc.retry_after_s if retry_after is None else min(retry_after, exc.retry_after_s)
                over_share = over_share and exc.over_share
            finally:
                replica.submitting -= 1
        raise CapacityError(retry_after or 1, over_share=over_share)

    def _ranked(self, candidates: list[_Replica], request: GenerationRequest) -> list[_Replica]:
        """Best first, by what each holds of the prompt, the conversation it served last, and
        its load (routing.rank_replicas)."""
        last = self._sessions.replica(request.cache_namespace, request.session)
        loads = []
        for replica in candidates:
            engine = replica.engine.engine
            running, waiting = engine.load()
            loads.append(ReplicaLoad(replica.index, engine.kv_cache.cached_prefix(request.prompt_tokens,
                                                                                 request.cache_namespace),
                                     running, waiting + replica.submitting, engine.config.slots,
                                     session=replica.index == last))
        by_index = {replica.index: replica for replica in candidates}
        return [by_index[index] for index in rank_replicas(loads)]
