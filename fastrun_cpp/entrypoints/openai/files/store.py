"""Files (OpenAI's /v1/files): uploaded batch files and the output and error files batches write,
in the database the batches live in (`Database`), so a batch's end and its files are written in
one transaction.

A file is kept in pieces of CHUNK_BYTES, written and read one at a time: neither a batch's output
nor its download is ever one value in memory. Every row belongs to an account: another account's
id is simply not found. All calls block: the serving code runs them on the store's own thread.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from fastrun_cpp.entrypoints.database import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    account TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    content BLOB NOT NULL  -- empty: the file is in file_chunks (stores made before hold it here)
);
CREATE INDEX IF NOT EXISTS files_by_account ON files(account, created_at);
CREATE TABLE IF NOT EXISTS file_chunks (
    file_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (file_id, seq)
);
"""
CHUNK_BYTES = 1 << 20
OPEN_ACCOUNT = ""  # the namespace of a server without keys


class FileBudgetExceeded(Exception):
    pass


@dataclass(frozen=True)
class StoredFile:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None

    def as_api(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


@dataclass(frozen=True)
class FilesBudget:
    """What one account may keep, and what all of them together may."""

    account_files: int
    account_bytes: int
    total_bytes: int


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def owner_of(account: str | None) -> str:
    return account or OPEN_ACCOUNT


class FileStore:
    def __init__(self, database: Database, budget: FilesBudget) -> None:
        self.database = database
        self.budget = budget

    def put(self, account: str | None, purpose: str, filename: str, content: bytes,
            expires_at: int | None = None) -> StoredFile:
        """An upload, within the account's and the server's budgets (FileBudgetExceeded)."""
        owner = owner_of(account)
        with self.database.writing() as db:
            count, used = self._used(db, owner)
            (total,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()
            budget = self.budget
            if count + 1 > budget.account_files:
                raise FileBudgetExceeded(f"this account already has {count} files, the most it may keep "
                                         "(delete some: DELETE /v1/files/{file_id})")
            if used + len(content) > budget.account_bytes:
                raise FileBudgetExceeded(f"this account's files would take {used + len(content)} bytes, over its "
                                         f"{budget.account_bytes} (delete some: DELETE /v1/files/{{file_id}})")
            if total + len(content) > budget.total_bytes:
                raise FileBudgetExceeded("the server's file storage is full")
            view = memoryview(content)
            return self.write(db, owner, purpose, filename,
                              (view[start:start + CHUNK_BYTES] for start in range(0, len(content), CHUNK_BYTES)),
                              expires_at)

    @staticmethod
    def write(db: sqlite3.Connection, owner: str, purpose: str, filename: str,
              pieces: Iterable[bytes | memoryview], expires_at: int | None) -> StoredFile:
        """A file written from `pieces` (each at most CHUNK_BYTES) one at a time, in the caller's
        transaction. What a batch writes back is never refused here: its lines were paid for (the
        account's files count against its budget when it starts another batch)."""
        now = int(time.time())
        db.execute("DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at < ?", (now,))
        db.execute("DELETE FROM file_chunks WHERE NOT EXISTS (SELECT 1 FROM files WHERE id = file_id)")
        file_id, size = new_id("file"), 0
        for seq, piece in enumerate(pieces):
            db.execute("INSERT INTO file_chunks VALUES (?, ?, ?)", (file_id, seq, piece))
            size += len(piece)
        stored = StoredFile(file_id, purpose, filename, size, now, expires_at)
        db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (stored.id, owner, purpose, filename, stored.bytes, now, expires_at, b""))
        return stored

    @staticmethod
    def _used(db: sqlite3.Connection, owner: str) -> tuple[int, int]:
        return db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM files WHERE account = ?", (owner,)).fetchone()

    def full(self, account: str | None) -> bool:
        """Whether the account's files (a batch's output files count) fill its budget: then it
        starts no batch, so outputs cannot pile up past it."""
        with self.database.reading() as db:
            count, used = self._used(db, owner_of(account))
        return count >= self.budget.account_files or used >= self.budget.account_bytes

    def file(self, account: str | None, file_id: str) -> StoredFile | None:
        with self.database.reading() as db:
            row = db.execute("SELECT id, purpose, filename, bytes, created_at, expires_at FROM files "
                             "WHERE id = ? AND account = ?", (file_id, owner_of(account))).fetchone()
        return StoredFile(*row) if row else None

    def content(self, account: str | None, file_id: str) -> bytes | None:
        """A file whole: an uploaded batch file, at most the body limit (a download is read with
        `piece`)."""
        pieces = []
        while piece := self.piece(account, file_id, len(pieces)):
            pieces.append(piece)
        return b"".join(pieces) if pieces else None

    def piece(self, account: str | None, file_id: str, seq: int) -> bytes | None:
        """Piece `seq` of the account's file: None when there is no such file, and b"" past its
        end (a file is read in pieces of at most CHUNK_BYTES, one query each)."""
        with self.database.reading() as db:
            row = db.execute("SELECT length(content) FROM files WHERE id = ? AND account = ?",
                             (file_id, owner_of(account))).fetchone()
            if row is None:
                return None
            if row[0]:  # a store made before files were kept in pieces: one piece
                (content,) = db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
                return bytes(content) if seq == 0 else b""
            piece = db.execute("SELECT data FROM file_chunks WHERE file_id = ? AND seq = ?", (file_id, seq)).fetchone()
        return bytes(piece[0]) if piece else b""

    def files(self, account: str | None, *, purpose: str | None, after: str | None, limit: int,
              newest_first: bool) -> tuple[list[StoredFile], bool]:
        """A page of the account's files, and whether more follow."""
        query = "SELECT id, purpose, filename, bytes, created_at, expires_at FROM files WHERE account = ?"
        params: list[Any] = [owner_of(account)]
        if purpose is not None:
            query += " AND purpose = ?"
            params.append(purpose)
        order = "DESC" if newest_first else "ASC"
        with self.database.reading() as db:
            if after is not None:
                row = db.execute("SELECT rowid FROM files WHERE id = ? AND account = ?",
                                 (after, owner_of(account))).fetchone()
                if row is not None:
                    query += f" AND rowid {'<' if newest_first else '>'} ?"
                    params.append(row[0])
            rows = db.execute(f"{query} ORDER BY rowid {order} LIMIT ?", (*params, limit + 1)).fetchall()
        return [StoredFile(*row) for row in rows[:limit]], len(rows) > limit

    def delete(self, account: str | None, file_id: str) -> bool:
        with self.database.writing() as db:
            cursor = db.execute("DELETE FROM files WHERE id = ? AND account = ?", (file_id, owner_of(account)))
            if cursor.rowcount:
                db.execute("DELETE FROM file_chunks WHERE file_id = ?", (file_id,))
        return cursor.rowcount > 0


def lines_of(content: bytes) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line) of a JSONL file's non-blank lines, found one at a time: a file
    of many short lines is never split into a list of them (a 60 MiB file of 3-byte lines made
    20 million objects, about 1 GB)."""
    number, start = 1, 0
    while start < len(content):
        end = content.find(b"\n", start)
        if end < 0:
            end = len(content)
        line = content[start:end]
        if line.strip():
            yield number, line
        number += 1
        start = end + 1
