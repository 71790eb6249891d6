"""Prompt prefixes are reused across requests, reported exactly as cached_tokens, and never
change an answer."""

from __future__ import annotations

import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server


def document(topic: str, sentences: int = 40) -> str:
    """A long, unique, deterministic prompt prefix (about 12 tokens a sentence)."""
    facts = " ".join(f"Fact {i}: the {topic} number {i * 7 % 13} is kept in drawer {i}." for i in range(sentences))
    return f"{topic.capitalize()}. {facts}"  # starts with the topic: no two documents share a first token


class Client:
    def __init__(self, base_url: str, model: str = DEFAULT_MODEL) -> None:
        self.base_url = base_url
        self.model = model

    def complete(self, prompt: str, max_tokens: int = 24) -> dict:
        response = httpx.post(
            f"{self.base_url}/completions",
            json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        return response.json()

    def stats(self) -> dict:
        health = httpx.get(f"{self.base_url.removesuffix('/v1')}/health").json()
        return health["models"][self.model]["stats"]


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(response: dict) -> str:
    return response["choices"][0]["text"]


@pytest.fixture(scope="module")
def shared(server) -> Client:
    return Client(server.base_url)


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory) -> Client:
    with run_server("--slots", "1", "--ctx-size", "2048", log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield Client(s.base_url)


@pytest.fixture(scope="module")
def one_slot_no_host_cache(tmp_path_factory) -> Client:
    with run_server("--slots", "1", "--ctx-size", "2048", "--prompt-cache-mib", "0",
                    log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield Client(s.base_url)


def test_identical_prompt_reuses_all_but_the_last_token(shared):
    prompt = document("walruses")
    cold = shared.complete(prompt)
    warm = shared.complete(prompt)
    assert cached(cold) == 0
    assert cached(warm) == warm["usage"]["prompt_tokens"] - 1
    assert text(warm) == text(cold)


def test_cached_tokens_is_exactly_the_shared_prefix(shared, one_slot_no_host_cache):
    prefix = document("lanterns")
    prefix_tokens = shared.complete(prefix, max_tokens=1)["usage"]["prompt_tokens"]
    # Same prefix, different continuations (starting with different words).
    reference = one_slot_no_host_cache.complete(prefix + " Zebras are striped.")
    assert cached(reference) == 0
    first = shared.complete(prefix + " Apples grow on trees.")
    second = shared.complete(prefix + " Zebras are striped.")
    assert cached(first) == prefix_tokens - 1 or cached(first) == prefix_tokens
    assert cached(second) == prefix_tokens
    assert text(second) == text(reference)  # a hit answers exactly like a cold run


def test_prompt_that_is_a_prefix_of_a_cached_one(shared, one_slot_no_host_cache):
    long_prompt = document("teapots") + " The last drawer holds"
    short_prompt = document("teapots")
    reference = one_slot_no_host_cache.complete(short_prompt)
    assert cached(reference) == 0
    shared.complete(long_prompt)
    hit = shared.complete(short_prompt)
    assert cached(hit) == hit["usage"]["prompt_tokens"] - 1
    assert text(hit) == text(reference)


def test_prompt_diverging_at_the_first_token(shared):
    base = document("gliders")
    shared.complete(base)
    diverged = shared.complete("Quietly, " + base)
    assert cached(diverged) == 0
    again = shared.complete("Quietly, " + base)
    assert text(again) == text(diverged)


def test_host_cache_keeps_prefixes_past_slot_reuse(one_slot):
    a, b = document("harbors"), document("volcanoes")
    first_a = one_slot.complete(a)
    before = one_slot.stats()
    one_slot.complete(b)  # takes the only slot: the harbors prefix moves to host RAM
    second_a = one_slot.complete(a)
    after = one_slot.stats()
    assert cached(second_a) == second_a["usage"]["prompt_tokens"] - 1
    assert text(second_a) == text(first_a)
    assert after["host_hits"] == before["host_hits"] + 1
    assert after["host_saves"] >= before["host_saves"] + 1


def test_without_host_cache_the_prefix_is_lost(one_slot_no_host_cache):
    client = one_slot_no_host_cache
    a, b = document("bridges"), document("glaciers")
    first_a = client.complete(a)
    client.complete(b)
    second_a = client.complete(a)
    assert cached(second_a) == 0
    assert text(second_a) == text(first_a)


def test_five_turn_chats_keep_hitting_with_more_users_than_slots(tmp_path):
    users = 5
    with run_server("--slots", "2", "--ctx-size", "2048", log_dir=tmp_path) as s:
        conversations = [
            [{"role": "system", "content": f"You are assistant number {u}. " + document(f"user{u}", 10)}]
            for u in range(users)
        ]
        hits = []
        for turn in range(5):
            for u, messages in enumerate(conversations):
                messages.append({"role": "user", "content": f"Tell me fact {turn} again, briefly."})
                response = httpx.post(
                    f"{s.base_url}/chat/completions",
                    json={"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 20, "temperature": 0},
                    timeout=120,
                ).json()
                messages.append({"role": "assistant", "content": response["choices"][0]["message"]["content"]})
                if u == 0:
                    hits.append((response["usage"]["prompt_tokens"], cached(response)))
    previous_prompt = [prompt for prompt, _ in hits[:-1]]
    for (_, hit), before in zip(hits[1:], previous_prompt):
        # Every later turn reuses at least the whole previous prompt, though 4 other users
        # went through the 2 slots in between.
        assert hit >= before, hits


def test_restoring_an_entry_that_saving_the_slot_evicts(tmp_path):
    """With room for one saved prefix, saving the slot's content evicts the entry about to be
    restored: the restore must still happen (and answer right)."""
    with run_server("--slots", "1", "--ctx-size", "1024", "--prompt-cache-mib", "4", log_dir=tmp_path) as s:
        client = Client(s.base_url)
        a, b = document("otters", 6), document("pylons", 6)
        first_a = client.complete(a)
        client.complete(b)
        again = client.complete(a)
        assert cached(again) == again["usage"]["prompt_tokens"] - 1
        assert text(again) == text(first_a)
        assert client.stats()["host_hits"] == 1
