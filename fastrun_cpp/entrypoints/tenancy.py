"""Per-account limits on what enters the server (requests and tokens per minute, requests in
flight), and per-account usage kept in the key store across restarts."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque

from fastrun_cpp.auth import ActiveKey, KeyStore, KeyStoreError, Usage

logger = logging.getLogger(__name__)

WINDOW_S = 60.0


# Work the server owns (batch lines, background responses) that is refused for now is sent again
# later: 429 (the server or its account full) and 503 (its model loading, or failing to load),
# after Retry-After or a wait that starts here and doubles up to the second figure. A 504 is
# final: the request ran, and was billed, to its timeout.
RETRIED_STATUSES = frozenset({429, 503})
RETRY_S = (1.0, 30.0)


class AccountAtCap(Exception):
    """The account already has as many of a kind of stored work running (batches, background
    responses) as it may: raised by a store inside the transaction that would add one more."""


class LimitReached(Exception):
    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class _AccountWindow:
    def __init__(self) -> None:
        self.starts: deque[float] = deque()  # request start times in the last window
        self.tokens: deque[tuple[float, int]] = deque()  # (finish time, tokens) in the last window
        self.token_sum = 0
        self.reserved = 0  # tokens the requests in flight may still use (prompt + max_tokens)
        self.in_flight = 0

    def expire(self, now: float) -> None:
        while self.starts and self.starts[0] <= now - WINDOW_S:
            self.starts.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]

    @property
    def committed(self) -> int:
        """Tokens used in the window plus those reserved by requests in flight."""
        return self.token_sum + self.reserved

    def tokens_free_in(self, now: float, needed: int, limit: int) -> float:
        """Seconds until `needed` more tokens fit the limit, as finished ones leave the window."""
        excess = self.committed + needed - limit
        for finished, tokens in self.tokens:
            excess -= tokens
            if excess <= 0:
                return finished + WINDOW_S - now
        return WINDOW_S

    @property
    def idle(self) -> bool:
        return not (self.starts or self.tokens or self.in_flight)


class Ticket:
    """An admitted request's place in its account's limits: `reserve` the tokens it may use
    before its work is queued, `finish` with the tokens it used."""

    def __init__(self, gate: AccountGate, key: ActiveKey, window: _AccountWindow) -> None:
        self._gate = gate
        self._key = key
        self._window = window
        self._reserved = 0
        self._finished = False

    def reserve(self, tokens: int) -> None:
        """Hold `tokens` of the account's tpm, or raise LimitReached. An account with nothing
        used or reserved gets any one request in (a request larger than the limit would
        otherwise never run); after that, what is in flight counts as spent."""
        limit = self._key.limits.tpm
        if limit is None or self._finished:
            return
        window = self._window
        now = time.monotonic()
        window.expire(now)
        if window.committed and window.committed + tokens > limit:
            raise LimitReached(f"this account may use {limit} tokens per minute (its tpm limit); this request may "
                               f"use up to {tokens}, and {window.committed} are used or reserved",
                               max(1, math.ceil(window.tokens_free_in(now, tokens, limit))))
        window.reserved += tokens
        self._reserved += tokens

    def finish(self, used: int) -> None:
        if self._finished:
            return
        self._finished = True
        self._window.reserved -= self._reserved
        self._gate._finish(self._key, self._window, used)


class AccountGate:
    """Checks an account's limits as a request comes in (`admit`), holds its tokens as it is
    queued (`Ticket.reserve`) and counts what it used when it ends (`Ticket.finish`). The windows
    are the last 60 s, sliding. Event-loop only (no locking)."""

    def __init__(self) -> None:
        self._windows: dict[str, _AccountWindow] = {}

    def admit(self, key: ActiveKey) -> Ticket | None:
        """Count the request in (its ticket; None when the account has no limits), or raise
        LimitReached naming the limit."""
        limits = key.limits
        if limits.rpm is None and limits.tpm is None and limits.max_concurrent is None:
            return None
        now = time.monotonic()
        window = self._windows.setdefault(key.account, _AccountWindow())
        window.expire(now)
        if limits.max_concurrent is not None and window.in_flight >= limits.max_concurrent:
            raise LimitReached(f"this account may have {limits.max_concurrent} requests in flight at once "
                               "(its max_concurrent limit)", 1)
        if limits.rpm is not None and len(window.starts) >= limits.rpm:
            wait = window.starts[len(window.starts) - limits.rpm] + WINDOW_S - now
            raise LimitReached(f"this account may send {limits.rpm} requests per minute (its rpm limit)",
                               max(1, math.ceil(wait)))
        if limits.tpm is not None and window.committed >= limits.tpm:
            raise LimitReached(f"this account may use {limits.tpm} tokens per minute (its tpm limit)",
                               max(1, math.ceil(window.tokens_free_in(now, 1, limits.tpm))))
        window.starts.append(now)
        window.in_flight += 1
        return Ticket(self, key, window)

    def _finish(self, key: ActiveKey, window: _AccountWindow, tokens: int) -> None:
        now = time.monotonic()
        window.in_flight = max(0, window.in_flight - 1)
        if tokens:
            window.tokens.append((now, tokens))
            window.token_sum += tokens
        window.expire(now)
        if window.idle and self._windows.get(key.account) is window:
            del self._windows[key.account]


class UsageRecorder:
    """Counts usage per account and hour in memory, and adds it to the key store every
    `flush_s` seconds from a thread of its own (and at close), so no request waits for SQLite."""

    def __init__(self, store: KeyStore, flush_s: float = 5.0) -> None:
        self._store = store
        self._flush_s = flush_s
        self._pending: dict[tuple[str, int], Usage] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastrun-usage", daemon=True)
        self._thread.start()

    def count(self, account: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int, *,
              batch: bool = False) -> None:
        hour = int(time.time()) // 3600 * 3600
        used = Usage(1, prompt_tokens, cached_tokens, completion_tokens)
        if batch:
            used.batch_requests, used.batch_prompt_tokens, used.batch_completion_tokens = 1, prompt_tokens, \
                completion_tokens
        with self._lock:
            self._pending.setdefault((account, hour), Usage()).add(used)

    def by_account(self, since: int) -> dict[str, Usage]:
        """Usage by account from the hour holding `since` on: what the store holds and what is
        counted but not yet written to it (a blocking read: call it off the event loop)."""
        totals = self._store.usage(since=since)
        with self._lock:
            pending = [(account, usage) for (account, hour), usage in self._pending.items()
                       if hour >= since - since % 3600]
        for account, usage in pending:
            totals.setdefault(account, Usage()).add(usage)
        return totals

    def _run(self) -> None:
        while not self._stop.wait(self._flush_s):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            self._store.add_usage(pending)
        except KeyStoreError as exc:  # kept for the next try
            logger.warning("usage could not be written to the key store: %s", exc)
            with self._lock:
                for key, usage in pending.items():
                    self._pending.setdefault(key, Usage()).add(usage)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.flush()
