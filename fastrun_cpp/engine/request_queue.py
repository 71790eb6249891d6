"""The requests waiting for slots, and the order they get them in: a policy behind one
interface, so the scheduler admits from a FIFO, a fair share of accounts, or by priority
alike."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol

from fastrun_cpp.engine.request import GenerationRequest

if TYPE_CHECKING:
    from fastrun_cpp.engine.grammar import CompiledGrammar


@dataclass(eq=False)
class WaitingRequest:
    """A queued request and the choices of it not started yet. A request with more choices
    than slots runs them in waves: the first takes as many slots as there are (the prompt is
    evaluated once for all of them), later ones start as slots free up and find the prompt's
    KV in the cache."""

    request: GenerationRequest
    grammar: CompiledGrammar | None
    pending: list[int]  # choice indices, in order
    started: bool = False


class RequestQueue(Protocol):
    def push(self, item: WaitingRequest) -> None:
        """A request arrives."""

    def requeue(self, item: WaitingRequest) -> None:
        """A request whose last wave started with choices still to run."""

    def peek(self) -> WaitingRequest | None:
        """The request to admit next (None: none waits)."""

    def pop(self) -> WaitingRequest:
        """Take the request `peek` named."""

    def remove(self, item: WaitingRequest) -> None: ...

    def clear(self) -> None: ...

    def __iter__(self) -> Iterator[WaitingRequest]: ...

    def __len__(self) -> int: ...


class FifoQueue:
    """First come, first served; a request's later wave goes to the back, so one request's many
    choices take turns with the requests behind it."""

    def __init__(self) -> None:
        self._items: deque[WaitingRequest] = deque()

    def push(self, item: WaitingRequest) -> None:
        self._items.append(item)

    def requeue(self, item: WaitingRequest) -> None:
        self._items.append(item)

    def peek(self) -> WaitingRequest | None:
        return self._items[0] if self._items else None

    def pop(self) -> WaitingRequest:
        return self._items.popleft()

    def remove(self, item: WaitingRequest) -> None:
        self._items.remove(item)

    def clear(self) -> None:
        self._items.clear()

    def __iter__(self) -> Iterator[WaitingRequest]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)
