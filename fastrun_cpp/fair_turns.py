"""Turns at bounded work, shared fairly by account: grammar compiles, schema conversions and
image encodes run a few at a time, and when they queue, the place that frees goes to the
waiting account that has used the least time in its turns, divided by its weight (`keys weight`,
as on the slots). So a tenant's work counts in its share by what it costs, not by how many jobs
it sends: one tenant's hundred near-limit compiles
delay another's quick ones by at most the one each place is running, and the quick ones then go
ahead of the rest. An account that starts waiting starts level with the least-served account
present (neither owed for the time it was away nor charged for others' history); between equal
accounts, turns go round. A job whose caller is cancelled while it waits (its client went away)
leaves the line and never runs."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable


@dataclass(frozen=True)
class Share:
    """Whose turn a job takes: its account ("": open mode) and that account's weight."""

    account: str = ""
    weight: float = 1.0


class FairTurns:
    """At most `places` jobs at once; the rest wait in one line per account. Event-loop only."""

    def __init__(self, places: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._free = places
        self._clock = clock
        self._lines: dict[str, deque[asyncio.Future]] = {}  # the jobs waiting, by account
        # Of the accounts with a job waiting or running: seconds used in turns (divided by the
        # account's weight), turns held, and when each last got a place (turns go round between
        # accounts that used as much).
        self._used: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._last_place: dict[str, int] = {}
        self._places_given = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(map(len, self._lines.values()))

    @asynccontextmanager
    async def turn(self, share: Share) -> AsyncIterator[None]:
        account = share.account
        if account not in self._used:
            self._used[account] = min(self._used.values(), default=0.0)
            self._held[account] = 0
            self._last_place[account] = next(self._places_given)
        try:
            if self._free > 0 and not self._lines:
                self._free -= 1
                self._held[account] += 1
            else:  # waits for a place, which _hand_on counts as held as it gives it
                place = asyncio.get_running_loop().create_future()
                self._lines.setdefault(account, deque()).append(place)
                try:
                    await place
                except asyncio.CancelledError:
                    if place.done() and not place.cancelled():  # the place came as the caller left: pass it on
                        self._held[account] -= 1
                        self._hand_on()
                    else:
                        self._leave(account, place)
                    raise
            started = self._clock()
            try:
                yield
            finally:
                self._used[account] += (self._clock() - started) / share.weight
                self._held[account] -= 1
                self._hand_on()
        finally:
            if not self._held[account] and account not in self._lines:  # nothing of it left: forgotten
                del self._used[account], self._held[account], self._last_place[account]

    def _leave(self, account: str, place: asyncio.Future) -> None:
        line = self._lines.get(account)
        if line is not None and place in line:
            line.remove(place)
            if not line:
                del self._lines[account]

    def _hand_on(self) -> None:
        """A place is free: to the waiting account that used the least time, else kept."""
        while self._lines:
            account = min(self._lines, key=lambda name: (self._used[name], self._last_place[name]))
            line = self._lines[account]
            place = line.popleft()
            if not line:
                del self._lines[account]
            if not place.done():
                self._last_place[account] = next(self._places_given)
                self._held[account] += 1
                place.set_result(None)
                return
        self._free += 1
