"""The key store: accounts and their keys in an embedded SQLite database.

Keys are `fr_` plus 43 URL-safe characters (256 random bits from `secrets`). Only their
SHA-256 is stored: for a key that random, a fast unsalted hash is as strong as any KDF, and
lets the server find a key by its hash.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from fastrun_cpp.private import create_private

KEY_PREFIX = "fr_"
KEY_PATTERN = re.compile(r"fr_[A-Za-z0-9_-]{32,128}")
_DISPLAY_PREFIX = 7  # "fr_" and 4 characters: enough to tell keys apart in a listing

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (
    name TEXT PRIMARY KEY,
    approved INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    admin INTEGER NOT NULL DEFAULT 0,
    cache_group TEXT,
    weight REAL NOT NULL DEFAULT 1,
    min_priority INTEGER NOT NULL DEFAULT 0,
    rpm INTEGER,
    tpm INTEGER,
    max_concurrent INTEGER
);
CREATE TABLE IF NOT EXISTS usage (
    account TEXT NOT NULL,
    hour INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    PRIMARY KEY (account, hour)
);
CREATE TABLE IF NOT EXISTS keys (
    id INTEGER PRIMARY KEY,
    account TEXT NOT NULL REFERENCES accounts(name),
    key_hash TEXT NOT NULL UNIQUE,
    display_prefix TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);
"""
# Columns added since the first schema: (table, column, definition), added to older stores.
_ADDED_COLUMNS = (
    ("accounts", "admin", "INTEGER NOT NULL DEFAULT 0"),  # may read /metrics
    ("accounts", "cache_group", "TEXT"),  # shares prompt caches with the accounts of this group
    ("accounts", "weight", "REAL NOT NULL DEFAULT 1"),  # its share of the slots against other accounts'
    ("accounts", "min_priority", "INTEGER NOT NULL DEFAULT 0"),  # the most urgent priority it may ask for
    ("accounts", "rpm", "INTEGER"),  # requests per minute (NULL: no limit)
    ("accounts", "tpm", "INTEGER"),  # prompt and completion tokens per minute
    ("accounts", "max_concurrent", "INTEGER"),  # requests in flight at once
    # The part of an hour's usage that batch lines made (within the totals).
    ("usage", "batch_requests", "INTEGER NOT NULL DEFAULT 0"),
    ("usage", "batch_prompt_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("usage", "batch_completion_tokens", "INTEGER NOT NULL DEFAULT 0"),
)
# The account columns a server reads, with what an older store without them means.
_SERVED_COLUMNS = (("admin", 0), ("cache_group", None), ("weight", 1.0), ("min_priority", 0), ("rpm", None),
                   ("tpm", None), ("max_concurrent", None))


class KeyStoreError(Exception):
    """The key store cannot be read or written, or refuses what it was asked to store."""


def valid_account_name(account: str) -> bool:
    """A name that is an account's alone: not "" (open mode's files, responses and cache
    namespace have no account name), no surrounding spaces that would make two names look
    alike, no control characters, at most 128 characters."""
    return (0 < len(account) <= 128 and account == account.strip()
            and not any(ord(c) < 32 or ord(c) == 127 for c in account))


def check_account_name(account: str) -> None:
    if not valid_account_name(account):
        raise KeyStoreError(f"{account[:40]!r} is no account name: 1 to 128 characters, no surrounding spaces "
                            "or control characters")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class KeyInfo:
    id: int
    account: str
    display_prefix: str
    created_at: int
    revoked_at: int | None
    account_approved: bool


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Of those, what batch lines used.
    batch_requests: int = 0
    batch_prompt_tokens: int = 0
    batch_completion_tokens: int = 0

    def add(self, other: Usage) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class AccountLimits:
    """Per-account limits (None: none): requests and tokens per minute, requests in flight."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class ActiveKey:
    key_hash: str
    key_id: int
    account: str
    account_approved: bool
    admin: bool = False
    cache_group: str | None = None
    weight: float = 1.0  # share of the slots against other accounts with work waiting
    min_priority: int = 0  # the most urgent priority its requests may ask for (lower runs first)
    limits: AccountLimits = AccountLimits()

    @property
    def cache_namespace(self) -> str:
        """Whose cached prompts this key's requests may reuse: its account's, or its group's."""
        return f"group:{self.cache_group}" if self.cache_group else f"account:{self.account}"


@dataclass(frozen=True)
class KeySnapshot:
    """What the server checks keys against: active keys by hash, and whether any key exists."""

    active: dict[str, ActiveKey]
    any_keys: bool


class KeyStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser()

    # ------------------------------------------------------------------ administration

    def create_key(self, account: str, *, approve_new_account: bool = True) -> tuple[KeyInfo, str]:
        """Mint a key for `account` (creating the account if needed); the key is returned once."""
        check_account_name(account)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        now = int(time.time())
        with self._write() as db:
            db.execute(
                "INSERT OR IGNORE INTO accounts (name, approved, created_at) VALUES (?, ?, ?)",
                (account, int(approve_new_account), now),
            )
            cursor = db.execute(
                "INSERT INTO keys (account, key_hash, display_prefix, created_at) VALUES (?, ?, ?, ?)",
                (account, hash_key(key), key[:_DISPLAY_PREFIX], now),
            )
            key_id = cursor.lastrowid
        return next(info for info in self.list_keys(account) if info.id == key_id), key

    def list_keys(self, account: str | None = None) -> list[KeyInfo]:
        if not self.path.exists():
            return []
        query = (
            "SELECT k.id, k.account, k.display_prefix, k.created_at, k.revoked_at, a.approved "
            "FROM keys k JOIN accounts a ON a.name = k.account"
        )
        params: tuple = ()
        if account is not None:
            query += " WHERE k.account = ?"
            params = (account,)
        with self._read() as db:
            rows = db.execute(query + " ORDER BY k.id", params).fetchall()
        return [KeyInfo(r[0], r[1], r[2], r[3], r[4], bool(r[5])) for r in rows]

    def revoke(self, key_id: int) -> bool:
        with self._write() as db:
            cursor = db.execute(
                "UPDATE keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (int(time.time()), key_id)
            )
            return cursor.rowcount == 1

    def set_approved(self, account: str, approved: bool) -> bool:
        with self._write() as db:
            cursor = db.execute("UPDATE accounts SET approved = ? WHERE name = ?", (int(approved), account))
            return cursor.rowcount == 1

    def set_admin(self, account: str, admin: bool) -> bool:
        with self._write() as db:
            cursor = db.execute("UPDATE accounts SET admin = ? WHERE name = ?", (int(admin), account))
            return cursor.rowcount == 1

    def set_weight(self, account: str, weight: float) -> bool:
        if not (0 < weight <= 1000):
            raise KeyStoreError("a weight is a number over 0, at most 1000")
        return self._update(account, "weight", weight)

    def set_min_priority(self, account: str, priority: int) -> bool:
        return self._update(account, "min_priority", priority)

    def set_limits(self, account: str, *, rpm: int | None, tpm: int | None, max_concurrent: int | None) -> bool:
        """Set the given limits (0: remove that limit); None leaves one as it is."""
        changed = True
        for column, value in (("rpm", rpm), ("tpm", tpm), ("max_concurrent", max_concurrent)):
            if value is not None:
                if value < 0:
                    raise KeyStoreError(f"{column} must be 0 (no limit) or more")
                changed = self._update(account, column, value or None) and changed
        return changed

    def _update(self, account: str, column: str, value: object) -> bool:
        with self._write() as db:
            cursor = db.execute(f"UPDATE accounts SET {column} = ? WHERE name = ?", (value, account))
            return cursor.rowcount == 1

    def set_cache_group(self, account: str, group: str | None) -> bool:
        """Let the accounts of one group reuse each other's cached prompts (None: the account's own)."""
        with self._write() as db:
            cursor = db.execute("UPDATE accounts SET cache_group = ? WHERE name = ?", (group, account))
            return cursor.rowcount == 1

    # ------------------------------------------------------------------ usage

    def add_usage(self, counts: dict[tuple[str, int], Usage]) -> None:
        """Add usage by (account, hour: the Unix time of the hour's start)."""
        with self._write() as db:
            columns = list(Usage.__dataclass_fields__)
            db.executemany(
                f"INSERT INTO usage (account, hour, {', '.join(columns)}) VALUES ({', '.join('?' * (len(columns) + 2))})"
                " ON CONFLICT (account, hour) DO UPDATE SET "
                + ", ".join(f"{column} = {column} + excluded.{column}" for column in columns),
                [(account, hour, *(getattr(u, column) for column in columns)) for (account, hour), u in counts.items()])

    def usage(self, account: str | None = None, since: int | None = None) -> dict[str, Usage]:
        """Usage by account, from the hour holding `since` (Unix time) on."""
        if not self.path.exists():
            return {}
        query = (f"SELECT account, {', '.join(f'SUM({column})' for column in Usage.__dataclass_fields__)} "
                 "FROM usage WHERE hour >= ?")
        params: list = [0 if since is None else since - since % 3600]
        if account is not None:
            query += " AND account = ?"
            params.append(account)
        with self._write() as db:  # (a store written by an older version gains the newer columns)
            rows = db.execute(query + " GROUP BY account ORDER BY account", params).fetchall()
        return {row[0]: Usage(*row[1:]) for row in rows}

    # ------------------------------------------------------------------ serving

    def snapshot(self) -> KeySnapshot:
        """All active keys. A missing database is an empty store; an unreadable one an error."""
        if not self.path.exists():
            return KeySnapshot(active={}, any_keys=False)
        with self._read() as db:
            columns = {row[1] for row in db.execute("PRAGMA table_info(accounts)")}
            extra = ", ".join(f"a.{name}" if name in columns else "NULL" for name, _ in _SERVED_COLUMNS)
            rows = db.execute(
                f"SELECT k.key_hash, k.id, k.account, a.approved, k.revoked_at, {extra} "
                "FROM keys k JOIN accounts a ON a.name = k.account"
            ).fetchall()
        active = {}
        for r in rows:
            if r[4] is not None or not valid_account_name(r[2]):  # revoked, or a name create_key refuses
                continue
            served = {name: default if value is None else value
                      for (name, default), value in zip(_SERVED_COLUMNS, r[5:])}
            active[r[0]] = ActiveKey(
                key_hash=r[0], key_id=r[1], account=r[2], account_approved=bool(r[3]), admin=bool(served["admin"]),
                cache_group=served["cache_group"], weight=float(served["weight"]),
                min_priority=int(served["min_priority"]),
                limits=AccountLimits(served["rpm"], served["tpm"], served["max_concurrent"]))
        return KeySnapshot(active=active, any_keys=bool(rows))

    # ------------------------------------------------------------------ plumbing

    def _read(self) -> closing[sqlite3.Connection]:
        try:
            db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
            db.execute("SELECT 1 FROM keys LIMIT 1")
        except sqlite3.Error as exc:
            raise KeyStoreError(f"cannot read the key store {self.path}: {exc}") from exc
        return closing(db)

    def _write(self) -> _Transaction:
        try:
            create_private(self.path)
            db = sqlite3.connect(self.path, timeout=5)
            db.executescript(_SCHEMA)
            for table, column, definition in _ADDED_COLUMNS:
                if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        except (OSError, sqlite3.Error) as exc:
            raise KeyStoreError(f"cannot write the key store {self.path}: {exc}") from exc
        return _Transaction(db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> sqlite3.Connection:
        return self._db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._db.commit()
            else:
                self._db.rollback()
        finally:
            self._db.close()
