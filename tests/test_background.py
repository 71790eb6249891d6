"""Background responses (`background: true`) with the OpenAI SDK against the real server:
queued at once, run behind interactive work, retrieved, streamed again from any event,
cancelled, and finished after a kill -9."""

from __future__ import annotations

import concurrent.futures
import json
import sqlite3
from contextlib import closing

import httpx
import openai
import pytest

from fastrun_cpp.default_model import embedded_model_path
from tests.server import DEFAULT_MODEL, models_file, run_server, wait_until
from tests.test_keys import bearer, create_key, keys_cli
from tests.test_batches import busy_slots, client, server  # noqa: F401 (fixtures: a server of this module's own)
from tests.test_batches import finished, upload

QUESTION = "Name three rivers."


def settled(client: openai.OpenAI, response_id: str, timeout: float = 600):
    response = None

    def done() -> bool:
        nonlocal response
        response = client.responses.retrieve(response_id)
        return response.status not in ("queued", "in_progress")

    assert wait_until(done, timeout), response
    return response


def test_a_background_response_is_queued_then_answered_as_a_direct_one(client):
    queued = client.responses.create(model=DEFAULT_MODEL, input=QUESTION, background=True, max_output_tokens=24,
                                     temperature=0, metadata={"job": "rivers"})
    assert queued.status in ("queued", "in_progress") and queued.background and queued.output == []
    response = settled(client, queued.id)
    assert response.status == "incomplete" or response.status == "completed", response
    assert response.background and response.metadata == {"job": "rivers"}
    direct = client.responses.create(model=DEFAULT_MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    assert response.output_text == direct.output_text and response.output_text
    assert response.usage.output_tokens == direct.usage.output_tokens
    # Its events, replayed from any point: numbered on from there, the text whole at the end.
    events = list(client.responses.retrieve(queued.id, stream=True, starting_after=-1))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{response.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    later = list(client.responses.retrieve(queued.id, stream=True, starting_after=3))
    assert [event.sequence_number for event in later] == list(range(4, len(events)))
    # It continues like any stored response.
    follow_up = client.responses.create(model=DEFAULT_MODEL, previous_response_id=queued.id, input="And one more?",
                                        max_output_tokens=8, temperature=0)
    assert follow_up.status in ("completed", "incomplete")


def test_a_stream_left_early_is_picked_up_where_it_was_left(client):
    stream = client.responses.create(model=DEFAULT_MODEL, input="Count from one to fifty in words.", background=True,
                                     stream=True, max_output_tokens=64, temperature=0)
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 5:
            break
    stream.close()  # the client leaves: the work goes on
    response_id = seen[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == settled(client, response_id).output_text and text


def test_a_queued_background_response_is_cancelled(client, server, busy_slots):  # noqa: F811
    queued = client.responses.create(model=DEFAULT_MODEL, input=QUESTION, background=True, max_output_tokens=16)
    assert client.responses.retrieve(queued.id).status == "queued"  # behind the interactive streams
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: as it is
    events = list(client.responses.retrieve(queued.id, stream=True))
    assert all(event.type != "response.completed" for event in events)


def test_background_requests_that_cannot_be_served_get_4xx(client):
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model=DEFAULT_MODEL, input=QUESTION, background=True, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no/such-model", input=QUESTION, background=True)
    with pytest.raises(openai.BadRequestError):  # its own errors come now, not as a failed job
        client.responses.create(model=DEFAULT_MODEL, input=QUESTION, background=True, temperature=9)
    plain = client.responses.create(model=DEFAULT_MODEL, input=QUESTION, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.BadRequestError, match="background"):
        list(client.responses.retrieve(plain.id, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


def test_a_background_response_finishes_after_kill_9(tmp_path):
    env = {"FASTRUN_KEYS_DB": str(tmp_path / "keys.sqlite3"), "FASTRUN_PROMPT_CACHE_DIR": str(tmp_path / "cache")}
    arguments = ("--slots", "2", "--ctx-size", "1024")
    request = dict(model=DEFAULT_MODEL, input="Count from one to two hundred, in words.", max_output_tokens=160,
                   temperature=0)
    with run_server(*arguments, log_dir=tmp_path, env=env) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        # Killed at its first word, seen on its own stream: polling for "in_progress" could miss
        # a short answer's whole run on a fast machine, and wait for a state that has passed.
        with client.responses.create(background=True, stream=True, **request) as stream:
            events = iter(stream)
            response_id = next(events).response.id
            assert any(event.type == "response.output_text.delta" for event in events)
            server.process.kill()
            server.process.wait()
    with run_server(*arguments, log_dir=tmp_path, env=env) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        response = settled(client, response_id)
        assert response.status in ("completed", "incomplete"), response
        assert response.output_text == client.responses.create(**request).output_text


@pytest.fixture(scope="module")
def babble(tmp_path_factory, tiny_model_path):
    """A server of a random 2-layer model (long answers: a background job that is still running
    when the test acts), and two batches or background responses at once per account."""
    directory = tmp_path_factory.mktemp("babble")
    models = models_file(directory / "models.toml", [
        {"id": "babble", "path": str(tiny_model_path), "slots": 2, "ctx_size": 8192, "prompt_cache_mib": 64}])
    with run_server("--models-file", str(models), "--batches-per-account", "2", log_dir=directory) as running:
        yield running


# `ignore_eos`: a sampled answer of random weights ends at a random token now and then.
LONG = {"model": "babble", "input": "Go on.", "background": True, "max_output_tokens": 8000, "ignore_eos": True}


def test_a_deleted_background_response_stops_and_stays_deleted(babble):
    """A DELETE while its job runs stops the job; the job's end never stores it again (it did:
    the finished stream wrote the response back, so a deleted response came back)."""
    with httpx.Client(base_url=babble.base_url, timeout=60) as http:
        created = http.post("/responses", json=LONG).json()
        assert wait_until(lambda: http.get(f"/responses/{created['id']}").json()["status"] == "in_progress", 60)
        assert http.delete(f"/responses/{created['id']}").json()["deleted"] is True
        assert wait_until(lambda: babble.busy_slots("babble") == 0, 60), "the deleted job kept its slot"
        assert http.get(f"/responses/{created['id']}").status_code == 404
        assert http.get(f"/responses/{created['id']}", params={"stream": "true"}).status_code == 404


def test_requests_sent_together_cannot_pass_the_accounts_cap(babble):
    """The cap on an account's background responses and batches is checked and taken in one
    store transaction: six sent at once get two places and four 429s (a check made before the
    insert, with awaits between, let all six through)."""
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/responses", "body": {**LONG, "background": False}})

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{babble.base_url}{path}", json=body, timeout=60)

    with httpx.Client(base_url=babble.base_url, timeout=60) as http:
        file_id = http.post("/files", files={"file": ("lines.jsonl", line.encode())}, data={"purpose": "batch"}).json()["id"]
        batch = {"input_file_id": file_id, "endpoint": "/v1/responses", "completion_window": "24h"}
        for path, body in (("/responses", LONG), ("/batches", batch)):
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(lambda _: post(path, body), range(6)))
            statuses = sorted(answer.status_code for answer in answers)
            assert statuses == [200, 200, 429, 429, 429, 429], (path, statuses)
            for answer in answers:
                if answer.status_code == 200:
                    http.post(f"{path}/{answer.json()['id']}/cancel")


def test_jobs_whose_model_cannot_load_wait_out_of_turn(tmp_path):
    """Background jobs naming a model that fails to load are refused (503) and tried again later;
    they wait without holding one of the places jobs run in, so a job of a model that loads runs
    meanwhile (the three places were held through the waits: every later job stalled)."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(4096))
    models = models_file(tmp_path / "models.toml", [
        {"id": "smol", "path": str(embedded_model_path()), "slots": 2, "ctx_size": 1024, "prompt_cache_mib": 64},
        {"id": "broken", "path": str(broken), "slots": 1, "ctx_size": 1024, "preload": False}])
    with run_server("--models-file", str(models), log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        stuck = [client.responses.create(model="broken", input="Hi.", background=True, max_output_tokens=4)
                 for _ in range(3)]  # as many as run at once (the slots of both models)
        assert wait_until(lambda: "broken" in server.log() and "load" in server.log(), 60)
        done = settled(client, client.responses.create(model="smol", input=QUESTION, background=True,
                                                       max_output_tokens=8).id, timeout=120)
        assert done.status in ("completed", "incomplete") and done.output_text
        assert all(client.responses.retrieve(job.id).status == "queued" for job in stuck)  # still tried again
        for job in stuck:
            assert client.responses.cancel(job.id).status == "cancelled"


def test_a_background_job_runs_within_its_accounts_limits(tmp_path, tiny_model_path):
    """A job runs as a request of its account: it takes one of the account's max_concurrent
    places while it runs (it took none, so a key limited to one request at a time had two
    running), and other accounts are not held by it. Its cancel gets through while that place is
    taken (a cancel was refused by the limit of the very job it stops)."""
    db = tmp_path / "keys.sqlite3"
    keys = {name: create_key(db, name) for name in ("alice", "bob")}
    assert keys_cli(db, "limit", "alice", "--concurrent", "1").returncode == 0
    models = models_file(tmp_path / "models.toml", [
        {"id": "babble", "path": str(tiny_model_path), "slots": 2, "ctx_size": 8192, "prompt_cache_mib": 64}])
    short = {"model": "babble", "input": "Hi.", "max_output_tokens": 4}
    with run_server("--models-file", str(models), log_dir=tmp_path, env={"FASTRUN_KEYS_DB": str(db)}) as server, \
            httpx.Client(base_url=server.base_url, timeout=60, headers=bearer(keys["alice"])) as alice, \
            httpx.Client(base_url=server.base_url, timeout=60, headers=bearer(keys["bob"])) as bob:
        job = alice.post("/responses", json=LONG).json()
        assert wait_until(lambda: alice.get(f"/responses/{job['id']}").json()["status"] == "in_progress", 120)
        refused = alice.post("/responses", json=short)
        assert refused.status_code == 429 and "max_concurrent" in refused.json()["error"]["message"], refused.text
        assert bob.post("/responses", json=short).status_code == 200
        assert alice.post(f"/responses/{job['id']}/cancel").json()["status"] == "cancelled"
        assert alice.post("/responses", json=short).status_code == 200  # its place is free again


def test_two_servers_on_one_data_directory_run_a_job_once(tmp_path, tiny_model_path):
    """Servers sharing a data directory hold a lease on each job they run: a job runs on one of
    them; a cancel sent to the other stops it (it answered the job as still running, and the
    job ran on); when the server running a job is killed, the other takes the job over (it did
    so only when started again), and a DELETE sent to either stops it."""
    env = {"FASTRUN_KEYS_DB": str(tmp_path / "keys.sqlite3"), "FASTRUN_PROMPT_CACHE_DIR": str(tmp_path / "cache")}
    models = models_file(tmp_path / "models.toml", [
        {"id": "babble", "path": str(tiny_model_path), "slots": 2, "ctx_size": 8192, "prompt_cache_mib": 64}])
    arguments = ("--models-file", str(models), "--job-lease-s", "3")
    with run_server(*arguments, log_dir=tmp_path, env=env) as first, \
            run_server(*arguments, log_dir=tmp_path, env=env) as second, \
            httpx.Client(base_url=first.base_url, timeout=60) as to_first, \
            httpx.Client(base_url=second.base_url, timeout=60) as to_second:
        job = to_first.post("/responses", json=LONG).json()["id"]
        assert wait_until(lambda: to_second.get(f"/responses/{job}").json()["status"] == "in_progress", 120)
        assert first.busy_slots("babble") == 1 and second.busy_slots("babble") == 0  # run once, where it was sent
        assert to_second.post(f"/responses/{job}/cancel").json()["status"] == "cancelled"
        assert wait_until(lambda: first.busy_slots("babble") == 0, 60), "the cancel sent elsewhere left it running"
        assert to_first.get(f"/responses/{job}").json()["status"] == "cancelled"

        job = to_first.post("/responses", json=LONG).json()["id"]
        assert wait_until(lambda: to_second.get(f"/responses/{job}").json()["status"] == "in_progress", 120)
        first.process.kill()
        first.process.wait()
        assert wait_until(lambda: second.busy_slots("babble") == 1, 60), "the job was not taken over"
        assert to_second.delete(f"/responses/{job}").json()["deleted"] is True
        assert wait_until(lambda: second.busy_slots("babble") == 0, 60)
        assert to_second.get(f"/responses/{job}").status_code == 404


def test_a_background_responses_events_go_with_it(tmp_path):
    """A finished background response keeps its stream events for replay, counted in its size,
    and they go when the response goes past its account's budget (they stayed for good, outside
    every budget and the retention)."""
    with run_server("--slots", "2", "--ctx-size", "1024", "--responses-per-account", "1", log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        request = dict(model=DEFAULT_MODEL, input=QUESTION, background=True, max_output_tokens=8)
        first = settled(client, client.responses.create(**request).id)
        assert [event.type for event in client.responses.retrieve(first.id, stream=True)][-1] == "response.completed" \
            or first.status == "incomplete"
        second = settled(client, client.responses.create(**request).id)
        with pytest.raises(openai.NotFoundError):  # the account keeps one: the first went
            client.responses.retrieve(first.id)
        assert list(client.responses.retrieve(second.id, stream=True))
        with closing(sqlite3.connect(next(tmp_path.glob("keys-*.responses.sqlite3")))) as db:
            kept = [row[0] for row in db.execute("SELECT response_id FROM response_events")]
            jobs = [row[0] for row in db.execute("SELECT id FROM background")]
            size, response = db.execute("SELECT size, length(response) + length(conversation) FROM responses "
                                        "WHERE id = ?", (second.id,)).fetchone()
        assert kept == [second.id] and jobs == [second.id]
        assert size > response  # its events count in its size


def test_batch_lines_and_background_responses_are_runs_of_one_queue(tmp_path, tiny_model_path):
    """Batch lines and background responses are runs of one queue with one limit in flight: with
    one at a time, the engine never holds two (each kind had places of its own, so a batch line
    and a background response were in the engine together), and another account's background
    responses take their turns between an account's batch lines, not after the batch."""
    db = tmp_path / "keys.sqlite3"
    alice, bob, ops = (create_key(db, name) for name in ("alice", "bob", "ops"))
    assert keys_cli(db, "admin", "ops").returncode == 0
    models = models_file(tmp_path / "models.toml", [
        {"id": "babble", "path": str(tiny_model_path), "slots": 2, "ctx_size": 2048, "prompt_cache_mib": 64}])
    lines = [{"custom_id": f"a{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "babble", "messages": [{"role": "user", "content": f"Go on, {i}."}], "max_tokens": 48}}
        for i in range(12)]
    with run_server("--models-file", str(models), "--batch-lines-in-flight", "1", log_dir=tmp_path,
                    env={"FASTRUN_KEYS_DB": str(db)}) as server:
        as_alice = openai.OpenAI(base_url=server.base_url, api_key=alice, max_retries=0)
        as_bob = openai.OpenAI(base_url=server.base_url, api_key=bob, max_retries=0)
        batch = as_alice.batches.create(input_file_id=upload(as_alice, lines).id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        assert wait_until(lambda: as_alice.batches.retrieve(batch.id).request_counts.completed >= 1, 120)
        before = as_alice.batches.retrieve(batch.id).request_counts.completed
        jobs = [as_bob.responses.create(model="babble", input=f"Go on, {i}.", background=True,
                                        max_output_tokens=48).id for i in range(2)]
        most_in_engine = 0

        def bobs_jobs_ended() -> bool:
            nonlocal most_in_engine
            model = server.health(ops)["models"]["babble"]
            most_in_engine = max(most_in_engine, model["busy_slots"] + model["waiting"])
            return all(as_bob.responses.retrieve(job).status not in ("queued", "in_progress") for job in jobs)

        assert wait_until(bobs_jobs_ended, 300)
        lines_meanwhile = as_alice.batches.retrieve(batch.id).request_counts.completed - before
        # At most: the line in flight as bob's jobs came (and one started while `before` was
        # read), then one between bob's two turns.
        assert lines_meanwhile <= 3, f"{lines_meanwhile} of alice's lines ran before bob's two jobs ended"
        assert most_in_engine == 1, f"{most_in_engine} runs of the server's own work were in the engine at once"
        assert finished(as_alice, batch.id).request_counts.completed == len(lines)
