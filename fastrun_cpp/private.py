"""Files that hold what users sent (prompts, the KV states computed from them, answers, keys)
are the owner's only from the moment they exist: a chmod after creating one leaves a window in
which another local user can open it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

FILE_MODE, DIRECTORY_MODE = 0o600, 0o700


def private_directory(path: Path) -> Path:
    """`path`, made (mode 0700) if absent; one of ours that is wider is narrowed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=DIRECTORY_MODE, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        path.chmod(DIRECTORY_MODE)
    return path


def open_private(path: Path, mode: str = "wb") -> IO:
    """`path` opened for writing (truncated), mode 0600 however it came to exist."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(descriptor, FILE_MODE)
    return os.fdopen(descriptor, mode)


def create_private(path: Path) -> Path:
    """An empty file at `path` (mode 0600) unless one is there: for files another library opens
    (SQLite gives its journals the database's mode)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))
    if path.stat().st_mode & 0o077:
        path.chmod(FILE_MODE)
    return path
