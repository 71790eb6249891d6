"""Leases on the work the server owns (batches, background responses), kept in the database that
holds the work, so that servers sharing a data directory never run one job twice.

A server runs only the jobs it holds a lease on: it takes one when it adds a job, renews its
leases while it runs them, and stops a job whose lease it lost. Results are written only under
a lease (the write checks it in its own transaction), so a server that stalled past its lease
cannot overwrite what the server that took the job over wrote. A job whose lease has lapsed
(its server died, or stalled past the lease) is taken over by whichever server asks first; on
the same host, the lease of a server whose process has ended is taken at once, so a server
started again after a kill -9 resumes its work without waiting out the lease.

Every call takes an open connection: the stores call them inside their own transactions.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
import uuid
from typing import Iterable

SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    job TEXT PRIMARY KEY,  -- a batch's or a background response's id
    holder TEXT NOT NULL,  -- the server running it: host/pid namespace/pid/nonce
    until REAL NOT NULL,  -- time.time() when the lease lapses unless renewed
    stop INTEGER NOT NULL DEFAULT 0  -- another server was asked to cancel it: its holder stops it
);
"""


class LeaseLost(Exception):
    """Another server holds the job now: this one stops it and writes nothing for it."""


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # not Linux: a server's process is not looked up, its leases lapse
        return ""


class Leases:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._host = socket.gethostname().replace("/", "_")
        self._namespace = _pid_namespace()
        self.holder = f"{self._host}/{self._namespace}/{os.getpid()}/{uuid.uuid4().hex[:12]}"

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    def take(self, db: sqlite3.Connection, jobs: Iterable[str]) -> list[str]:
        """Take the lease of each job that is free, lapsed or held by an ended server of this host;
        the jobs this server holds now. Each change is a compare-and-set on the row as it was
        read, so two servers asking at once cannot both get a job."""
        now = time.time()
        taken = []
        for job in jobs:
            row = db.execute("SELECT holder, until FROM leases WHERE job = ?", (job,)).fetchone()
            if row is None:
                changed = db.execute("INSERT OR IGNORE INTO leases (job, holder, until) VALUES (?, ?, ?)",
                                     (job, self.holder, now + self.ttl_s)).rowcount
            elif row[0] == self.holder or row[1] < now or self._ended(row[0]):
                changed = db.execute("UPDATE leases SET holder = ?, until = ? WHERE job = ? AND holder = ? AND "
                                     "until = ?", (self.holder, now + self.ttl_s, job, *row)).rowcount
            else:
                changed = 0
            if changed:
                taken.append(job)
        return taken

    def renew(self, db: sqlite3.Connection, jobs: Iterable[str]) -> dict[str, bool]:
        """Extend the leases this server still holds; for each of those, whether another server
        asked it to stop the job. A job missing from the answer was lost."""
        until = time.time() + self.ttl_s
        held = {}
        for job in jobs:
            if db.execute("UPDATE leases SET until = ? WHERE job = ? AND holder = ?",
                          (until, job, self.holder)).rowcount:
                (stop,) = db.execute("SELECT stop FROM leases WHERE job = ?", (job,)).fetchone()
                held[job] = bool(stop)
        return held

    def check(self, db: sqlite3.Connection, job: str) -> None:
        """LeaseLost unless this server holds the job's lease (call it in the write's transaction)."""
        row = db.execute("SELECT holder FROM leases WHERE job = ?", (job,)).fetchone()
        if row is None or row[0] != self.holder:
            raise LeaseLost(f"{job} is run by another server now")

    def held_elsewhere(self, db: sqlite3.Connection, job: str) -> bool:
        """Whether a live lease of another server covers the job."""
        row = db.execute("SELECT holder, until FROM leases WHERE job = ?", (job,)).fetchone()
        return row is not None and row[0] != self.holder and row[1] >= time.time() and not self._ended(row[0])

    def ask_to_stop(self, db: sqlite3.Connection, job: str) -> None:
        """Ask the server holding the job to stop it (it reads this when it renews)."""
        db.execute("UPDATE leases SET stop = 1 WHERE job = ?", (job,))

    def release(self, db: sqlite3.Connection, job: str) -> None:
        db.execute("DELETE FROM leases WHERE job = ?", (job,))

    def _ended(self, holder: str) -> bool:
        """Whether `holder` is a server of this host and pid namespace whose process has ended."""
        host, namespace, pid, _ = (holder.split("/") + ["", "", "", ""])[:4]
        if host != self._host or not namespace or namespace != self._namespace or not pid.isdigit():
            return False
        if int(pid) == os.getpid():
            return False  # another app in this process (tests): it lapses like any other
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, another user's
            return False
        return False
