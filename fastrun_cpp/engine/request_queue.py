"""The requests waiting for slots, and the order they get them in: a policy behind one
interface, so the scheduler admits from a FIFO or from fair shares of accounts by priority
alike, and asks the same policy which running sequence to preempt for a waiting one."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Protocol

from fastrun_cpp.engine.request import GenerationRequest

if TYPE_CHECKING:
    import numpy as np

    from fastrun_cpp.engine.grammar import CompiledGrammar
    from fastrun_cpp.engine.slot import RunningChoice, Slot


@dataclass(eq=False)
class Paused:
    """A preempted choice: its sequence's KV (in host RAM) and the choice itself, to resume in
    any free slot exactly where it stopped."""

    state: np.ndarray
    tokens: list[int]
    namespace: str
    choice: RunningChoice


def fair_share(places: int, weight: float, weights: Iterable[float]) -> float:
    """An account's fair part of `places`: by its weight among those of the accounts with work."""
    return places * weight / sum(weights)


@dataclass(eq=False)
class WaitingRequest:
    """A queued request and the choices of it not started yet. Its choices run in waves, each
    on the slots free when it starts: the first evaluates the prompt once for all of its
    choices, later ones find the prompt's KV in the cache. A preempted choice waits as a
    request of its own, `paused`."""

    request: GenerationRequest
    grammar: CompiledGrammar | None
    pending: list[int]  # choice indices, in order
    started: bool = False
    paused: Paused | None = None


class RequestQueue(Protocol):
    def push(self, item: WaitingRequest) -> None:
        """A request arrives."""

    def requeue(self, item: WaitingRequest) -> None:
        """A request whose last wave started with choices still to run, or a preempted choice."""

    def peek(self) -> WaitingRequest | None:
        """The request to admit next (None: none waits)."""

    def pop(self) -> WaitingRequest:
        """Take the request `peek` named."""

    def remove(self, item: WaitingRequest) -> None: ...

    def clear(self) -> None: ...

    def charge(self, request: GenerationRequest, tokens: int) -> None:
        """`tokens` of the request's were evaluated (its account's service)."""

    def victim(self, item: WaitingRequest, running: list[Slot]) -> Slot | None:
        """A running slot to preempt so that `item` starts now, if the policy says it should."""

    def rank(self, request: GenerationRequest) -> tuple[float, ...]:
        """Where the policy puts a request that needs no slot (an embedding job) among others:
        the lowest goes first; ties keep their order of arrival."""

    def __iter__(self) -> Iterator[WaitingRequest]: ...

    def __len__(self) -> int: ...


class FifoQueue:
    """First come, first served, never preempting; a request's later wave goes to the back, so
    one request's many choices take turns with the requests behind it."""

    def __init__(self) -> None:
        self._items: deque[WaitingRequest] = deque()

    def push(self, item: WaitingRequest) -> None:
        self._items.append(item)

    def requeue(self, item: WaitingRequest) -> None:
        if item.paused is not None:
            self._items.appendleft(item)
        else:
            self._items.append(item)

    def peek(self) -> WaitingRequest | None:
        return self._items[0] if self._items else None

    def pop(self) -> WaitingRequest:
        return self._items.popleft()

    def remove(self, item: WaitingRequest) -> None:
        self._items.remove(item)

    def clear(self) -> None:
        self._items.clear()

    def charge(self, request: GenerationRequest, tokens: int) -> None:
        pass

    def victim(self, item: WaitingRequest, running: list[Slot]) -> Slot | None:
        return None

    def rank(self, request: GenerationRequest) -> tuple[float, ...]:
        return ()

    def __iter__(self) -> Iterator[WaitingRequest]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)


class FairShareQueue:
    """Priorities first, then fair shares of accounts.

    The most urgent priority waiting (lowest value) goes first. Among requests of one priority,
    accounts take turns by the tokens they have been served, divided by their weight (weighted
    fair queuing by tokens): the account served least goes next, and its requests in the order
    they came. An account that starts waiting starts one token behind the least served account
    waiting, so time spent idle banks no credit. One account alone gets exactly FIFO.

    It preempts a running sequence for a waiting request of a more urgent priority, or for an
    account holding fewer slots than its share (slots x its weight / the weights of every
    account with work) while another holds more than its own.
    """

    MAX_REMEMBERED = 4096  # accounts whose service is kept while they have nothing waiting

    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._waiting: dict[tuple[int, str], deque[WaitingRequest]] = {}  # (priority, account) -> requests
        self._served: dict[str, float] = {}  # weighted tokens served, by account
        self._weights: dict[str, float] = {}
        self._arrival = 0
        self._arrived: dict[int, int] = {}  # id(item) -> arrival order, for ties

    # ------------------------------------------------------------------ queue

    def push(self, item: WaitingRequest) -> None:
        self._enqueue(item, front=False)

    def requeue(self, item: WaitingRequest) -> None:
        self._enqueue(item, front=item.paused is not None)  # a preempted choice resumes first

    def _enqueue(self, item: WaitingRequest, *, front: bool) -> None:
        request = item.request
        account = request.account
        self._weights[account] = max(request.weight, 1e-3)
        if not any(key[1] == account for key in self._waiting):
            # One token behind the least served account waiting: it goes next, but idling
            # banks it no credit.
            floor = min((self._served.get(key[1], 0.0) for key in self._waiting), default=None)
            if floor is not None:
                self._served[account] = max(self._served.get(account, 0.0), floor - 1)
        queue = self._waiting.setdefault((request.priority, account), deque())
        self._arrival += 1
        self._arrived[id(item)] = self._arrival if not front else -self._arrival
        if front:
            queue.appendleft(item)
        else:
            queue.append(item)

    def _next_key(self) -> tuple[int, str] | None:
        if not self._waiting:
            return None
        priority = min(key[0] for key in self._waiting)
        return min((key for key in self._waiting if key[0] == priority),
                   key=lambda key: (self._served.get(key[1], 0.0), self._arrived[id(self._waiting[key][0])]))

    def peek(self) -> WaitingRequest | None:
        key = self._next_key()
        return None if key is None else self._waiting[key][0]

    def pop(self) -> WaitingRequest:
        key = self._next_key()
        assert key is not None
        item = self._waiting[key].popleft()
        self._forget(key, item)
        return item

    def remove(self, item: WaitingRequest) -> None:
        key = (item.request.priority, item.request.account)
        self._waiting[key].remove(item)
        self._forget(key, item)

    def _forget(self, key: tuple[int, str], item: WaitingRequest) -> None:
        self._arrived.pop(id(item), None)
        if not self._waiting[key]:
            del self._waiting[key]
        if len(self._served) > self.MAX_REMEMBERED:
            waiting = {account for _, account in self._waiting}
            for account in [a for a in self._served if a not in waiting]:
                del self._served[account]
                self._weights.pop(account, None)

    def clear(self) -> None:
        self._waiting.clear()
        self._arrived.clear()

    def rank(self, request: GenerationRequest) -> tuple[float, ...]:
        account = request.account
        return (request.priority, self._served.get(account, 0.0))

    def charge(self, request: GenerationRequest, tokens: int) -> None:
        account = request.account
        self._served[account] = self._served.get(account, 0.0) + tokens / self._weights.get(account, request.weight)

    def __iter__(self) -> Iterator[WaitingRequest]:
        return iter([item for queue in list(self._waiting.values()) for item in queue])

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    # ------------------------------------------------------------------ preemption

    def victim(self, item: WaitingRequest, running: list[Slot]) -> Slot | None:
        candidates = [slot for slot in running if slot.is_decoding and not slot.choice.followers]
        if not candidates:
            return None
        request = item.request
        # A more urgent request takes the least urgent sequence's slot, the newest of them.
        least_urgent = max(slot.request.priority for slot in candidates)
        if least_urgent > request.priority:
            return max((slot for slot in candidates if slot.request.priority == least_urgent),
                       key=lambda slot: slot.choice.admitted_at)
        # Fair shares, among sequences of this request's priority.
        peers = [slot for slot in running if slot.request.priority == request.priority]
        held = Counter(slot.request.account for slot in peers)
        accounts = set(held) | {key[1] for key in self._waiting if key[0] == request.priority} | {request.account}
        weights = [self._weights.get(account, 1.0) for account in accounts]

        def share(account: str) -> float:
            return fair_share(self._slots, self._weights.get(account, 1.0), weights)

        if held[request.account] + 1 > share(request.account):
            return None
        over = [account for account in held if held[account] > share(account)]
        if not over:
            return None
        account = max(over, key=lambda a: held[a] / share(a))
        choices = [slot for slot in candidates if slot.request.account == account
                   and slot.request.priority == request.priority]
        return max(choices, key=lambda slot: slot.choice.admitted_at) if choices else None
