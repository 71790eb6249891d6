"""The disk tier of the prompt cache: saved sequence states that outlive the process.

Entries live in a directory of their own per namespace (the model file's identity, the
settings that change the KV layout, the llama.cpp build), so another model, another KV type or
another build never matches. Each file holds the tokens its state covers and the state, with
sizes and a checksum: a corrupt, truncated or foreign file is skipped with a warning.

Writes go through one writer thread (never the scheduler's), to a temporary file renamed into
place, so readers - this process's or another server's sharing the directory - see whole files
or none. States waiting to be written are bounded in bytes (past that a write is dropped and
counted): a slow disk costs hits, never memory. The tier is bounded in bytes; the least recently
used files (by modification time, refreshed on every hit) go first. Lookups read the directory
and the files' headers: callers run them off the event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastrun_cpp.engine.tokens import PrefixIndex
from fastrun_cpp.private import open_private, private_directory

logger = logging.getLogger(__name__)

MAGIC = b"FASTRUN-KV\x01\n"
SUFFIX = ".kv"
_HEADER_SIZE = struct.Struct("<I")
_RESCAN_INTERVAL_S = 5.0  # how often to look for files other processes wrote
_EVICT_SCAN_INTERVAL_S = 1.0  # how long a write may trust this process's count of the directory's bytes
WRITE_QUEUE_BYTES = 512 * 2**20  # states waiting for the writer (one larger state may still wait alone)
IDENTITIES_FILE = "model-identities.json"  # content hashes of model files, by path, size and mtime
_HASH_CHUNK = 16 * 2**20


@dataclass(eq=False)
class DiskEntry:
    path: Path
    tokens: list[int]
    nbytes: int  # of the whole file
    mtime: float
    tenant: str = ""  # tenant_tag() of the cache namespace that computed it


def tenant_tag(namespace: str) -> str:
    """How a cache namespace (GenerationRequest.cache_namespace) is written in a file: hashed,
    so the files do not name accounts; "" for the shared namespace of open mode."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:32] if namespace else ""


@dataclass
class DiskStats:
    hits: int = 0  # entries loaded for a request
    misses: int = 0  # lookups that found nothing longer than RAM or the slots hold
    writes: int = 0
    dropped: int = 0  # writes not queued: the states already waiting filled the write queue
    evictions: int = 0
    skipped: int = 0  # unreadable files (corrupt, truncated, foreign)
    bytes: int = 0  # on disk now (this namespace)
    entries: int = 0


def namespace_of(**identity: object) -> str:
    """A directory name for everything that must match for a state to be reusable."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def file_identity(path: Path, known: Path | None = None) -> dict[str, object]:
    """A model file's identity: the SHA-256 of its content. Hashing a large file takes a
    while, so the hash is kept in `known` (a JSON file) by path, size and modification time, and
    computed again only when one of them changes. A file in a Hugging Face cache is named by
    that hash already."""
    resolved = path.resolve()
    info = resolved.stat()
    if resolved.parent.name == "blobs" and len(resolved.name) == 64 and all(c in "0123456789abcdef"
                                                                             for c in resolved.name):
        return {"size": info.st_size, "sha256": resolved.name}
    key = f"{resolved}|{info.st_size}|{info.st_mtime_ns}"
    table = _read_identities(known)
    if key not in table:
        digest = hashlib.sha256()
        with open(resolved, "rb") as file:
            while chunk := file.read(_HASH_CHUNK):
                digest.update(chunk)
        table = {k: v for k, v in table.items() if not k.startswith(f"{resolved}|")}  # its older versions
        table[key] = digest.hexdigest()
        _write_identities(known, table)
    return {"size": info.st_size, "sha256": table[key]}


def _read_identities(known: Path | None) -> dict[str, str]:
    if known is None:
        return {}
    try:
        table = json.loads(known.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in table.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(table, dict) else {}


def _write_identities(known: Path | None, table: dict[str, str]) -> None:
    if known is None:
        return
    temporary = known.with_name(f".{known.name}.{os.getpid()}.tmp")
    try:
        private_directory(known.parent)
        with open_private(temporary, "w") as file:
            file.write(json.dumps(table, indent=1, sort_keys=True))
        os.replace(temporary, known)  # another server writing at once: one table wins, the other recomputes
    except OSError as exc:
        logger.warning("could not keep model hashes in %s: %s", known, exc)


class DiskPromptCache:
    def __init__(self, directory: Path, namespace: str, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.directory = Path(directory) / namespace
        self.stats = DiskStats()
        self._entries: dict[Path, DiskEntry] = {}
        self._index = PrefixIndex()  # entry paths by their tokens, by tenant
        self._unreadable: set[tuple[Path, float]] = set()  # (path, mtime) already warned about
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[list[int], np.ndarray] | None] = queue.Queue()
        self._pending = 0  # writes queued and not finished
        self._queued_bytes = 0  # of the states waiting to be written
        self._done = threading.Condition(self._lock)
        self._scanned_at = 0.0
        self._evict_scanned_at = 0.0
        self._dir_mtime = -1
        self._writer: threading.Thread | None = None
        if self.enabled:
            try:
                private_directory(self.directory.parent)
                private_directory(self.directory)
            except OSError as exc:
                logger.warning("prompt cache directory %s is not usable (%s); disk tier off", self.directory, exc)
                self.capacity_bytes = 0
                return
            self._rescan(force=True)
            self._writer = threading.Thread(target=self._write_forever, name="fastrun-kv-writer", daemon=True)
            self._writer.start()
            logger.info("disk prompt cache %s: %d entries, %.1f MiB of %.1f GiB",
                        self.directory, self.stats.entries, self.stats.bytes / 2**20, capacity_bytes / 2**30)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    # ------------------------------------------------------------------ reading

    def longest_prefix(self, tokens: list[int], namespace: str = "") -> tuple[DiskEntry | None, int]:
        """The entry of `namespace` sharing the longest prefix with `tokens`, and its length."""
        if not self.enabled:
            return None, 0
        self._rescan()
        with self._lock:
            path, length = self._index.longest_prefix(tokens, tenant_tag(namespace))
            return (self._entries[path], length) if path is not None else (None, 0)

    def load(self, entry: DiskEntry) -> np.ndarray | None:
        """The entry's state, or None (and the file forgotten) if it is gone or unreadable."""
        try:
            tokens, state, _ = self._read(entry.path, with_state=True)
        except FileNotFoundError:  # evicted, possibly by another server
            self._forget(entry.path)
            return None
        except (OSError, ValueError) as exc:
            self._skip(entry.path, exc)
            return None
        if tokens != entry.tokens:  # replaced by another process with another sequence
            self._forget(entry.path)
            return None
        try:
            os.utime(entry.path)  # most recently used
        except OSError:
            pass
        self.stats.hits += 1
        return state

    # ------------------------------------------------------------------ writing

    def store(self, tokens: list[int], state: np.ndarray, namespace: str = "") -> None:
        """Queue a state of `namespace` for writing (the caller's arrays must not change
        afterwards)."""
        if not self.enabled or state.nbytes > self.capacity_bytes:
            return
        tenant = tenant_tag(namespace)
        path = self._path_of(tokens, tenant)
        with self._lock:
            if path in self._entries:
                return
            if self._pending and self._queued_bytes + state.nbytes > WRITE_QUEUE_BYTES:
                self.stats.dropped += 1
                return
            self._pending += 1
            self._queued_bytes += state.nbytes
        self._writes.put((tokens, state, tenant))

    def flush(self, timeout_s: float) -> bool:
        """Wait until queued writes are on disk; False if time ran out."""
        deadline = time.monotonic() + timeout_s
        with self._done:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._done.wait(remaining)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        if self._writer is not None:
            self.flush(timeout_s)
            self._writes.put(None)

    def _write_forever(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            try:
                self._write(*item)
            except Exception:  # a full disk must not take the server down
                logger.exception("could not write a prompt-cache entry")
            finally:
                with self._done:
                    self._pending -= 1
                    self._queued_bytes -= item[1].nbytes
                    self._done.notify_all()

    def _write(self, tokens: list[int], state: np.ndarray, tenant: str) -> None:
        path = self._path_of(tokens, tenant)
        token_bytes = np.asarray(tokens, dtype="<i4").tobytes()
        header = json.dumps({"n_tokens": len(tokens), "state_bytes": int(state.nbytes),
                             "crc32": zlib.crc32(state) & 0xFFFFFFFF,
                             "tokens_crc32": zlib.crc32(token_bytes) & 0xFFFFFFFF, "tenant": tenant}).encode()
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open_private(temporary) as file:
                file.write(MAGIC)
                file.write(_HEADER_SIZE.pack(len(header)))
                file.write(header)
                file.write(token_bytes)
                file.write(memoryview(state))
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)  # atomic: readers see the old file, the new one, or none
        finally:
            if temporary.exists():
                temporary.unlink()
        size = path.stat().st_size
        with self._lock:
            self._add(DiskEntry(path, list(tokens), size, time.time(), tenant))
            self.stats.writes += 1
        self._evict()

    def _evict(self) -> None:
        """Delete least recently used files until the namespace fits (other processes' too).
        The directory is read only when this process's count says it is over, or when it was
        last read a while ago (another server may have written): reading thousands of files'
        sizes after every write would keep a core busy."""
        now = time.monotonic()
        with self._lock:
            within = self.stats.bytes <= self.capacity_bytes
        if within and now - self._evict_scanned_at < _EVICT_SCAN_INTERVAL_S:
            return
        self._evict_scanned_at = now
        files = []
        for item in os.scandir(self.directory):
            if item.name.endswith(SUFFIX):
                try:
                    info = item.stat()
                except FileNotFoundError:
                    continue
                files.append((info.st_mtime, info.st_size, Path(item.path)))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.capacity_bytes:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            total -= size
            self.stats.evictions += 1
            self._forget(path)

    # ------------------------------------------------------------------ the index

    def _path_of(self, tokens: list[int], tenant: str) -> Path:
        digest = hashlib.sha256(tenant.encode() + np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()
        return self.directory / f"{digest}{SUFFIX}"

    def _read(self, path: Path, *, with_state: bool) -> tuple[list[int], np.ndarray | None, str]:
        try:
            return self._read_file(path, with_state=with_state)
        except (KeyError, TypeError, struct.error, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed header ({exc})") from exc

    def _read_file(self, path: Path, *, with_state: bool) -> tuple[list[int], np.ndarray | None, str]:
        with open(path, "rb") as file:
            if file.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a fastrun prompt-cache file")
            (length,) = _HEADER_SIZE.unpack(file.read(_HEADER_SIZE.size))
            if length > 4096:
                raise ValueError("header too long")
            header = json.loads(file.read(length))
            n_tokens, state_bytes = int(header["n_tokens"]), int(header["state_bytes"])
            tenant = header.get("tenant", "")
            if not isinstance(tenant, str):
                raise ValueError("malformed tenant")
            token_bytes = file.read(4 * n_tokens)
            if len(token_bytes) != 4 * n_tokens or zlib.crc32(token_bytes) & 0xFFFFFFFF != header["tokens_crc32"]:
                raise ValueError("truncated or corrupt tokens")
            tokens = np.frombuffer(token_bytes, dtype="<i4").tolist()
            if not with_state:
                if os.fstat(file.fileno()).st_size != file.tell() + state_bytes:
                    raise ValueError("truncated")
                return tokens, None, tenant
            state = np.empty(state_bytes, dtype=np.uint8)
            if file.readinto(memoryview(state)) != state_bytes or file.read(1):
                raise ValueError("truncated or too long")
        if zlib.crc32(state) & 0xFFFFFFFF != header["crc32"]:
            raise ValueError("corrupt state (checksum mismatch)")
        return tokens, state, tenant

    def _rescan(self, *, force: bool = False) -> None:
        """Index files this process does not know yet (written by another server sharing the
        directory, or before a restart) and forget files that are gone."""
        now = time.monotonic()
        if not force and now - self._scanned_at < _RESCAN_INTERVAL_S:
            return
        self._scanned_at = now
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            return
        if not force and mtime == self._dir_mtime:
            return
        self._dir_mtime = mtime
        present = {}
        for item in os.scandir(self.directory):
            if item.name.endswith(SUFFIX) and not item.name.startswith("."):
                present[Path(item.path)] = item
        with self._lock:
            for path in [p for p in self._entries if p not in present]:
                self._drop(path)
            new = [p for p in present if p not in self._entries]
        for path in new:
            try:
                info = present[path].stat()
                if (path, info.st_mtime) in self._unreadable:
                    continue
                tokens, _, tenant = self._read(path, with_state=False)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                self._unreadable.add((path, info.st_mtime))
                self._skip(path, exc)
                continue
            with self._lock:
                self._add(DiskEntry(path, tokens, info.st_size, info.st_mtime, tenant))

    def _skip(self, path: Path, reason: Exception) -> None:
        logger.warning("prompt cache: skipping %s: %s", path.name, reason)
        self.stats.skipped += 1
        self._forget(path)

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._drop(path)

    # Every change of the entries goes through these two (lock held): the index and the totals follow.

    def _add(self, entry: DiskEntry) -> None:
        self._drop(entry.path)
        self._entries[entry.path] = entry
        self._index.add(entry.path, entry.tokens, entry.tenant)
        self.stats.entries, self.stats.bytes = len(self._entries), self.stats.bytes + entry.nbytes

    def _drop(self, path: Path) -> None:
        entry = self._entries.pop(path, None)
        if entry is None:
            return
        self._index.remove(path)
        self.stats.entries, self.stats.bytes = len(self._entries), self.stats.bytes - entry.nbytes
