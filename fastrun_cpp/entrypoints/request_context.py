"""Per-request bookkeeping shared by the middleware and the serving code: the request id,
what the access log and metrics report, and the engine streams to close when it ends."""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable

from fastrun_cpp.entrypoints.tenancy import Ticket
from fastrun_cpp.runtime import EngineStream


# A request this process sends itself (a batch line) carries, in its ASGI scope, the key it runs
# as (the one that created the batch): no client can put anything into a scope.
SENT_AS_KEY = "fastrun.sent_as_key"


@dataclass
class RequestRecord:
    request_id: str
    started: float = field(default_factory=time.perf_counter)
    model: str | None = None
    account: str | None = None
    cache_namespace: str = ""  # whose cached prompts it may reuse ("": open mode, one namespace)
    weight: float = 1.0  # the account's share of the slots
    min_priority: int | None = None  # the most urgent priority the key may ask for (None: any)
    key_id: int | None = None  # the key it came with (None: a server without keys)
    # May change what every account is served (load a model no registry lists, shorten a model's
    # keep_alive): an admin key, or the one user of open loopback mode (as Ollama's).
    admin: bool = True
    bulk: bool = False  # a batch line: runs behind every interactive request
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding: drafts verified
    accepted_tokens: int = 0  # and accepted
    ttft_s: float | None = None
    error_type: str | None = None  # also set for errors sent inside a started stream
    replica: str | None = None  # the engine replica that served it
    streams: list[EngineStream] = field(default_factory=list)
    ticket: Ticket | None = None  # the account's rate limits, when it has any
    leases: dict[str, Callable[[], None]] = field(default_factory=dict)  # model id -> its release

    def hold(self, model_id: str, release: Callable[[], None]) -> bool:
        """Keep a model's lease until the request ends; False if it holds one already."""
        if model_id in self.leases:
            return False
        self.leases[model_id] = release
        return True

    def reserve(self, tokens: int) -> None:
        """Hold `tokens` of the account's tokens per minute before work is queued (raises
        tenancy.LimitReached)."""
        if self.ticket is not None:
            self.ticket.reserve(tokens)

    def track(self, stream: EngineStream) -> None:
        self.streams.append(stream)
        self.replica = stream.replica

    def release(self) -> None:
        """Abort whatever generation this request left running (a client gone, a crash), and
        let go of the models it used."""
        streams, self.streams = self.streams, []  # nothing kept alive by a record that outlives its request
        for stream in streams:
            stream.close()
        leases, self.leases = self.leases, {}
        for release in leases.values():
            release()


_current: ContextVar[RequestRecord | None] = ContextVar("fastrun_request", default=None)


def current_record() -> RequestRecord | None:
    return _current.get()


def set_current_record(record: RequestRecord) -> None:
    _current.set(record)
