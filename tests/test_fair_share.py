"""Accounts share the slots fairly and by priority, with preemption that resumes exactly;
per-account limits answer 429 with Retry-After; usage per account is kept across restarts."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server
from tests.test_keys import bearer, create_key, keys_cli
from tests.test_observability import metric

COUNTING = "Count from 1 to 300, separated by commas, and nothing else."
NUMBERS = ", ".join(str(number) for number in range(1, 21)) + ","  # a completion prompt that goes on and on


def preemptions(server, admin_key: str) -> float:
    text = httpx.get(f"{server.root_url}/metrics", headers=bearer(admin_key), timeout=30).text
    return metric(text, "fastrun_engine_preemptions_total", model=DEFAULT_MODEL)


def chat(server, key: str, content: str, max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", headers=bearer(key), timeout=300, json={
        "model": DEFAULT_MODEL, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": content}], **extra})


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fair")
    db = directory / "keys.sqlite3"
    keys = {name: create_key(db, name) for name in ("flood", "small", "urgent", "ops", "limited")}
    for command in (("admin", "ops"), ("priority", "urgent", "-5"), ("limit", "limited", "--rpm", "2")):
        assert keys_cli(db, *command).returncode == 0
    with run_server("--slots", "2", "--ctx-size", "1024", "--max-queue", "6", "--keys-refresh-s", "0.5",
                    log_dir=directory, env={"FASTRUN_KEYS_DB": str(db)}) as server:
        yield server, db, keys


def test_an_account_flooding_every_slot_does_not_keep_another_waiting(keyed):
    server, _, keys = keyed
    before = preemptions(server, keys["ops"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Six long answers from one account: both slots, and four more waiting.
        flood = pool.submit(httpx.post, f"{server.base_url}/completions", headers=bearer(keys["flood"]), timeout=600,
                            json={"model": DEFAULT_MODEL, "prompt": [NUMBERS] * 6, "max_tokens": 200,
                                  "temperature": 0})
        deadline = time.monotonic() + 60
        while metric(httpx.get(f"{server.root_url}/metrics", headers=bearer(keys["ops"])).text,
                     "fastrun_num_requests_running", model=DEFAULT_MODEL) < 2:
            assert time.monotonic() < deadline and not flood.done()
            time.sleep(0.05)
        time.sleep(0.5)  # both past their prompts: decoding (a sequence in prefill is not preempted)
        small = chat(server, keys["small"], "Say hi.", 2)
        assert small.status_code == 200, small.text
        # First come, first served would have put it behind the four waiting answers.
        assert not flood.done()
        assert preemptions(server, keys["ops"]) > before
        answer = flood.result()
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 6
    assert all(choice["text"] for choice in answer.json()["choices"])


def test_a_preempted_answer_resumes_exactly_where_it_stopped(keyed):
    server, _, keys = keyed
    reference = chat(server, keys["urgent"], COUNTING, 120).json()
    assert reference["choices"][0]["finish_reason"] == "length"
    before = preemptions(server, keys["ops"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Both slots busy with answers of priority 0, then an urgent request arrives.
        running = [pool.submit(chat, server, keys["urgent"], COUNTING, 120) for _ in range(2)]
        deadline = time.monotonic() + 60
        while metric(httpx.get(f"{server.root_url}/metrics", headers=bearer(keys["ops"])).text,
                     "fastrun_num_requests_running", model=DEFAULT_MODEL) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # both are decoding
        urgent = chat(server, keys["urgent"], "Say hi.", 3, priority=-5)
        assert urgent.status_code == 200, urgent.text
        answers = [future.result().json() for future in running]
    assert preemptions(server, keys["ops"]) > before
    for answer in answers:  # greedy, batch-invariant kernels: pausing changes nothing
        assert answer["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]


def test_a_key_asks_for_no_more_urgent_priority_than_it_may(keyed):
    server, _, keys = keyed
    refused = chat(server, keys["small"], "Say hi.", 2, priority=-1)
    assert refused.status_code == 400
    assert "priority" in refused.json()["error"]["message"]
    assert chat(server, keys["small"], "Say hi.", 2, priority=3).status_code == 200  # less urgent is fine
    assert chat(server, keys["urgent"], "Say hi.", 2, priority=-5).status_code == 200
    for bad in ("high", 10**7, 1.5):
        response = chat(server, keys["urgent"], "Say hi.", 2, priority=bad)
        assert response.status_code == 400, (bad, response.text)


def test_an_account_over_its_rate_limit_gets_429_and_others_do_not(keyed):
    server, _, keys = keyed
    statuses = [chat(server, keys["limited"], "Say hi.", 1) for _ in range(3)]
    assert [r.status_code for r in statuses[:2]] == [200, 200]
    over = statuses[2]
    assert over.status_code == 429
    assert over.json()["error"]["type"] == "rate_limit_error"
    assert "rpm" in over.json()["error"]["message"]
    assert 1 <= int(over.headers["Retry-After"]) <= 60
    assert chat(server, keys["small"], "Say hi.", 1).status_code == 200


def test_the_429_for_a_full_queue_goes_to_the_account_over_its_share(tmp_path):
    db = tmp_path / "keys.sqlite3"
    keys = {name: create_key(db, name) for name in ("flood", "small")}
    with run_server("--slots", "1", "--ctx-size", "1024", "--max-queue", "1", log_dir=tmp_path,
                    env={"FASTRUN_KEYS_DB": str(db)}) as server:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            flood = pool.submit(httpx.post, f"{server.base_url}/completions", headers=bearer(keys["flood"]),
                                timeout=600, json={"model": DEFAULT_MODEL, "prompt": [NUMBERS] * 2,
                                                   "max_tokens": 150, "temperature": 0})
            time.sleep(0.5)
            more = chat(server, keys["flood"], "Say hi.", 1)
            assert more.status_code == 429  # all places are the flood's
            small = pool.submit(chat, server, keys["small"], "Say hi.", 2)
            time.sleep(0.3)
            again = chat(server, keys["flood"], "Say hi.", 1)
            assert again.status_code == 429
            assert "share" in again.json()["error"]["message"]
            assert small.result().status_code == 200  # in, though every place was taken
            assert flood.result().status_code == 200


def test_usage_per_account_is_kept_across_restarts(tmp_path):
    db = tmp_path / "keys.sqlite3"
    key = create_key(db, "counted")
    with run_server("--slots", "1", "--ctx-size", "1024", log_dir=tmp_path, env={"FASTRUN_KEYS_DB": str(db)}) as server:
        usages = [chat(server, key, "Say hi.", 3).json()["usage"] for _ in range(3)]
        server.process.terminate()
        assert server.process.wait(timeout=60) == 0
    listing = keys_cli(db, "usage", "--account", "counted", "--since", "2000-01-01")
    assert listing.returncode == 0, listing.stderr
    row = listing.stdout.strip().splitlines()[-1].split()
    assert row[0] == "counted"
    assert int(row[1]) == 3
    assert int(row[2]) == sum(u["prompt_tokens"] for u in usages)
    assert int(row[4]) == sum(u["completion_tokens"] for u in usages)
    future = keys_cli(db, "usage", "--since", "2999-01-01")
    assert "counted" not in future.stdout
    assert keys_cli(db, "usage", "--since", "yesterday").returncode != 0
