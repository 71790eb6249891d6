"""A stand-in for the Hugging Face Hub on loopback: the routes huggingface-hub uses to list
and download files (`/api/models/<repo>/tree/<rev>`, `/<repo>/resolve/<rev>/<file>`), served
from a directory, with byte ranges, error codes, an optional cut-off to test resuming, and two
liars: a file whose HEAD claims a size it does not have, and one whose GET never ends."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut_after: dict[str, int] = {}  # file name -> bytes to send before hanging up (once)
        self.claimed_size: dict[str, int] = {}  # file name -> the size HEAD says it has
        self.endless: set[str] = set()  # file names whose GET sends zeros, with no length, until the client leaves
        self.trickling: set[str] = set()  # file names whose GET sends a byte every 0.2 s (60 s at most)
        self.url = ""

    def add(self, repo: str, name: str, source: Path, *, revision: str = "main") -> None:
        """`source` as `name` in `repo` at `revision` (a branch or tag other than main has its own files)."""
        target = self.root / repo / ("" if revision == "main" else f"@{revision}") / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source.resolve())

    def add_bytes(self, repo: str, name: str, data: bytes) -> None:
        target = self.root / repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def gets(self, name: str) -> list[str | None]:
        """Range headers of the GETs of a file (None: the whole file)."""
        return [r for method, path, r in self.requests if method == "GET" and path.endswith("/" + name)]


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and "tree" in parts:
                tree = parts.index("tree")
                repo_dir = hub.root / "/".join(parts[2:tree])
                if not repo_dir.is_dir():
                    return self._error(404, "RepoNotFound")
                revision = parts[tree + 1] if len(parts) > tree + 1 else "main"
                files = repo_dir if revision == "main" else repo_dir / f"@{revision}"
                listing = [{"type": "file", "path": f.name, "size": f.stat().st_size, "oid": "0" * 40}
                           for f in sorted(files.iterdir()) if f.is_file()] if files.is_dir() else []
                data = json.dumps(listing).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)
                return
            if "resolve" not in parts:
                return self._error(404, "RepoNotFound")
            marker = parts.index("resolve")
            repo, revision, filename = "/".join(parts[:marker]), parts[marker + 1], "/".join(parts[marker + 2:])
            if repo.split("/")[-1].startswith("gated"):
                return self._error(401, "GatedRepo")
            repo_dir = hub.root / repo
            if not repo_dir.is_dir():
                return self._error(404, "RepoNotFound")
            file = (repo_dir if revision == "main" else repo_dir / f"@{revision}") / filename
            # Each revision its own commit, as the Hub's cache keeps them apart (refs/<revision>).
            self.commit = COMMIT if revision == "main" else hashlib.sha1(revision.encode()).hexdigest()
            if not file.is_file():
                return self._error(404, "EntryNotFound")
            data = file.read_bytes()
            start = 0
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes="):
                start = int(ranged[len("bytes="):].split("-")[0])
            if body and filename in hub.endless:
                return self._endless()
            if body and filename in hub.trickling:
                return self._trickle(data)
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", self.commit)
            self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            self.send_header("Accept-Ranges", "bytes")
            claimed = hub.claimed_size.get(filename) if not body else None
            self.send_header("Content-Length", str(claimed if claimed is not None else len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            cut = hub.cut_after.pop(filename, None)
            if cut is not None:
                self.wfile.write(data[start:start + cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        def _trickle(self, data: bytes) -> None:
            """A download that stays in progress: its length said, a byte every 0.2 s."""
            self.send_response(200)
            self.send_header("X-Repo-Commit", self.commit)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.close_connection = True
            try:
                for index in range(min(len(data), 300)):
                    self.wfile.write(data[index:index + 1])
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:  # the client left
                pass

        def _endless(self) -> None:
            self.send_response(200)
            self.send_header("X-Repo-Commit", self.commit)
            self.send_header("ETag", '"endless"')
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            chunk = bytes(64 * 1024)
            try:
                while True:
                    self.wfile.write(chunk)
            except OSError:  # the client stopped reading
                pass

    return Handler


@contextmanager
def fake_hub(root: Path) -> Iterator[FakeHub]:
    hub = FakeHub(root)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
