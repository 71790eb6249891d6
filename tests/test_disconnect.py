"""A client that goes away frees its slot at the next decode step."""

from __future__ import annotations


import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server, wait_until
from tests.test_observability import generated_tokens

# The default model keeps counting for as long as it is allowed to: a long generation.
COUNTING = {"model": DEFAULT_MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 2000, "temperature": 0}


@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory):
    with run_server("--slots", "1", "--ctx-size", "2048", log_dir=tmp_path_factory.mktemp("logs")) as server:
        yield server


def test_stream_disconnect_frees_the_slot(one_slot_server):
    server = one_slot_server
    before = generated_tokens(server)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/completions", json={**COUNTING, "stream": True}) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(10)]
            assert any(line.startswith("data: ") for line in received)
            assert server.busy_slots() == 1
        # The slot frees at the next step: long before the 2000-token answer is done, however
        # slow the machine (the wait is for the state; what was generated says why it came).
        assert wait_until(lambda: server.busy_slots() == 0, timeout=120)
        assert generated_tokens(server) - before < COUNTING["max_tokens"] / 2
        # And the one slot serves the next request.
        answer = http.post("/completions", json={**COUNTING, "max_tokens": 4}).json()
        assert answer["usage"]["completion_tokens"] == 4


def test_an_abandoned_answer_counts_the_tokens_it_generated(one_slot_server):
    # fastrun_engine_generated_tokens counts the engines' work, the choices nobody read to the end too.
    server = one_slot_server
    before = generated_tokens(server)
    with httpx.stream("POST", f"{server.base_url}/completions", json={**COUNTING, "stream": True},
                      timeout=60) as response:
        lines = response.iter_lines()
        received = [line for line in (next(lines) for _ in range(20)) if line.startswith("data: {")]
    assert wait_until(lambda: server.busy_slots() == 0, timeout=60)
    assert received and generated_tokens(server) - before >= len(received)


def test_non_streamed_disconnect_frees_the_slot(one_slot_server):
    server = one_slot_server
    before = generated_tokens(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=COUNTING, timeout=1.0)
    assert wait_until(lambda: server.busy_slots() == 0, timeout=120)
    assert generated_tokens(server) - before < COUNTING["max_tokens"] / 2  # cut short, not finished


def test_queued_request_waits_for_the_slot_and_is_served(one_slot_server):
    server = one_slot_server
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/completions", json={**COUNTING, "stream": True}) as first:
            lines = first.iter_lines()  # keep a reference: a dropped iterator closes the stream
            assert next(lines).startswith("data: ")
            with httpx.Client(base_url=server.base_url, timeout=60) as other:
                # A second request queues behind the first; leaving the queue also works.
                with pytest.raises(httpx.ReadTimeout):
                    other.post("/completions", json={**COUNTING, "max_tokens": 3}, timeout=0.5)
            # It left the queue while the first answer still holds the slot.
            assert wait_until(lambda: server.health()["models"][DEFAULT_MODEL]["waiting"] == 0, timeout=60)
            assert server.health()["models"][DEFAULT_MODEL]["busy_slots"] == 1
            line = next(line for line in lines if line)  # the first answer still streams
            assert line.startswith("data: {") and '"finish_reason":null' in line.replace(" ", "")
        assert wait_until(lambda: server.health()["models"][DEFAULT_MODEL]["waiting"] == 0
                          and server.busy_slots() == 0, timeout=5)
        answer = http.post("/completions", json={**COUNTING, "max_tokens": 3}).json()
        assert answer["usage"]["completion_tokens"] == 3
