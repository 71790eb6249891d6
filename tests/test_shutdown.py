"""SIGTERM: stop accepting, let running requests finish within the grace period, exit 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server, wait_until


@pytest.mark.timeout(1800)
def test_sigterm_drains_running_streams_and_exits_zero(tmp_path):
    body = {"model": DEFAULT_MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 300, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    started = threading.Event()

    with run_server("--slots", "2", "--ctx-size", "1024", "--shutdown-grace-s", "1800", log_dir=tmp_path) as server:
        def stream() -> None:
            with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        server.process.send_signal(signal.SIGTERM)

        def refusing() -> bool:
            try:
                return httpx.get(f"{server.root_url}/health", timeout=2).status_code >= 500
            except httpx.HTTPError:
                return True

        # No new work is taken once draining has begun.
        refused = wait_until(refusing, timeout=60)
        reader.join(timeout=1800)  # the grace outlasts the stream on any machine: it is drained, not cut
        assert server.process.wait(timeout=1800) == 0
    assert refused
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 300
