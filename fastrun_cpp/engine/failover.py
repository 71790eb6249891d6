"""A request's stream as the serving layer sees it, whichever replica serves it and wherever
replicas run (the in-process pool, or Ray Serve): one deadline over all attempts, a failover
to another replica when one fails the request before its first token, and a choice stopped
early counted as the client received it."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol

from fastrun_cpp.engine.errors import EngineError, ReplicaGone, RequestRejected, RequestTimedOut
from fastrun_cpp.engine.request import GenerationOutput, GenerationRequest

logger = logging.getLogger(__name__)


class ReplicaStream(Protocol):
    """One replica's outputs for a request. `close()` aborts it there and makes a pending
    `__anext__` end (StopAsyncIteration)."""

    replica: str

    @property
    def finished(self) -> bool: ...

    async def __anext__(self) -> GenerationOutput: ...

    def close(self) -> None: ...

    def stop_choice(self, index: int) -> None: ...


# Submit a request to a replica not among `exclude` (replica names); raises CapacityError,
# EngineError, or ReplicaGone when the replica chosen went away first.
Submit = Callable[[GenerationRequest, frozenset[str]], Awaitable[ReplicaStream]]


class FailoverStream:
    """The EngineStream of a request (runtime.client): iterate its outputs, `close()` to abort."""

    def __init__(self, request: GenerationRequest, submit: Submit, *, retries: int,
                 on_replica_failed: Callable[[str], None] | None = None) -> None:
        self._request = request
        self._submit = submit
        self._retries_left = retries
        self._on_replica_failed = on_replica_failed
        self._inner: ReplicaStream | None = None
        self._tried: set[str] = set()
        self._tokens: dict[int, int] = {}  # choice -> tokens delivered (none yet: it may still fail over)
        self._stopped_at: dict[int, int] = {}  # choice -> tokens delivered when it was stopped
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False
        self._closed = False
        self.time_limit_s: float | None = None

    @classmethod
    async def open(cls, request: GenerationRequest, submit: Submit, *, retries: int,
                   on_replica_failed: Callable[[str], None] | None = None) -> FailoverStream:
        """Submit the request (to another replica if the first goes away before accepting it)."""
        stream = cls(request, submit, retries=retries, on_replica_failed=on_replica_failed)
        await stream._attach(None)
        return stream

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def replica(self) -> str:
        return self._inner.replica if self._inner is not None else "?"

    @property
    def finished(self) -> bool:
        return self._closed or (self._inner is not None and self._inner.finished)

    def set_deadline(self, seconds: float) -> None:
        """Abort the request, and end the stream with RequestTimedOut, `seconds` from now,
        whichever replica serves it by then."""
        self.time_limit_s = seconds
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def __aiter__(self) -> FailoverStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        while True:
            if self._timed_out:
                raise RequestTimedOut("the request ran past its time limit")
            try:
                output = await self._inner.__anext__()
            except (StopAsyncIteration, EngineError) as ended:
                if self._timed_out:  # the deadline closed the replica's stream
                    raise RequestTimedOut("the request ran past its time limit") from None
                if self._may_fail_over(ended):
                    await self._attach(ended)
                    continue
                self._end()
                raise
            self._count(output)
            return output

    def stop_choice(self, index: int) -> None:
        """End one choice now. Its usage counts the tokens delivered until now: the same
        whether the replica is in this process or across the network."""
        self._stopped_at.setdefault(index, self._tokens.get(index, 0))
        if self._inner is not None and not self.finished:
            self._inner.stop_choice(index)

    def close(self) -> None:
        if not self._closed:
            self._end()
            if self._inner is not None:
                self._inner.close()

    async def _attach(self, failure: EngineError | None) -> None:
        """Send the request to a replica; after `failure` of the current one, to another."""
        while True:
            if failure is not None:
                failed = self._inner.replica if self._inner is not None else None
                if failed is not None:
                    self._tried.add(failed)
                    if self._on_replica_failed is not None:
                        self._on_replica_failed(failed)
                logger.warning("replica %s failed %s before its first token (%s); trying another",
                               failed or "?", self.request_id, failure)
                self._retries_left -= 1
            try:
                self._inner = await self._submit(self._request, frozenset(self._tried))
            except ReplicaGone as gone:
                if self._retries_left <= 0:
                    raise EngineError(f"the replicas serving {self.request_id} went away") from gone
                self._inner, failure = None, gone
                continue
            except EngineError:
                if failure is None:
                    raise
                raise failure from None  # no other replica: the first failure is the news
            if self._timed_out:  # it expired while the request moved
                self._inner.close()
            return

    def _may_fail_over(self, ended: BaseException) -> bool:
        """A replica failing the request (not the request's own error) before its first token."""
        return (isinstance(ended, EngineError) and not isinstance(ended, RequestRejected) and not self._tokens
                and self._retries_left > 0 and not self._closed)

    def _count(self, output: GenerationOutput) -> None:
        if output.token_ids:
            self._tokens[output.index] = self._tokens.get(output.index, 0) + len(output.token_ids)
        if output.finished and output.index in self._stopped_at:
            output.completion_tokens = min(output.completion_tokens, self._stopped_at[output.index])

    def _expire(self) -> None:
        if not self._closed:
            self._timed_out = True
            self.close()

    def _end(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
