"""Start a real fastrun-cpp server process on a free port, for end-to-end tests and benches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    def __init__(self, process: subprocess.Popen, base_url: str, log_path: Path) -> None:
        self.process = process
        self.base_url = base_url  # ends in /v1
        self.root_url = base_url.removesuffix("/v1")
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, key: str | None = None) -> dict:
        """/health; with keys on, its counters need an admin `key`."""
        headers = {"Authorization": f"Bearer {key}"} if key else None
        return httpx.get(f"{self.root_url}/health", headers=headers, timeout=5).json()

    def busy_slots(self, model: str = DEFAULT_MODEL) -> int:
        return self.health()["models"][model]["busy_slots"]


def models_file(path: Path, entries: list[dict]) -> Path:
    """A registry (`--models-file`) at `path` listing `entries`, one [[models]] table each."""
    lines = []
    for entry in entries:
        lines.append("[[models]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in entry.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def run_server(*args: str, log_dir: Path, env: dict[str, str] | None = None,
               startup_timeout: float = 60, wait_until: str = "/ready") -> Iterator[RunningServer]:
    """A server process; by default its own empty key store, and waited for until `/ready`."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    command = [sys.executable, "-m", "fastrun_cpp", "serve", "--port", str(port), *args]
    environment = {**os.environ, "FASTRUN_KEYS_DB": str(log_dir / f"keys-{port}.sqlite3"),
                   "FASTRUN_PROMPT_CACHE_DIR": str(log_dir / f"prompt-cache-{port}"), **(env or {})}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=environment)
    server = RunningServer(process, f"http://127.0.0.1:{port}/v1", log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
            try:
                if httpx.get(f"{server.root_url}{wait_until}", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in {startup_timeout}s:\n{server.log()}")
            time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether `predicate` became true within `timeout` seconds (polled): tests wait for a state,
    never for a fixed time."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
