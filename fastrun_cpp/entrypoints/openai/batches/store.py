"""Batches (OpenAI's /v1/batches) and each batch's lines, in the database the files live in
(`files/store.py`), so a line's result is committed with its state in one transaction, and a
batch's end with its output files: after a restart (SIGTERM or kill -9) a line is either done,
with its result, or still to run; none is lost and none is answered twice.

A batch is run by the server that holds its lease (`leases.py`): servers sharing this database
never run one twice, and line results and the batch's end are written only under its lease.

Every row belongs to an account: another account's id is simply not found. All calls block:
the serving code runs them on the store's own thread.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Iterator

from fastrun_cpp.entrypoints.openai.files.store import CHUNK_BYTES, FileStore, new_id, owner_of
from fastrun_cpp.entrypoints.leases import Leases
from fastrun_cpp.entrypoints.tenancy import AccountAtCap

SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    account TEXT NOT NULL,
    key_id INTEGER,  -- the key that created it: its lines run as that key (NULL: a server without keys)
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    batch TEXT NOT NULL  -- the Batch object as the API returns it
);
CREATE INDEX IF NOT EXISTS batches_by_account ON batches(account, created_at);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches(status);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT,
    request TEXT,  -- the line's body, as uploaded; NULL once it is done
    state TEXT NOT NULL,  -- pending, completed or failed
    result TEXT,  -- its line of the output file (completed) or of the error file (failed)
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, line)
);
CREATE TABLE IF NOT EXISTS batch_output (
    batch_id TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL  -- the results of its completed lines so far, within the batch's output cap
);
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a batch the runner still owes work


@dataclass
class OwedBatch:
    account: str
    key_id: int | None
    batch: dict[str, Any]


@dataclass
class PendingLine:
    batch_id: str
    line: int
    custom_id: str
    body: bytes  # the request body, JSON, sent as it is


@dataclass
class LineOutcome:
    """A line's end: its line of the output file (completed) or of the error file (failed)."""

    completed: bool
    result: dict[str, Any]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class ParsedLine:
    """An input line as validated: a request to run, or the error that keeps it from running."""

    line: int
    custom_id: str | None
    request: dict[str, Any] | None
    error: dict[str, Any] | None = None


@dataclass
class BatchTotals:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class BatchStore:
    def __init__(self, files: FileStore, leases: Leases, *, output_max_bytes: int = 1 << 30) -> None:
        self.files = files
        self.database = files.database
        self.leases = leases
        self.output_max_bytes = output_max_bytes  # a batch's output file, at most

    # ------------------------------------------------------------------ batches

    def check_room(self, account: str | None, per_account: int) -> None:
        """AccountAtCap when the account has `per_account` batches running."""
        with self.database.reading() as db:
            self._check_room(db, account, per_account)

    @staticmethod
    def _check_room(db: sqlite3.Connection, account: str | None, per_account: int) -> None:
        (count,) = db.execute(f"SELECT COUNT(*) FROM batches WHERE account = ? AND status IN "
                              f"({','.join('?' * len(ACTIVE))})", (owner_of(account), *ACTIVE)).fetchone()
        if count >= per_account:
            raise AccountAtCap(f"this account already has {per_account} batches running, the most it may "
                               "(wait for one to end, or cancel one)")

    def create_batch(self, account: str | None, key_id: int | None, batch: dict[str, Any],
                     lines: list[ParsedLine], *, per_account: int) -> None:
        """The batch with its lines, in one transaction: a line that cannot run is failed at once
        with its error line. The account's count of running batches is checked in the same
        transaction (AccountAtCap), so requests sent together cannot all pass a check made before."""
        with self.database.writing() as db:
            self._check_room(db, account, per_account)
            db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?)",
                       (batch["id"], owner_of(account), key_id, batch["created_at"], batch["status"], json.dumps(batch)))
            db.executemany("INSERT INTO batch_lines (batch_id, line, custom_id, request, state, result) "
                           "VALUES (?, ?, ?, ?, ?, ?)",
                           ((batch["id"], parsed.line, parsed.custom_id,
                             None if parsed.request is None else json.dumps(parsed.request),
                             "pending" if parsed.error is None else "failed",
                             None if parsed.error is None else json.dumps(parsed.error)) for parsed in lines))
            self.leases.take(db, [batch["id"]])  # this server runs it

    def batch(self, account: str | None, batch_id: str) -> dict[str, Any] | None:
        with self.database.reading() as db:
            row = db.execute("SELECT batch FROM batches WHERE id = ? AND account = ?",
                             (batch_id, owner_of(account))).fetchone()
        return json.loads(row[0]) if row else None

    def batches(self, account: str | None, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        query, params = "SELECT batch FROM batches WHERE account = ?", [owner_of(account)]
        with self.database.reading() as db:
            if after is not None:
                row = db.execute("SELECT rowid FROM batches WHERE id = ? AND account = ?",
                                 (after, owner_of(account))).fetchone()
                if row is not None:
                    query += " AND rowid < ?"
                    params.append(row[0])
            rows = db.execute(f"{query} ORDER BY rowid DESC LIMIT ?", (*params, limit + 1)).fetchall()
        return [json.loads(row[0]) for row in rows[:limit]], len(rows) > limit

    def update_batch(self, batch: dict[str, Any]) -> None:
        """The runner's change to a batch it holds (LeaseLost if it holds it no more)."""
        with self.database.writing() as db:
            self.leases.check(db, batch["id"])
            db.execute("UPDATE batches SET status = ?, batch = ? WHERE id = ?",
                       (batch["status"], json.dumps(batch), batch["id"]))

    def set_status_if(self, account: str | None, batch_id: str, allowed: tuple[str, ...],
                      change: dict[str, Any]) -> dict[str, Any] | None:
        """Apply `change` to the batch if its status is one of `allowed`; the batch as it is now
        (None: not found)."""
        with self.database.writing() as db:
            row = db.execute("SELECT batch FROM batches WHERE id = ? AND account = ?",
                             (batch_id, owner_of(account))).fetchone()
            if row is None:
                return None
            batch = json.loads(row[0])
            if batch["status"] in allowed:
                batch.update(change)
                db.execute("UPDATE batches SET status = ?, batch = ? WHERE id = ?",
                           (batch["status"], json.dumps(batch), batch_id))
            return batch

    def owed_batches(self, running: set[str] | frozenset[str] = frozenset()) -> list[OwedBatch]:
        """The batches with work left that no other live server holds, oldest first, their leases
        taken: what a start resumes and what is taken over from a server that died (`running`:
        those this server runs already)."""
        with self.database.writing() as db:
            rows = db.execute(f"SELECT id, account, key_id, batch FROM batches WHERE status IN "
                              f"({','.join('?' * len(ACTIVE))}) ORDER BY rowid", ACTIVE).fetchall()
            rows = [row for row in rows if row[0] not in running]
            taken = set(self.leases.take(db, [row[0] for row in rows]))
        return [OwedBatch(account, key_id, json.loads(batch)) for id, account, key_id, batch in rows if id in taken]

    def renew(self, batch_ids: list[str]) -> dict[str, str]:
        """Renew this server's leases on `batch_ids`; the status of each batch it still holds
        (a cancel sent to another server shows here as `cancelling`)."""
        with self.database.writing() as db:
            held = self.leases.renew(db, batch_ids)
            return {id: status for id, status in db.execute(
                f"SELECT id, status FROM batches WHERE id IN ({','.join('?' * len(held))})", list(held))}

    def pending_lines(self, batch_id: str, after: int, limit: int) -> list[PendingLine]:
        with self.database.reading() as db:
            rows = db.execute("SELECT line, custom_id, request FROM batch_lines WHERE batch_id = ? AND "
                              "state = 'pending' AND line > ? ORDER BY line LIMIT ?",
                              (batch_id, after, limit)).fetchall()
        return [PendingLine(batch_id, line, custom_id, request.encode()) for line, custom_id, request in rows]

    def finish_line(self, batch: dict[str, Any], line: int, outcome: LineOutcome) -> None:
        """Commit a line's result with its state, and the batch's counts with them. A line done
        already (a second answer after a restart raced it) keeps its first result. A result that
        would take the batch's output past its cap is failed instead, with an error naming it."""
        result = json.dumps(outcome.result)
        with self.database.writing() as db:
            self.leases.check(db, batch["id"])
            completed = outcome.completed
            if completed:
                row = db.execute("SELECT bytes FROM batch_output WHERE batch_id = ?", (batch["id"],)).fetchone()
                written = row[0] if row else 0
                if written + len(result) + 1 > self.output_max_bytes:
                    completed, result = False, json.dumps(error_line(outcome.result.get("custom_id"), None, {
                        "code": "batch_output_too_large",
                        "message": f"this line's result ({len(result)} bytes) would take the batch's output file "
                                   f"past its {self.output_max_bytes} bytes (--batch-output-max-mib)"}))
            cursor = db.execute(
                "UPDATE batch_lines SET state = ?, result = ?, request = NULL, prompt_tokens = ?, "
                "cached_tokens = ?, completion_tokens = ? WHERE batch_id = ? AND line = ? AND state = 'pending'",
                ("completed" if completed else "failed", result, outcome.prompt_tokens,
                 outcome.cached_tokens, outcome.completion_tokens, batch["id"], line))
            if cursor.rowcount:
                if completed:
                    db.execute("INSERT INTO batch_output VALUES (?, ?) ON CONFLICT (batch_id) DO UPDATE SET "
                               "bytes = bytes + excluded.bytes", (batch["id"], len(result) + 1))
                counts = batch["request_counts"]
                counts["completed" if completed else "failed"] += 1
                db.execute("UPDATE batches SET batch = json_set(batch, '$.request_counts', json(?)) WHERE id = ?",
                           (json.dumps(counts), batch["id"]))

    @staticmethod
    def _totals(db: sqlite3.Connection, batch_id: str) -> BatchTotals:
        return BatchTotals(*db.execute(
            "SELECT COALESCE(SUM(state = 'completed'), 0), COALESCE(SUM(state = 'failed'), 0), "
            "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
            "FROM batch_lines WHERE batch_id = ?", (batch_id,)).fetchone())

    def _results_file(self, db: sqlite3.Connection, account: str, batch_id: str, state: str,
                      filename: str) -> str | None:
        """The output (`completed`) or error (`failed`) file of a batch, written from its lines'
        results in line order, a piece at a time; None when no line ended so."""
        def pieces() -> Iterator[bytes]:
            buffer = bytearray()
            for (result,) in db.execute("SELECT result FROM batch_lines WHERE batch_id = ? AND state = ? "
                                        "ORDER BY line", (batch_id, state)):
                buffer += result.encode()
                buffer += b"\n"
                while len(buffer) >= CHUNK_BYTES:
                    yield bytes(buffer[:CHUNK_BYTES])
                    del buffer[:CHUNK_BYTES]
            if buffer:
                yield bytes(buffer)

        lines = db.execute("SELECT 1 FROM batch_lines WHERE batch_id = ? AND state = ? LIMIT 1",
                           (batch_id, state)).fetchone()
        if lines is None:
            return None
        return self.files.write(db, account, "batch_output", filename, pieces(), None).id

    def finalize(self, account: str, batch: dict[str, Any], change: dict[str, Any],
                 unfinished: dict[str, Any] | None) -> dict[str, Any]:
        """Write the output and error files from the lines' results and end the batch with
        `change`, in one transaction, under the batch's lease (LeaseLost: another server ends
        it). Lines still pending get `unfinished` as their error (an expired batch's), or are
        left out (a cancelled one's)."""
        with self.database.writing() as db:
            self.leases.check(db, batch["id"])
            if unfinished is not None:
                pending = db.execute("SELECT line, custom_id FROM batch_lines WHERE batch_id = ? AND "
                                     "state = 'pending'", (batch["id"],)).fetchall()
                db.executemany("UPDATE batch_lines SET state = 'failed', request = NULL, result = ? "
                               "WHERE batch_id = ? AND line = ?",
                               ((json.dumps(error_line(custom_id, None, unfinished)), batch["id"], line)
                                for line, custom_id in pending))
            totals = self._totals(db, batch["id"])
            name = batch["id"]
            batch["output_file_id"] = self._results_file(db, account, name, "completed", f"{name}_output.jsonl")
            batch["error_file_id"] = self._results_file(db, account, name, "failed", f"{name}_error.jsonl")
            batch["request_counts"] = {"total": batch["request_counts"]["total"], "completed": totals.completed,
                                       "failed": totals.failed}
            batch["usage"] = usage(totals)
            batch.update(change)
            db.execute("UPDATE batches SET status = ?, batch = ? WHERE id = ?",
                       (batch["status"], json.dumps(batch), batch["id"]))
            db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch["id"],))
            db.execute("DELETE FROM batch_output WHERE batch_id = ?", (batch["id"],))
            self.leases.release(db, batch["id"])
        return batch


    def fail_batch(self, batch: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
        """End a batch that could not be finalized as `failed`, with `error` in its errors, under its
        lease; its lines' results go with it."""
        with self.database.writing() as db:
            self.leases.check(db, batch["id"])
            batch.update(status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": [{**error, "param": None, "line": None}]})
            db.execute("UPDATE batches SET status = ?, batch = ? WHERE id = ?",
                       (batch["status"], json.dumps(batch), batch["id"]))
            db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch["id"],))
            db.execute("DELETE FROM batch_output WHERE batch_id = ?", (batch["id"],))
            self.leases.release(db, batch["id"])
        return batch


def usage(totals: BatchTotals) -> dict[str, Any]:
    """A batch's usage, in OpenAI's BatchUsage shape."""
    return {"input_tokens": totals.prompt_tokens, "input_tokens_details": {"cached_tokens": totals.cached_tokens},
            "output_tokens": totals.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": totals.prompt_tokens + totals.completion_tokens}


def error_line(custom_id: str | None, response: dict[str, Any] | None, error: dict[str, Any] | None) -> dict[str, Any]:
    """A line of a batch's error file, as OpenAI writes it."""
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": response, "error": error}
