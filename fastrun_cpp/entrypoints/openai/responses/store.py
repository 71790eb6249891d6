"""Stored responses (`store: true`), in SQLite next to the key store: what GET and DELETE
/v1/responses/{id} read, and what `previous_response_id` continues.

Each row belongs to an account: another account's id is simply not found. Rows older than the
retention are dropped, and past `max_items` the oldest go first; a row is bounded in bytes.
All calls block: the serving code runs them on the store's own thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastrun_cpp.private import create_private

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    account TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses(created_at);
"""
OPEN_ACCOUNT = ""  # the namespace of a server without keys


class StoredTooLarge(Exception):
    pass


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    conversation: list[dict[str, Any]]  # input items of every turn so far, its own output included


class ResponseStore:
    def __init__(self, path: Path, *, max_items: int, retention_s: float, max_bytes: int) -> None:
        self.path = Path(path).expanduser()
        self.max_items = max_items
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._ready = False

    def _connect(self) -> sqlite3.Connection:
        if not self._ready:
            create_private(self.path)  # prompts and answers: the owner's only
        connection = sqlite3.connect(self.path, timeout=10)
        if not self._ready:
            connection.executescript(_SCHEMA)
            self._ready = True
        return connection

    def put(self, account: str | None, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        response_text = json.dumps(response, separators=(",", ":"))
        conversation_text = json.dumps(conversation, separators=(",", ":"))
        if len(response_text) + len(conversation_text) > self.max_bytes:
            raise StoredTooLarge(f"the conversation is over the {self.max_bytes // 2**20} MiB a stored response may hold")
        now = int(time.time())
        with self._lock, closing(self._connect()) as db, db:
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                       (response["id"], account or OPEN_ACCOUNT, now, response_text, conversation_text))
            db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.retention_s,))
            db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC, "
                       "rowid DESC LIMIT -1 OFFSET ?)", (self.max_items,))

    def get(self, account: str | None, response_id: str) -> StoredResponse | None:
        with self._lock, closing(self._connect()) as db:
            row = db.execute("SELECT response, conversation FROM responses WHERE id = ? AND account = ? "
                             "AND created_at >= ?",
                             (response_id, account or OPEN_ACCOUNT, int(time.time() - self.retention_s))).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, account: str | None, response_id: str) -> bool:
        with self._lock, closing(self._connect()) as db, db:
            cursor = db.execute("DELETE FROM responses WHERE id = ? AND account = ?",
                                (response_id, account or OPEN_ACCOUNT))
        return cursor.rowcount > 0
