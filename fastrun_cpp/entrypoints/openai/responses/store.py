"""Stored responses (`store: true`), in SQLite next to the key store: what GET and DELETE
/v1/responses/{id} read, and what `previous_response_id` continues.

Each row belongs to an account: another account's id is simply not found. Rows older than the
retention are dropped; past an account's budget (rows and bytes) its oldest go first, and past
the server's ceiling the oldest of all, so one account cannot evict everyone's or fill the disk.
A background response's job is run by the server holding its lease (`leases.py`), so servers
sharing this database never run one twice. All calls block: the serving code runs them on the
store's own thread.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastrun_cpp.entrypoints.database import Database
from fastrun_cpp.entrypoints.leases import SCHEMA as LEASES_SCHEMA
from fastrun_cpp.entrypoints.leases import Leases
from fastrun_cpp.entrypoints.tenancy import AccountAtCap

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    account TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL,
    size INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses(created_at);
CREATE TABLE IF NOT EXISTS background (
    id TEXT PRIMARY KEY,  -- the response's
    account TEXT NOT NULL,
    key_id INTEGER,  -- the key that asked: the work runs as that key (NULL: a server without keys)
    request TEXT NOT NULL,  -- the ResponsesRequest, as validated
    conversation TEXT NOT NULL,  -- the input items before this turn's
    done INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS response_events (
    response_id TEXT PRIMARY KEY,
    events TEXT NOT NULL  -- a finished background response's stream events, a JSON list, for replay
);
"""


def _migrate(db: sqlite3.Connection) -> None:
    """Stores made before rows had a size, and the index over the account's rows."""
    if "size" not in {row[1] for row in db.execute("PRAGMA table_info(responses)")}:
        db.execute("ALTER TABLE responses ADD COLUMN size INTEGER NOT NULL DEFAULT 0")
    db.executescript("CREATE INDEX IF NOT EXISTS responses_by_account ON responses(account, created_at);"
                     "UPDATE responses SET size = length(response) + length(conversation) WHERE size = 0;")


# The rows past a count or a byte budget, newest kept first: over one account or over all.
_NEWEST_FIRST = "ORDER BY created_at DESC, rowid DESC"
_PAST_COUNT = "DELETE FROM responses WHERE id IN (SELECT id FROM responses {where} " + _NEWEST_FIRST + \
    " LIMIT -1 OFFSET ?)"
_PAST_BYTES = "DELETE FROM responses WHERE id IN (SELECT id FROM (SELECT id, SUM(size) OVER (" + _NEWEST_FIRST + \
    ") AS running FROM responses {where}) WHERE running > ?)"
OPEN_ACCOUNT = ""  # the namespace of a server without keys


class StoredTooLarge(Exception):
    pass


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    conversation: list[dict[str, Any]]  # input items of every turn so far, its own output included


@dataclass(frozen=True)
class BackgroundJob:
    """A background response still owed: what a restart runs again."""

    response_id: str
    account: str
    key_id: int | None
    request: dict[str, Any]
    conversation: list[dict[str, Any]]


@dataclass(frozen=True)
class StoreBudget:
    """What the store keeps: per account and over all accounts, in rows and bytes; a row's own
    cap; and for how long."""

    items: int
    bytes: int
    account_items: int
    account_bytes: int
    row_bytes: int
    retention_s: float


class ResponseStore:
    def __init__(self, path: Path, budget: StoreBudget, leases: Leases) -> None:
        self.database = Database(path, _SCHEMA, LEASES_SCHEMA, timeout_s=10, migrate=_migrate)
        self.path = self.database.path
        self.budget = budget
        self.leases = leases

    @property
    def retention_s(self) -> float:
        return self.budget.retention_s

    def put(self, account: str | None, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Store a response; the oldest rows of its account past the account's budget go, then
        the oldest of all past the server's."""
        with self.database.writing() as db:
            self._put(db, account, response, conversation)

    def _put(self, db: sqlite3.Connection, account: str | None, response: dict[str, Any],
             conversation: list[dict[str, Any]], events_bytes: int = 0) -> None:
        """`events_bytes`: a background response's stream events, kept beside it, count in its size."""
        budget = self.budget
        response_text = json.dumps(response, separators=(",", ":"))
        conversation_text = json.dumps(conversation, separators=(",", ":"))
        size = len(response_text.encode()) + len(conversation_text.encode()) + events_bytes
        if size > min(budget.row_bytes, budget.account_bytes, budget.bytes):
            raise StoredTooLarge(f"the conversation is {size} bytes, over the "
                                 f"{min(budget.row_bytes, budget.account_bytes, budget.bytes)} a stored response may "
                                 "hold")
        now = int(time.time())
        owner = account or OPEN_ACCOUNT
        db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                   (response["id"], owner, now, response_text, conversation_text, size))
        db.execute("DELETE FROM responses WHERE created_at < ?", (now - budget.retention_s,))
        mine = "WHERE account = ?"
        db.execute(_PAST_COUNT.format(where=mine), (owner, budget.account_items))
        db.execute(_PAST_BYTES.format(where=mine), (owner, budget.account_bytes))
        db.execute(_PAST_COUNT.format(where=""), (budget.items,))
        db.execute(_PAST_BYTES.format(where=""), (budget.bytes,))
        # What belonged to the responses that went: their events, and their jobs that have ended.
        db.execute("DELETE FROM response_events WHERE NOT EXISTS (SELECT 1 FROM responses WHERE id = response_id)")
        db.execute("DELETE FROM background WHERE done = 1 AND NOT EXISTS (SELECT 1 FROM responses r "
                   "WHERE r.id = background.id)")

    def get(self, account: str | None, response_id: str) -> StoredResponse | None:
        with self.database.reading() as db:
            row = db.execute("SELECT response, conversation FROM responses WHERE id = ? AND account = ? "
                             "AND created_at >= ?",
                             (response_id, account or OPEN_ACCOUNT, int(time.time() - self.retention_s))).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, account: str | None, response_id: str) -> bool:
        with self.database.writing() as db:
            cursor = db.execute("DELETE FROM responses WHERE id = ? AND account = ?",
                                (response_id, account or OPEN_ACCOUNT))
            if cursor.rowcount:
                db.execute("DELETE FROM response_events WHERE response_id = ?", (response_id,))
                db.execute("DELETE FROM background WHERE id = ?", (response_id,))
                self.leases.release(db, response_id)  # its server, if another, stops the job when it renews
        return cursor.rowcount > 0

    # ------------------------------------------------------------------ background responses

    def put_background(self, account: str | None, key_id: int | None, response: dict[str, Any],
                       request: dict[str, Any], conversation: list[dict[str, Any]], *, per_account: int) -> None:
        """A queued background response, with what it takes to run it (again, after a restart).
        The account's count of those running is checked in the same transaction (AccountAtCap)."""
        with self.database.writing() as db:
            (running,) = db.execute("SELECT COUNT(*) FROM background WHERE account = ? AND done = 0",
                                    (account or OPEN_ACCOUNT,)).fetchone()
            if running >= per_account:
                raise AccountAtCap(f"this account already has {per_account} background responses running, "
                                   "the most it may")
            self._put(db, account, response, conversation)
            db.execute("INSERT OR REPLACE INTO background VALUES (?, ?, ?, ?, ?, 0)",
                       (response["id"], account or OPEN_ACCOUNT, key_id, json.dumps(request),
                        json.dumps(conversation)))
            self.leases.take(db, [response["id"]])  # this server runs it

    def owed_background(self, running: set[str] | frozenset[str] = frozenset()) -> list[BackgroundJob]:
        """The jobs not done that no other live server holds, oldest first, their leases taken:
        what a start resumes and what is taken over from a server that died (`running`: those
        this server runs already)."""
        with self.database.writing() as db:
            rows = db.execute("SELECT id, account, key_id, request, conversation FROM background WHERE done = 0 "
                              "ORDER BY rowid").fetchall()
            rows = [row for row in rows if row[0] not in running]
            taken = set(self.leases.take(db, [row[0] for row in rows]))
        return [BackgroundJob(id, account, key_id, json.loads(request), json.loads(conversation))
                for id, account, key_id, request, conversation in rows if id in taken]

    def renew_background(self, response_ids: list[str]) -> dict[str, bool]:
        """Renew this server's leases on the jobs; for each it still holds, whether a cancel sent
        to another server asks it to stop the job. A job missing was lost (or deleted)."""
        with self.database.writing() as db:
            return self.leases.renew(db, response_ids)

    def stop_elsewhere(self, response_id: str) -> bool:
        """Ask the live server that runs the job, if another, to cancel it; whether one does."""
        with self.database.writing() as db:
            if not self.leases.held_elsewhere(db, response_id):
                return False
            self.leases.ask_to_stop(db, response_id)
            return True

    def finish_background(self, account: str | None, response: dict[str, Any], conversation: list[dict[str, Any]],
                          events: list[str]) -> None:
        """The background response as it ended, with its events for replay, in one go, under
        the job's lease (LeaseLost: another server runs it now). The events count in the
        response's size, within the account's budget; events too large to keep with it are
        dropped (the response is kept, and replays nothing)."""
        events_text = json.dumps(events, separators=(",", ":"))
        with self.database.writing() as db:
            self.leases.check(db, response["id"])
            self.leases.release(db, response["id"])
            db.execute("UPDATE background SET done = 1, request = '{}', conversation = '[]' WHERE id = ?",
                       (response["id"],))
            try:
                self._put(db, account, response, conversation, len(events_text.encode()))
            except StoredTooLarge:
                self._put(db, account, response, conversation)
                return
            db.execute("INSERT OR REPLACE INTO response_events VALUES (?, ?)", (response["id"], events_text))

    def drop_background(self, response_id: str) -> None:
        """A job whose response is gone (deleted, or past the retention or the budget): it is owed
        no more."""
        with self.database.writing() as db:
            db.execute("DELETE FROM background WHERE id = ?", (response_id,))
            self.leases.release(db, response_id)

    def events(self, account: str | None, response_id: str) -> list[str] | None:
        """A finished background response's events (the data of each), or None."""
        with self.database.reading() as db:
            row = db.execute("SELECT e.events FROM response_events e JOIN responses r ON r.id = e.response_id "
                             "WHERE e.response_id = ? AND r.account = ?",
                             (response_id, account or OPEN_ACCOUNT)).fetchone()
        return json.loads(row[0]) if row else None
