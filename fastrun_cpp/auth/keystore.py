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

KEY_PREFIX = "fr_"
KEY_PATTERN = re.compile(r"fr_[A-Za-z0-9_-]{32,128}")
_DISPLAY_PREFIX = 7  # "fr_" and 4 characters: enough to tell keys apart in a listing

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (
    name TEXT PRIMARY KEY,
    approved INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    admin INTEGER NOT NULL DEFAULT 0,
    cache_group TEXT
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
)


class KeyStoreError(Exception):
    """The key store cannot be read or written."""


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


@dataclass(frozen=True)
class ActiveKey:
    key_hash: str
    key_id: int
    account: str
    account_approved: bool
    admin: bool = False
    cache_group: str | None = None

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

    def set_cache_group(self, account: str, group: str | None) -> bool:
        """Let the accounts of one group reuse each other's cached prompts (None: the account's own)."""
        with self._write() as db:
            cursor = db.execute("UPDATE accounts SET cache_group = ? WHERE name = ?", (group, account))
            return cursor.rowcount == 1

    # ------------------------------------------------------------------ serving

    def snapshot(self) -> KeySnapshot:
        """All active keys. A missing database is an empty store; an unreadable one an error."""
        if not self.path.exists():
            return KeySnapshot(active={}, any_keys=False)
        with self._read() as db:
            columns = {row[1] for row in db.execute("PRAGMA table_info(accounts)")}
            extra = ", ".join(f"a.{name}" if name in columns else "NULL" for name in ("admin", "cache_group"))
            rows = db.execute(
                f"SELECT k.key_hash, k.id, k.account, a.approved, k.revoked_at, {extra} "
                "FROM keys k JOIN accounts a ON a.name = k.account"
            ).fetchall()
        active = {
            r[0]: ActiveKey(key_hash=r[0], key_id=r[1], account=r[2], account_approved=bool(r[3]), admin=bool(r[5]),
                            cache_group=r[6])
            for r in rows
            if r[4] is None
        }
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
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=5)
            db.executescript(_SCHEMA)
            for table, column, definition in _ADDED_COLUMNS:
                if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        except (OSError, sqlite3.Error) as exc:
            raise KeyStoreError(f"cannot write the key store {self.path}: {exc}") from exc
        self.path.chmod(0o600)
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
