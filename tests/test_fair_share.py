"""Accounts share the slots fairly and by priority, with preemption that resumes exactly;
per-account limits answer 429 with Retry-After; usage per account is kept across restarts."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server, wait_until
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


def stream(server, key: str, path: str, body: dict, decoding: threading.Event | None = None,
           choices: int = 1) -> tuple[dict[int, str], dict]:
    """A streamed request's text per choice and its usage; `decoding` is set once `choices` of
    its choices have sent text (past their prompts: a sequence in prefill is not preempted)."""
    texts: dict[int, str] = {}
    usage: dict = {}
    with httpx.stream("POST", f"{server.base_url}/{path}", headers=bearer(key), timeout=600,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
            if decoding is not None and sum(1 for text in texts.values() if text) >= choices:
                decoding.set()
    return texts, usage


def wait_for(event: threading.Event, future: concurrent.futures.Future) -> None:
    """Until `event` is set; a request that ends (or fails) first fails the test."""
    wait_until(lambda: event.is_set() or future.done(), timeout=300)
    if not event.is_set():
        future.result()  # raises what it raised
        pytest.fail("the request ended before it got to the state waited for")


def test_an_account_flooding_every_slot_does_not_keep_another_waiting(keyed):
    server, _, keys = keyed
    before = preemptions(server, keys["ops"])
    decoding = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Six long answers from one account: both slots, and four more waiting.
        flood = pool.submit(stream, server, keys["flood"], "completions", {
            "model": DEFAULT_MODEL, "prompt": [NUMBERS] * 6, "max_tokens": 200, "temperature": 0}, decoding, 2)
        wait_for(decoding, flood)  # both slots decoding
        small = chat(server, keys["small"], "Say hi.", 2)
        assert small.status_code == 200, small.text
        # First come, first served would have put it behind the four waiting answers.
        assert not flood.done()
        assert preemptions(server, keys["ops"]) > before
        texts, _ = flood.result()
    assert sorted(texts) == list(range(6))
    assert all(texts.values())


def test_a_preempted_answer_resumes_exactly_where_it_stopped(keyed):
    server, _, keys = keyed
    reference = chat(server, keys["urgent"], COUNTING, 120).json()
    assert reference["choices"][0]["finish_reason"] == "length"
    before = preemptions(server, keys["ops"])
    body = {"model": DEFAULT_MODEL, "max_tokens": 120, "temperature": 0,
            "messages": [{"role": "user", "content": COUNTING}]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Both slots busy with answers of priority 0, then an urgent request arrives.
        decoding = [threading.Event() for _ in range(2)]
        running = [pool.submit(stream, server, keys["urgent"], "chat/completions", body, event) for event in decoding]
        for event, future in zip(decoding, running):
            wait_for(event, future)
        urgent = chat(server, keys["urgent"], "Say hi.", 3, priority=-5)
        assert urgent.status_code == 200, urgent.text
        answers = [future.result() for future in running]
    assert preemptions(server, keys["ops"]) > before
    for texts, usage in answers:  # greedy, batch-invariant kernels: pausing changes nothing
        assert texts[0] == reference["choices"][0]["message"]["content"]
        assert usage["completion_tokens"] == reference["usage"]["completion_tokens"]


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
    keys = {name: create_key(db, name) for name in ("flood", "small", "ops")}
    assert keys_cli(db, "admin", "ops").returncode == 0
    with run_server("--slots", "1", "--ctx-size", "1024", "--max-queue", "1", log_dir=tmp_path,
                    env={"FASTRUN_KEYS_DB": str(db)}) as server:
        def load() -> tuple[float, float]:
            text = httpx.get(f"{server.root_url}/metrics", headers=bearer(keys["ops"]), timeout=30).text
            return (metric(text, "fastrun_num_requests_running", model=DEFAULT_MODEL),
                    metric(text, "fastrun_num_requests_waiting", model=DEFAULT_MODEL))

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            decoding = threading.Event()
            flood = pool.submit(stream, server, keys["flood"], "completions", {
                "model": DEFAULT_MODEL, "prompt": [NUMBERS] * 2, "max_tokens": 150, "temperature": 0}, decoding)
            wait_for(decoding, flood)  # its first answer runs, its second waits: every place is its
            more = chat(server, keys["flood"], "Say hi.", 1)
            assert more.status_code == 429  # all places are the flood's
            small = pool.submit(chat, server, keys["small"], "Say hi.", 2)
            wait_until(lambda: load()[1] >= 2 or small.done(), timeout=300)  # the small request waits too
            assert not small.done()
            again = chat(server, keys["flood"], "Say hi.", 1)
            assert again.status_code == 429
            assert "share" in again.json()["error"]["message"]
            assert small.result().status_code == 200  # in, though every place was taken
            texts, _ = flood.result()  # it streamed to its end (a failure raised)
            assert sorted(texts) == [0, 1] and all(texts.values())


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


def usage_row(db, account: str) -> dict[str, int]:
    listing = keys_cli(db, "usage", "--account", account, "--since", "2000-01-01")
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.strip().splitlines()[1:]]
    row = next((r for r in rows if r[0] == account), [account, "0", "0", "0", "0"])
    return dict(zip(("requests", "prompt", "cached", "completion"), map(int, row[1:])))


def completion(server, key: str, max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", headers=bearer(key), timeout=300, json={
        "model": DEFAULT_MODEL, "prompt": NUMBERS, "max_tokens": max_tokens, "temperature": 0, **extra})


def hold(server, key: str, held: list, ready: threading.Event, release: threading.Event) -> None:
    """Stream a long answer with `key` until told to stop (one request in flight)."""
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{server.base_url}/completions", headers=bearer(key), json={
                "model": DEFAULT_MODEL, "prompt": NUMBERS, "max_tokens": 900, "temperature": 0,
                "stream": True}) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            held.append(response.status_code)
            ready.set()
            release.wait(120)


def test_limits_hold_under_parallel_bursts(tmp_path):
    db = tmp_path / "keys.sqlite3"
    keys = {name: create_key(db, name) for name in ("tokens", "requests", "concurrent")}
    for command in (("limit", "tokens", "--tpm", "400"), ("limit", "requests", "--rpm", "5"),
                    ("limit", "concurrent", "--concurrent", "2")):
        assert keys_cli(db, *command).returncode == 0
    with run_server("--slots", "2", "--ctx-size", "1024", "--max-queue", "16", log_dir=tmp_path,
                    env={"FASTRUN_KEYS_DB": str(db)}) as server:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            # tpm: each request may use its prompt and max_tokens; what is in flight counts.
            burst = list(pool.map(lambda _: completion(server, keys["tokens"], 100), range(8)))
            served = [r for r in burst if r.status_code == 200]
            refused = [r for r in burst if r.status_code == 429]
            assert served and refused and len(served) + len(refused) == 8
            assert sum(r.json()["usage"]["total_tokens"] for r in served) <= 400
            assert all("tpm" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) >= 1 for r in refused)
            # rpm: exactly the limit gets in, however the burst interleaves.
            burst = list(pool.map(lambda _: completion(server, keys["requests"], 1), range(8)))
            assert sorted(r.status_code for r in burst) == [200] * 5 + [429] * 3
        # max_concurrent: two held streams, a third is refused, and gets in once one ends.
        held: list[int] = []
        release = threading.Event()
        holders = []
        for _ in range(2):
            ready = threading.Event()
            holders.append(threading.Thread(target=hold, args=(server, keys["concurrent"], held, ready, release)))
            holders[-1].start()
            assert ready.wait(120)
        try:
            third = completion(server, keys["concurrent"], 1)
            assert third.status_code == 429 and "max_concurrent" in third.json()["error"]["message"]
        finally:
            release.set()
            for holder in holders:
                holder.join()
        assert held == [200, 200]
        assert completion(server, keys["concurrent"], 1).status_code == 200


def test_usage_counts_requests_that_end_early(tmp_path):
    """A client that leaves mid-stream, and a request stopped at its time limit, are billed
    what they were served: the prompt and the tokens produced."""
    db = tmp_path / "keys.sqlite3"
    keys = {name: create_key(db, name) for name in ("leaver", "slow")}
    with run_server("--slots", "2", "--ctx-size", "1024", "--request-timeout-s", "2", log_dir=tmp_path,
                    env={"FASTRUN_KEYS_DB": str(db)}) as server:
        read = 0
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{server.base_url}/completions", headers=bearer(keys["leaver"]), json={
                    "model": DEFAULT_MODEL, "prompt": NUMBERS, "max_tokens": 900, "temperature": 0,
                    "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data:") and json.loads(line[5:])["choices"][0]["text"]:
                        read += 1
                    if read == 5:
                        break  # the client goes away
        timed_out = completion(server, keys["slow"], 900)
        assert timed_out.status_code == 504
        assert wait_until(lambda: server.busy_slots() == 0, timeout=60)
        server.process.terminate()  # usage is flushed at exit
        assert server.process.wait(timeout=60) == 0
    prompt = len(NUMBERS.split(",")) * 2  # at least a token per number and per comma
    leaver, slow = usage_row(db, "leaver"), usage_row(db, "slow")
    assert leaver["requests"] == 1 and leaver["prompt"] >= prompt // 2 and leaver["completion"] >= 5
    assert slow["requests"] == 1 and slow["prompt"] >= prompt // 2


def test_embedding_jobs_take_turns_by_account(tmp_path):
    """A long list of one account's inputs does not keep another account's short job waiting:
    jobs are taken in the fair share's order at each input's end."""
    db = tmp_path / "keys.sqlite3"
    keys = {name: create_key(db, name) for name in ("bulk", "quick")}
    with run_server("--slots", "1", "--ctx-size", "1024", "--batch-size", "64", log_dir=tmp_path,
                    env={"FASTRUN_KEYS_DB": str(db)}) as server:
        def embed(key: str, inputs: list[str]) -> httpx.Response:
            return httpx.post(f"{server.base_url}/embeddings", headers=bearer(key), timeout=600,
                              json={"model": DEFAULT_MODEL, "input": inputs})

        record = "the shipment of crates left the harbour at dawn and reached the northern warehouse by noon"
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bulk = pool.submit(embed, keys["bulk"], [f"{i}: {record}" for i in range(48)])
            # The bulk job is in the engine (an embedding job holds no slot: it counts as waiting).
            assert wait_until(lambda: server.health()["models"][DEFAULT_MODEL]["waiting"] >= 1, timeout=120)
            quick = embed(keys["quick"], ["hello"])
            assert quick.status_code == 200
            assert not bulk.done()  # answered in the middle of the other account's list
            assert bulk.result().status_code == 200

