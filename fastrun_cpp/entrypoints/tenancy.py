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
        self.in_flight = 0

    def expire(self, now: float) -> None:
        while self.starts and self.starts[0] <= now - WINDOW_S:
            self.starts.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]

    @property
    def idle(self) -> bool:
        return not (self.starts or self.tokens or self.in_flight)


class AccountGate:
    """Checks an account's limits as a request comes in; `finish` when it ends. The windows are
    the last 60 s, sliding. Event-loop only (no locking)."""

    def __init__(self) -> None:
        self._windows: dict[str, _AccountWindow] = {}

    def admit(self, key: ActiveKey) -> None:
        """Count the request in, or raise LimitReached naming the limit."""
        limits = key.limits
        if limits.rpm is None and limits.tpm is None and limits.max_concurrent is None:
            return
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
        if limits.tpm is not None and window.token_sum >= limits.tpm:
            wait, excess = WINDOW_S, window.token_sum - limits.tpm
            for finished, tokens in window.tokens:  # until enough tokens leave the window
                excess -= tokens
                if excess < 0:
                    wait = finished + WINDOW_S - now
                    break
            raise LimitReached(f"this account may use {limits.tpm} tokens per minute (its tpm limit)",
                               max(1, math.ceil(wait)))
        window.starts.append(now)
        window.in_flight += 1

    def finish(self, key: ActiveKey, tokens: int) -> None:
        window = self._windows.get(key.account)
        if window is None:
            return
        now = time.monotonic()
        window.in_flight = max(0, window.in_flight - 1)
        if tokens:
            window.tokens.append((now, tokens))
            window.token_sum += tokens
        window.expire(now)
        if window.idle:
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

    def count(self, account: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        hour = int(time.time()) // 3600 * 3600
        with self._lock:
            self._pending.setdefault((account, hour), Usage()).add(
                Usage(1, prompt_tokens, cached_tokens, completion_tokens))

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
