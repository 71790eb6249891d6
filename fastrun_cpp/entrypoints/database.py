"""One SQLite database of records the server keeps for its users (files and batches share one,
so a batch's end and its output files are written in one transaction). Its tables are made at
its first use; it is the owner's only (mode 0600, journals included); WAL, so readers never wait
for a write's commit. Every call blocks: the stores run them on a thread of their own."""

from __future__ import annotations

import sqlite3
import threading
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Callable, Iterator

from fastrun_cpp.private import create_private


class Database:
    def __init__(self, path: Path, *schemas: str, timeout_s: float = 30,
                 migrate: Callable[[sqlite3.Connection], None] | None = None) -> None:
        """`migrate`: brings a database made by an older version up to `schemas`, run after them."""
        self.path = Path(path).expanduser()
        self._schemas = schemas
        self._migrate = migrate
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ready = False

    def _connect(self) -> sqlite3.Connection:
        if not self._ready:
            create_private(self.path)  # prompts and answers: the owner's only
        connection = sqlite3.connect(self.path, timeout=self._timeout_s)
        if not self._ready:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.executescript("".join(self._schemas))
            if self._migrate is not None:
                self._migrate(connection)
            connection.commit()
            self._ready = True
        return connection

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock, closing(self._connect()) as db:
            yield db

    @contextmanager
    def writing(self) -> Iterator[sqlite3.Connection]:
        """A connection in a transaction, committed when the block ends (rolled back if it raises)."""
        with self._lock, closing(self._connect()) as db, db:
            yield db
