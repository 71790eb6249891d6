"""OpenAI's Batch and Files APIs, driven with the OpenAI SDK against the real server: batches
run to completion with the answers a direct request gets, run behind interactive requests,
cancel, expire, survive kill -9, and stay within their account."""

from __future__ import annotations

import json
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server import DEFAULT_MODEL, run_server, wait_until
from tests.test_keys import create_key, keys_cli

# No end of turn (SmolLM2's <|endoftext|> and <|im_end|>): an answer runs to max_tokens.
NO_EOS = {"0": -100, "2": -100}
DONE = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, content: str, max_tokens: int = 12, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **extra}}


def jsonl(lines: list) -> bytes:
    return "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines).encode()


def upload(client: openai.OpenAI, lines: list):
    return client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 600):
    batch = None

    def done() -> bool:
        nonlocal batch
        batch = client.batches.retrieve(batch_id)
        return batch.status in DONE

    assert wait_until(done, timeout), batch
    return batch


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _line_runs(server) -> int:
    """The chat lines a server answered (lines sent while the model loads are answered 503 and
    sent again: those are not answers)."""
    return sum(1 for line in server.log().splitlines() if '"path": "/v1/chat/completions"' in line
               and '"status": 200' in line)


def same_as_direct(client: openai.OpenAI, outputs: dict[str, dict], bodies: dict[str, dict]) -> None:
    """Each output line's answer is the one its body gets sent directly (two at a time: at
    temperature 0 answers do not depend on batching)."""
    def direct(custom_id: str) -> None:
        answer = client.chat.completions.create(**bodies[custom_id])
        assert outputs[custom_id]["response"]["body"]["choices"][0]["message"]["content"] == \
            answer.choices[0].message.content, custom_id

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(direct, outputs))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("batches")
    with run_server("--slots", "2", "--ctx-size", "1024", log_dir=directory) as server:
        yield server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_a_batch_answers_each_line_as_a_direct_request_would(client):
    questions = {f"q{i}": f"Name a color and a fruit, number {i}." for i in range(5)}
    lines = [chat_line(custom_id, question) for custom_id, question in questions.items()]
    lines.append({"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 8, "temperature": 0, "stream": True}})  # answered whole
    uploaded = upload(client, lines)
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "colors"})
    assert batch.status == "in_progress" and batch.request_counts.total == 6 and batch.metadata == {"job": "colors"}
    batch = finished(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)
    assert batch.error_file_id is None and batch.completed_at >= batch.in_progress_at
    outputs = {line["custom_id"]: line for line in file_lines(client, batch.output_file_id)}
    assert set(outputs) == {*questions, "c0"}
    prompt_tokens = completion_tokens = 0
    for custom_id, question in questions.items():
        line = outputs[custom_id]
        assert line["error"] is None and line["response"]["status_code"] == 200 and line["response"]["request_id"]
        body = line["response"]["body"]
        direct = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": question}],
                                                max_tokens=12, temperature=0)
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content, custom_id
        prompt_tokens += body["usage"]["prompt_tokens"]
        completion_tokens += body["usage"]["completion_tokens"]
    assert outputs["c0"]["response"]["body"]["object"] == "chat.completion"
    c0 = outputs["c0"]["response"]["body"]["usage"]
    assert batch.usage.input_tokens == prompt_tokens + c0["prompt_tokens"]
    assert batch.usage.output_tokens == completion_tokens + c0["completion_tokens"]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)  # over: nothing to cancel
    # Listed, newest first, with their files.
    assert client.batches.list(limit=1).data[0].id == batch.id
    purposes = {item.id: item.purpose for item in client.files.list()}
    assert purposes[uploaded.id] == "batch" and purposes[batch.output_file_id] == "batch_output"


def test_completions_and_embeddings_run_in_batches(client, server):
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": DEFAULT_MODEL, "prompt": f"{i} plus {i} is", "max_tokens": 6, "temperature": 0}}
             for i in range(3)]
    batch = finished(client, client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/completions",
                                                   completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    for line in file_lines(client, batch.output_file_id):
        index = int(line["custom_id"][1:])
        direct = client.completions.create(model=DEFAULT_MODEL, prompt=f"{index} plus {index} is", max_tokens=6,
                                           temperature=0)
        assert line["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    texts = ["The cat sat on the mat.", "Ships at sea."]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": DEFAULT_MODEL, "input": text}} for i, text in enumerate(texts)]
    batch = finished(client, client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/embeddings",
                                                   completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 2
    for line in file_lines(client, batch.output_file_id):
        direct = client.embeddings.create(model=DEFAULT_MODEL, input=texts[int(line["custom_id"][1:])],
                                          encoding_format="float")
        assert line["response"]["body"]["data"][0]["embedding"] == direct.data[0].embedding  # exactly


def embedding_lines(count: int) -> list[dict]:
    return [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": DEFAULT_MODEL, "input": f"Sentence number {i}."}} for i in range(count)]


def test_an_output_file_larger_than_a_piece_is_read_back_whole(client):
    """Output files are written and read in pieces of 1 MiB (never one value in memory, as the
    whole output was): 100 embeddings lines, about 1.2 MB, come back whole, each line once."""
    batch = finished(client, client.batches.create(input_file_id=upload(client, embedding_lines(100)).id,
                                                   endpoint="/v1/embeddings", completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 100
    content = client.files.content(batch.output_file_id).content
    assert len(content) == client.files.retrieve(batch.output_file_id).bytes > 2**20
    lines = [json.loads(line) for line in content.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"e{i}" for i in range(100))
    assert all(len(line["response"]["body"]["data"][0]["embedding"]) == 576 for line in lines)


def test_a_batchs_output_is_capped_and_the_cap_is_named(tmp_path):
    """A line whose result would take the batch's output file past --batch-output-max-mib fails
    with an error naming the cap; the lines before it keep their results."""
    with run_server("--slots", "2", "--ctx-size", "1024", "--batch-output-max-mib", "0.1", log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        batch = finished(client, client.batches.create(input_file_id=upload(client, embedding_lines(20)).id,
                                                       endpoint="/v1/embeddings", completion_window="24h").id)
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert counts.total == 20 and 0 < counts.completed < 20 and counts.completed + counts.failed == 20
        assert client.files.retrieve(batch.output_file_id).bytes <= 0.1 * 2**20
        errors = file_lines(client, batch.error_file_id)
        assert len(errors) == counts.failed
        assert all(line["error"]["code"] == "batch_output_too_large" and "--batch-output-max-mib" in
                   line["error"]["message"] and line["custom_id"].startswith("e") for line in errors)


def test_a_background_responses_line_is_answered_whole_within_the_batch(client):
    """`background: true` in a /v1/responses line: the batch is the background already, so the
    line's answer is in the output file, done (not a `queued` response left to run outside the
    batch's window and usage)."""
    lines = [{"custom_id": "r0", "method": "POST", "url": "/v1/responses",
              "body": {"model": DEFAULT_MODEL, "input": "Say hi.", "max_output_tokens": 8, "background": True}}]
    batch = finished(client, client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/responses",
                                                   completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 1
    (line,) = file_lines(client, batch.output_file_id)
    body = line["response"]["body"]
    assert body["status"] in ("completed", "incomplete") and body["background"] is False
    assert body["output"] and body["usage"]["output_tokens"] > 0


def test_malformed_lines_go_to_the_error_file_and_never_fail_the_batch(client):
    lines = [
        chat_line("good", "Say yes."),
        "{not json",
        "[1, 2, 3]",
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},  # no custom_id
        chat_line("good", "Say no."),  # a repeated custom_id
        {**chat_line("elsewhere", "x"), "url": "/v1/embeddings"},
        {**chat_line("get", "x"), "method": "GET"},
        {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions", "body": "text"},
        {**chat_line("unknown-model", "x"), "body": {**chat_line("", "x")["body"], "model": "no/such-model"}},
        {**chat_line("bad-field", "x"), "body": {**chat_line("", "x")["body"], "temperature": 9}},
        "[" * 100000,  # nested past any parser's depth
    ]
    batch = finished(client, client.batches.create(input_file_id=upload(client, lines).id,
                                                   endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (11, 1, 10)
    errors = file_lines(client, batch.error_file_id)
    assert len(errors) == 10
    codes = sorted(line["error"]["code"] for line in errors if line["error"] is not None)
    assert codes == sorted(["invalid_json_line", "invalid_json_line", "invalid_request", "invalid_custom_id",
                            "duplicate_custom_id", "mismatched_endpoint", "invalid_method", "invalid_body"])
    answered = {line["custom_id"]: line["response"] for line in errors if line["response"] is not None}
    assert answered["unknown-model"]["status_code"] == 404
    assert answered["bad-field"]["status_code"] == 400 and "temperature" in answered["bad-field"]["body"]["error"]["message"]
    assert [line["custom_id"] for line in file_lines(client, batch.output_file_id)] == ["good"]


@pytest.fixture
def busy_slots(server):
    """Keeps both slots busy with interactive streams (two more waiting) until told to
    stop: batch lines, at bulk priority, never get a slot meanwhile."""
    stop = threading.Event()
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)

    def keep_busy() -> None:
        while not stop.is_set():
            stream = client.chat.completions.create(
                model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=200,
                temperature=0, logit_bias=NO_EOS, stream=True)
            for _ in stream:
                if stop.is_set():
                    stream.close()
                    break

    threads = [threading.Thread(target=keep_busy, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: server.busy_slots() == 2, 120)
    yield stop
    stop.set()
    for thread in threads:
        thread.join(timeout=120)


def test_lines_wait_behind_interactive_requests_and_expire_with_the_window(client, server, busy_slots):
    lines = [chat_line(f"late{i}", "Say hi.") for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="2s")
    batch = finished(client, batch.id)
    assert batch.status == "expired" and batch.expired_at is not None, batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 3)
    errors = file_lines(client, batch.error_file_id)
    assert sorted(line["custom_id"] for line in errors) == ["late0", "late1", "late2"]
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}
    assert batch.output_file_id is None


def test_a_cancelled_batch_stops_and_keeps_what_was_done(client, server, busy_slots):
    lines = [chat_line(f"c{i}", "Say hi.") for i in range(4)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    batch = finished(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts.completed == 0 and batch.output_file_id is None
    busy_slots.set()
    assert wait_until(lambda: server.busy_slots() == 0, 120)  # nothing of it left running
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: as it is


def test_an_interactive_request_goes_ahead_of_a_running_batch(client, server):
    lines = [chat_line(f"long{i}", f"Write about the number {i}.", max_tokens=96, logit_bias=NO_EOS)
             for i in range(4)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert wait_until(lambda: server.busy_slots() == 2, 120)  # the batch holds both slots
    answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].message.content
    # Served while the batch still had most of its 4 x 96 tokens to go.
    assert client.batches.retrieve(batch.id).status == "in_progress"
    batch = finished(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 4
    # Lines paused for it resume exactly: each answer is the one a direct request gets.
    same_as_direct(client, {line["custom_id"]: line for line in file_lines(client, batch.output_file_id)},
                   {line["custom_id"]: line["body"] for line in lines})


def test_hostile_files_and_batches_get_clear_4xx(client, server):
    http = httpx.Client(base_url=server.base_url, timeout=120)
    many = b"{}\n" * 50_001
    response = http.post("/files", files={"file": ("many.jsonl", many)}, data={"purpose": "batch"})
    assert response.status_code == 400 and "50000" in response.json()["error"]["message"]
    response = http.post("/files", files={"file": ("big.jsonl", b"x" * (64 * 2**20 + 1))}, data={"purpose": "batch"})
    assert response.status_code == 413
    response = http.post("/files", files={"file": ("bin.jsonl", b"\xff\xfe{}")}, data={"purpose": "batch"})
    assert response.status_code == 400 and "UTF-8" in response.json()["error"]["message"]
    response = http.post("/files", files={"file": ("empty.jsonl", b"\n\n")}, data={"purpose": "batch"})
    assert response.status_code == 400
    response = http.post("/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "fine-tune"})
    assert response.status_code == 400 and "purpose" in response.json()["error"]["message"]
    response = http.post("/files", json={"file": "x", "purpose": "batch"})
    assert response.status_code == 415
    assert http.get("/files/file_nope").status_code == 404
    assert http.get("/files/file_nope/content").status_code == 404
    assert http.delete("/files/file_nope").status_code == 404
    uploaded = upload(client, [chat_line("a", "x")])
    for body, status in [
        ({"input_file_id": uploaded.id, "endpoint": "/v1/images/generations", "completion_window": "24h"}, 400),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "25h"}, 400),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "soon"}, 400),
        ({"input_file_id": "file_nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, 404),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
          "metadata": {f"k{i}": "v" for i in range(17)}}, 400),
    ]:
        response = http.post("/batches", json=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["message"]
    assert http.get("/batches/batch_nope").status_code == 404
    assert http.post("/batches/batch_nope/cancel").status_code == 404
    assert http.get("/batches", params={"limit": 1000}).status_code == 400
    # A file's deletion is final.
    assert client.files.delete(uploaded.id).deleted
    assert http.get(f"/files/{uploaded.id}").status_code == 404


def test_one_accounts_rate_limit_does_not_hold_the_places_of_anothers_lines(tmp_path):
    """Lines refused by their account's limit (429) wait for their Retry-After out of the places
    lines run in: another account's batch runs meanwhile. (They slept in their places, so with
    two slots another account's line waited out the whole minute of the limited one's.)"""
    db = tmp_path / "keys.sqlite3"
    limited, other = create_key(db, "limited"), create_key(db, "other")
    assert keys_cli(db, "limit", "limited", "--rpm", "3").returncode == 0  # the upload, the batch, and one line a minute
    with run_server("--slots", "2", "--ctx-size", "1024", log_dir=tmp_path, env={"FASTRUN_KEYS_DB": str(db)}) as server:
        as_limited = openai.OpenAI(base_url=server.base_url, api_key=limited, max_retries=0)
        as_other = openai.OpenAI(base_url=server.base_url, api_key=other, max_retries=0)
        slow = as_limited.batches.create(input_file_id=upload(as_limited, [chat_line(f"l{i}", "Say hi.")
                                                                           for i in range(4)]).id,
                                         endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_until(lambda: as_limited.batches.retrieve(slow.id).request_counts.completed == 1, 120)
        quick = finished(as_other, as_other.batches.create(input_file_id=upload(as_other, [chat_line("o", "Say hi.")]).id,
                                                           endpoint="/v1/chat/completions", completion_window="24h").id)
        assert quick.status == "completed" and quick.request_counts.completed == 1
        counts = as_limited.batches.retrieve(slow.id).request_counts
        assert counts.completed == 1 and counts.failed == 0  # still waiting for its minute, not failed


def test_files_batches_and_answers_stay_within_their_account(tmp_path):
    db = tmp_path / "keys.sqlite3"
    alice, bob = create_key(db, "alice"), create_key(db, "bob")
    env = {"FASTRUN_KEYS_DB": str(db), "FASTRUN_PROMPT_CACHE_DIR": str(tmp_path / "prompt-cache")}
    with run_server("--slots", "2", "--ctx-size", "1024", log_dir=tmp_path, env=env) as server:
        as_alice = openai.OpenAI(base_url=server.base_url, api_key=alice, max_retries=0)
        as_bob = openai.OpenAI(base_url=server.base_url, api_key=bob, max_retries=0)
        uploaded = upload(as_alice, [chat_line("secret", "Say the word plum.")])
        batch = finished(as_alice, as_alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                           completion_window="24h").id)
        assert batch.status == "completed" and batch.request_counts.completed == 1
        for call in (lambda: as_bob.files.retrieve(uploaded.id), lambda: as_bob.files.content(batch.output_file_id),
                     lambda: as_bob.files.delete(uploaded.id), lambda: as_bob.batches.retrieve(batch.id),
                     lambda: as_bob.batches.cancel(batch.id),
                     lambda: as_bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                   completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert not as_bob.batches.list().data and not as_bob.files.list().data
        # A background response likewise.
        queued = as_alice.responses.create(model=DEFAULT_MODEL, input="Say the word pear.", background=True,
                                           max_output_tokens=8, temperature=0)
        for call in (lambda: as_bob.responses.retrieve(queued.id), lambda: as_bob.responses.cancel(queued.id),
                     lambda: list(as_bob.responses.retrieve(queued.id, stream=True))):
            with pytest.raises(openai.NotFoundError):
                call()
        assert wait_until(lambda: as_alice.responses.retrieve(queued.id).status not in ("queued", "in_progress"),
                          300)
        assert httpx.get(f"{server.base_url}/files").status_code == 401
    # The line ran as alice: her usage holds it, and bob has none.
    usage = keys_cli(db, "usage")
    rows = {line.split()[0]: line.split()[1:] for line in usage.stdout.splitlines()[1:]}
    assert set(rows) == {"alice"}, usage.stdout
    requests, prompt, _, completion, batch_requests, batch_prompt, batch_completion = map(int, rows["alice"])
    # (the batch line and the background response, both counted as batch work)
    assert requests == batch_requests == 2 and prompt == batch_prompt > 0 and completion == batch_completion > 0
    store = db.with_name(db.stem + ".batches.sqlite3")
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o600


def _killed_mid_batch(tmp_path, arguments: tuple[str, ...], count: int, done: int):
    """A batch of `count` long chat lines, on a server killed with kill -9 once `done` of them
    are done: (the environment naming its data directory, the lines, the batch's id, the lines
    done at the kill)."""
    env = {"FASTRUN_KEYS_DB": str(tmp_path / "keys.sqlite3"), "FASTRUN_PROMPT_CACHE_DIR": str(tmp_path / "cache")}
    lines = [chat_line(f"k{i}", f"List some words that start with the letter {chr(97 + i)}.", max_tokens=48,
                       logit_bias=NO_EOS) for i in range(count)]
    with run_server(*arguments, log_dir=tmp_path, env=env) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= done, 600)
        done_before = client.batches.retrieve(batch.id).request_counts.completed
        server.process.kill()  # kill -9, in the middle
        server.process.wait()
    return env, lines, batch.id, done_before


def test_a_batch_survives_kill_9_and_no_line_is_answered_twice(tmp_path):
    arguments = ("--slots", "2", "--ctx-size", "1024")
    env, lines, batch_id, _ = _killed_mid_batch(tmp_path, arguments, 10, 2)
    with run_server(*arguments, log_dir=tmp_path, env=env) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        batch = finished(client, batch_id)
        rerun = _line_runs(server)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 10, 0)
        outputs = file_lines(client, batch.output_file_id)
        assert sorted(line["custom_id"] for line in outputs) == sorted(line["custom_id"] for line in lines)  # once
        assert rerun <= 8  # at least the 2 lines done before the kill were not run again
        same_as_direct(client, {line["custom_id"]: line for line in outputs},
                       {line["custom_id"]: line["body"] for line in lines})


def test_two_servers_on_one_data_directory_run_each_line_once(tmp_path):
    """Servers sharing a data directory (the default for one user) hold a lease on each batch
    they run: after a kill -9, two servers started on the same store run the lines left once
    between them (both resumed every line: 36 runs for 20 lines), and when the one running the
    batch is killed too, the other takes it over and finishes it. One line runs at a time, so
    the batch outlasts the start of the servers by far."""
    arguments = ("--slots", "2", "--ctx-size", "1024", "--batch-lines-in-flight", "1", "--job-lease-s", "3")
    env, lines, batch_id, done_before = _killed_mid_batch(tmp_path, arguments, 24, 4)
    with run_server(*arguments, log_dir=tmp_path, env=env) as second, \
            run_server(*arguments, log_dir=tmp_path, env=env) as third:
        servers = (second, third)
        client = openai.OpenAI(base_url=third.base_url, api_key="unused", max_retries=0)
        # Both servers up, and lines answered meanwhile: by then both ran lines, before leases.
        assert wait_until(lambda: client.batches.retrieve(batch_id).request_counts.completed >= done_before + 8, 600)
        holder, survivor = sorted(servers, key=_line_runs, reverse=True)
        assert _line_runs(survivor) == 0, "both servers ran the batch's lines"
        holder.process.kill()  # the one running it dies too: the other takes it over
        holder.process.wait()
        client = openai.OpenAI(base_url=survivor.base_url, api_key="unused", max_retries=0)
        batch = finished(client, batch_id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (24, 24, 0)
        outputs = file_lines(client, batch.output_file_id)
        assert sorted(line["custom_id"] for line in outputs) == sorted(line["custom_id"] for line in lines)  # once
        # Each line left ran once, but for the one in flight when each server was killed.
        assert _line_runs(holder) + _line_runs(survivor) <= len(lines) - done_before + 2


def test_an_accounts_files_are_bounded_and_batch_outputs_count(tmp_path):
    with run_server("--slots", "1", "--ctx-size", "512", "--files-per-account", "2", "--batches-per-account", "1",
                    log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        uploaded = upload(client, [chat_line("a", "Say yes.", max_tokens=2)])
        batch = finished(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h").id)
        assert batch.status == "completed" and batch.output_file_id  # the account now holds 2 files
        with pytest.raises(openai.RateLimitError, match="files"):
            upload(client, [chat_line("b", "x")])
        with pytest.raises(openai.RateLimitError, match="files"):  # its outputs cannot pile up either
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        client.files.delete(batch.output_file_id)
        client.files.delete(uploaded.id)
        longer = upload(client, [chat_line(f"l{i}", "Say yes.", max_tokens=64, logit_bias=NO_EOS) for i in range(8)])
        running = client.batches.create(input_file_id=longer.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        with pytest.raises(openai.RateLimitError, match="batches running"):  # one at a time here
            client.batches.create(input_file_id=longer.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert finished(client, running.id).status == "completed"
