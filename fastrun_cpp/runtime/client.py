"""What serving code needs of a model's engines, wherever they run: in this process
(engine.pool.EnginePool) or on a Ray Serve cluster (runtime.ray_backend.RayEngineClient)."""

from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from fastrun_cpp.engine.disk_cache import DiskStats
from fastrun_cpp.engine.stats import EngineStats
from fastrun_cpp.engine.request import GenerationOutput, GenerationRequest


@runtime_checkable
class EngineStream(Protocol):
    """The outputs of one submitted request. Iteration ends after the output that finishes it
    and raises EngineError if the engine failed it; `close()` aborts it if still running."""

    request_id: str
    time_limit_s: float | None
    replica: str  # the replica serving it (X-Fastrun-Replica)

    @property
    def finished(self) -> bool: ...

    def set_deadline(self, seconds: float) -> None: ...

    def __aiter__(self) -> AsyncIterator[GenerationOutput]: ...

    async def __anext__(self) -> GenerationOutput: ...

    def close(self) -> None: ...

    def stop_choice(self, index: int) -> None:
        """End one choice (of n) now; the others go on."""


@runtime_checkable
class EngineClient(Protocol):
    """A model's engines as one: submit requests, read load and counters, shut down."""

    @property
    def slots(self) -> int:
        """Slots over all replicas."""

    @property
    def replicas(self) -> int: ...

    @property
    def stats(self) -> EngineStats:
        """Counters summed over the replicas."""

    @property
    def disk_stats(self) -> DiskStats | None:
        """The disk tier of the prompt cache, when there is one."""

    async def submit(self, request: GenerationRequest) -> EngineStream:
        """Queue a request; raises CapacityError when every replica is full, PromptTooLongError,
        GrammarError, or EngineError when none can serve."""

    def load(self) -> tuple[int, int]:
        """(busy slots, waiting requests) over all replicas."""

    def replica_status(self) -> list[dict[str, object]]:
        """Per replica: busy slots, waiting requests, whether it is serving."""

    async def shutdown(self) -> None: ...
