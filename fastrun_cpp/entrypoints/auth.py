"""Bearer-key authentication of every /v1 request, against a hot-reloaded key snapshot."""

from __future__ import annotations

import asyncio
import hmac
from concurrent.futures import ThreadPoolExecutor
import ipaddress
import logging

from fastrun_cpp.auth import KEY_PATTERN, ActiveKey, KeySnapshot, KeyStore, KeyStoreError, hash_key

logger = logging.getLogger(__name__)

INVALID_KEY = "invalid or missing API key"
FOREIGN_HOST = ("this server has no API keys, so it serves loopback clients only, and this request names the "
                "host {host!r}; create a key (`fastrun-cpp keys create`) to serve other hosts")
NOT_APPROVED = "the account of this API key has not been approved yet"
STORE_UNAVAILABLE = "API keys cannot be checked right now"


class AuthError(Exception):
    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


def is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a Host header: without port, without IPv6 brackets, lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Authenticator:
    """Checks keys against a snapshot of the store, refreshed every `refresh_s` seconds so new
    and revoked keys take effect without a restart.

    With `allow_open` (loopback, or --no-auth) and no key in the store, requests pass without
    a key; once any key exists, every request needs one (unless `disabled`, i.e. --no-auth).
    """

    def __init__(self, store: KeyStore, *, allow_open: bool, disabled: bool, refresh_s: float) -> None:
        self.store = store
        self.allow_open = allow_open
        self.disabled = disabled
        self.refresh_s = refresh_s
        self._snapshot: KeySnapshot | None = None
        self._error: str | None = None
        self._task: asyncio.Task | None = None
        # A thread of its own: requests cannot use it up and leave keys unrefreshed.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="fastrun-keys")

    def load(self) -> None:
        """Read the store now (blocking); remembers the error if it is unreadable."""
        try:
            self._snapshot = self.store.snapshot()
            self._error = None
        except KeyStoreError as exc:
            if self._error is None:
                logger.error("%s", exc)
            self._error = str(exc)

    @property
    def store_is_empty(self) -> bool:
        """The store was read and holds no key at all."""
        return self._snapshot is not None and not self._snapshot.any_keys

    @property
    def is_open(self) -> bool:
        return self.disabled or (self.allow_open and self.store_is_empty)

    async def _load_off_loop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._reader, self.load)

    async def start(self) -> None:
        await self._load_off_loop()
        self._task = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self._load_off_loop()

    def key_by_id(self, key_id: int | None) -> ActiveKey | None:
        """The active key with this id, for work it left running (a batch); None when no key is
        needed. Raises AuthError once the key is revoked or its account unapproved."""
        if self.disabled:
            return None
        if self._error is not None or self._snapshot is None:
            raise AuthError(503, STORE_UNAVAILABLE)
        if self.is_open:
            return None
        if key_id is None:
            raise AuthError(401, "this work was created without a key, and keys are now required")
        for record in self._snapshot.active.values():
            if record.key_id == key_id:
                if not record.account_approved:
                    raise AuthError(401, NOT_APPROVED)
                return record
        raise AuthError(401, "the key that created this work has been revoked")

    def authenticate(self, authorization: str | None, host: str | None = None) -> ActiveKey | None:
        """The key's record, None when no key is needed; raises AuthError otherwise.

        Open (no keys, on loopback), the server answers only requests addressed to a loopback
        name or address: a web page that rebinds its own name to 127.0.0.1 (DNS rebinding)
        sends its own name as Host, and is refused."""
        if self.disabled:
            return None
        if self._error is not None or self._snapshot is None:
            raise AuthError(503, STORE_UNAVAILABLE)
        if self.is_open:
            if host is not None and not is_loopback(host_name(host)):
                raise AuthError(401, FOREIGN_HOST.format(host=host_name(host)[:100]))
            return None
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not KEY_PATTERN.fullmatch(key):
            raise AuthError(401, INVALID_KEY)
        presented = hash_key(key)
        record = self._snapshot.active.get(presented)
        # The dict finds the candidate by hash; the final comparison runs in constant time.
        if record is None or not hmac.compare_digest(record.key_hash, presented):
            raise AuthError(401, INVALID_KEY)
        if not record.account_approved:
            raise AuthError(401, NOT_APPROVED)
        return record
