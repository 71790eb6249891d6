"""Turns at bounded work, taken round-robin by account: grammar compiles and schema
conversions run a few at a time, and when they queue, each account waiting gets the next
place in turn, so one tenant's hundred compiles delay another's by at most one of each. A job
whose caller is cancelled while it waits (its client went away) leaves the line and never runs."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from typing import AsyncIterator


class FairTurns:
    """At most `places` jobs at once; the rest wait in one line per account. Event-loop only."""

    def __init__(self, places: int) -> None:
        self._free = places
        self._lines: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()  # accounts in turn order

    @property
    def waiting(self) -> int:
        return sum(map(len, self._lines.values()))

    @asynccontextmanager
    async def turn(self, account: str) -> AsyncIterator[None]:
        if self._free > 0 and not self._lines:
            self._free -= 1
        else:
            place = asyncio.get_running_loop().create_future()
            self._lines.setdefault(account, deque()).append(place)
            try:
                await place
            except asyncio.CancelledError:
                if place.done() and not place.cancelled():  # the place came as the caller left: pass it on
                    self._hand_on()
                else:
                    self._leave(account, place)
                raise
        try:
            yield
        finally:
            self._hand_on()

    def _leave(self, account: str, place: asyncio.Future) -> None:
        line = self._lines.get(account)
        if line is not None and place in line:
            line.remove(place)
            if not line:
                del self._lines[account]

    def _hand_on(self) -> None:
        """A place is free: to the next account in turn (which then goes to the back), else kept."""
        while self._lines:
            account, line = next(iter(self._lines.items()))
            place = line.popleft()
            if line:
                self._lines.move_to_end(account)
            else:
                del self._lines[account]
            if not place.done():
                place.set_result(None)
                return
        self._free += 1
