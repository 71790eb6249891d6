"""The spec's error semantics under load and failure: 429, 503, 502, time limits, body limits."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server, wait_until
from tests.test_observability import generated_tokens

COUNTING = {"model": DEFAULT_MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1500, "temperature": 0}
SHORT = {"model": DEFAULT_MODEL, "prompt": "Hello", "max_tokens": 3}


def assert_spec_error(response: httpx.Response, status: int, error_type: str, *, retry_after: bool) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error == {"message": error["message"], "type": error_type, "code": status}
    if retry_after:
        assert int(response.headers["retry-after"]) >= 1
    return error


def hold_stream(base_url: str, started: threading.Event, stop: threading.Event) -> None:
    """Stream a long answer until told to stop (occupies a slot or a queue place)."""
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{base_url}/completions", json={**COUNTING, "stream": True}) as response:
            lines = response.iter_lines()  # kept referenced: a dropped iterator closes the stream
            while not next(lines).startswith("data:"):
                pass
            started.set()
            stop.wait(30)


@pytest.fixture(scope="module")
def tiny_queue(tmp_path_factory):
    with run_server("--slots", "1", "--max-queue", "1", "--ctx-size", "2048",
                    log_dir=tmp_path_factory.mktemp("logs")) as server:
        yield server


def test_full_slots_and_queue_answer_429_with_retry_after(tiny_queue):
    server = tiny_queue
    stop = threading.Event()
    running = threading.Event()
    holders = [threading.Thread(target=hold_stream, args=(server.base_url, running, stop))]
    holders[0].start()
    assert running.wait(30)
    # The second request waits in the one-place queue (no data flows to it yet).
    # Bounds here are for a hung server only: on a busy machine the queued request may take minutes.
    waiting = threading.Thread(target=lambda: httpx.post(f"{server.base_url}/completions", json=COUNTING, timeout=600))
    waiting.start()
    deadline = time.monotonic() + 300
    while server.health()["models"][DEFAULT_MODEL]["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        error = assert_spec_error(httpx.post(f"{server.base_url}/completions", json=SHORT), 429,
                                  "rate_limit_error", retry_after=True)
        assert error["message"] == "all backends for this model are at capacity"
        stream = httpx.post(f"{server.base_url}/chat/completions", json={
            "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert_spec_error(stream, 429, "rate_limit_error", retry_after=True)
        assert "rate_limit_error" in httpx.get(f"{server.root_url}/metrics").text
    finally:
        stop.set()
        holders[0].join()
        httpx.post(f"{server.base_url}/completions", json={**SHORT}, timeout=600)  # drains behind the queued one
        waiting.join(timeout=600)
    assert httpx.post(f"{server.base_url}/completions", json=SHORT, timeout=600).status_code == 200


def test_503_while_loading_past_the_load_wait_then_ready(tmp_path):
    """A request for a model still loading waits --load-wait-s for it, then gets a 503 with
    Retry-After (the load goes on); once loaded, it is answered. (Waiting requests sharing one
    load: tests/test_model_lifecycle.py.)"""
    with run_server("--debug-faults", "load-delay=20", "--load-wait-s", "1", "--slots", "1", "--ctx-size", "256",
                    log_dir=tmp_path, wait_until="/health") as server:
        ready = httpx.get(f"{server.root_url}/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "not ready"}
        assert server.health()["models"][DEFAULT_MODEL]["state"] == "loading"
        error = assert_spec_error(httpx.post(f"{server.base_url}/completions", json=SHORT, timeout=60), 503,
                                  "unavailable", retry_after=True)
        assert "loading" in error["message"]
        assert wait_until(lambda: httpx.get(f"{server.root_url}/ready").status_code == 200, 900)  # a hang guard
        assert httpx.post(f"{server.base_url}/completions", json=SHORT, timeout=600).status_code == 200


def test_model_that_fails_to_load_is_503_and_not_ready(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 4096)
    with run_server("--model", str(broken), log_dir=tmp_path, wait_until="/health") as server:
        assert wait_until(lambda: server.health()["models"]["broken"]["state"] != "loading", 600)
        assert httpx.get(f"{server.root_url}/ready").status_code == 503
        body = {**SHORT, "model": "broken"}
        error = assert_spec_error(httpx.post(f"{server.base_url}/completions", json=body), 503, "unavailable",
                                  retry_after=True)
        assert "failed to load" in error["message"]


def test_engine_failure_is_502_and_the_engine_recovers(tmp_path):
    # The 1st llama_decode fails; the 2nd request must then be answered normally.
    with run_server("--debug-faults", "decode-fail=1", "--slots", "2", "--ctx-size", "512", log_dir=tmp_path) as server:
        failed = httpx.post(f"{server.base_url}/completions", json={**SHORT, "temperature": 0})
        assert_spec_error(failed, 502, "upstream_error", retry_after=True)
        ok = httpx.post(f"{server.base_url}/completions", json={**SHORT, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert server.busy_slots() == 0


def test_engine_failure_mid_stream_ends_with_an_error_event(tmp_path):
    with run_server("--debug-faults", "decode-fail=8", "--slots", "1", "--ctx-size", "512", log_dir=tmp_path) as server:
        body = {**COUNTING, "max_tokens": 50, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        last = json.loads(events[-1])
        assert last["error"]["type"] == "upstream_error" and last["error"]["code"] == 502
        assert any(json.loads(e).get("choices") for e in events[:-1])  # it had started
        again = httpx.post(f"{server.base_url}/completions", json=SHORT, timeout=60)
        assert again.status_code == 200


def test_time_limits_stop_requests_and_free_their_slots(tmp_path):
    with run_server("--request-timeout-s", "1.5", "--stream-timeout-s", "1.5", "--slots", "1",
                    "--ctx-size", "2048", log_dir=tmp_path) as server:
        response = httpx.post(f"{server.base_url}/completions", json=COUNTING, timeout=60)
        error = assert_spec_error(response, 504, "upstream_error", retry_after=False)
        assert "time limit" in error["message"]
        # The answer goes out at the deadline; the engine drops the request at its next step,
        # long before its 1500 tokens are done, however slow the machine.
        assert wait_until(lambda: server.busy_slots() == 0, timeout=120)
        assert generated_tokens(server) < COUNTING["max_tokens"] / 2
        with httpx.stream("POST", f"{server.base_url}/completions", json={**COUNTING, "stream": True},
                          timeout=60) as stream:
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1])["error"]["code"] == 504
        assert wait_until(lambda: server.busy_slots() == 0, timeout=120)
        assert generated_tokens(server) < COUNTING["max_tokens"]  # both cut short


def test_body_over_64_mib_is_413(server):
    too_big = 64 * 2**20 + 1

    def body():
        chunk = b" " * 2**20
        for _ in range(too_big // len(chunk) + 1):
            yield chunk

    response = httpx.post(f"{server.base_url}/completions", content=body(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"] == {"message": response.json()["error"]["message"],
                                        "type": "invalid_request_error", "code": 413}


def test_declared_oversized_body_is_refused_before_it_is_sent(server):
    """A Content-Length over the limit is answered at once: nothing of the body is read."""
    host, port = server.root_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {64 * 2**20 + 1}\r\n\r\n".encode()
        )
        reply = ""
        while "}}" not in reply:  # headers and body may come in separate segments
            data = connection.recv(65536)
            if not data:
                break
            reply += data.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply
    assert '"code":413' in reply


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe{\"model\": 1}", b"[" * 100000 + b"]" * 100000, b'{"model": "' + b"\xc3\x28" + b'"}', b"\x00\x01"],
    ids=["bad-utf8-bom", "deep-nesting", "invalid-utf8", "binary"],
)
def test_malformed_bodies_are_400(server, content):
    response = httpx.post(f"{server.base_url}/chat/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_request_of_128_choices_never_holds_up_the_queue(tmp_path):
    """n beyond the slots runs in waves on whatever slots are free: the small requests sent
    after it are answered while one slot is held by a stream that has not ended."""
    with run_server("--slots", "2", "--ctx-size", "1024", log_dir=tmp_path) as server:
        stop, running = threading.Event(), threading.Event()
        holder = threading.Thread(target=hold_stream, args=(server.base_url, running, stop))
        holder.start()
        try:
            assert running.wait(60)
            wide: dict[str, httpx.Response] = {}
            sender = threading.Thread(target=lambda: wide.update(response=httpx.post(
                f"{server.base_url}/completions", json={**SHORT, "n": 128, "max_tokens": 2}, timeout=300)))
            sender.start()
            assert wait_until(lambda: server.health()["models"][DEFAULT_MODEL]["waiting"] >= 1, timeout=30)
            for _ in range(3):
                small = httpx.post(f"{server.base_url}/completions", json=SHORT, timeout=120)
                assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] >= 1
            assert holder.is_alive() and not stop.is_set()  # the held slot never came free
        finally:
            stop.set()
            holder.join()
        sender.join()
        answer = wide["response"]
        assert answer.status_code == 200, answer.text
        assert sorted(choice["index"] for choice in answer.json()["choices"]) == list(range(128))


def test_choices_that_end_at_their_first_token_all_answer(server):
    response = httpx.post(f"{server.base_url}/completions", json={**SHORT, "n": 4, "max_tokens": 1}, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert sorted(choice["index"] for choice in body["choices"]) == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 4
    assert server.busy_slots() == 0 or wait_until(lambda: server.busy_slots() == 0, timeout=30)
