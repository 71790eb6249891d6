"""A cache hit answers exactly like a cold run, at temperature 0: from the slot, from host RAM
and from disk after a restart, for prompts of 100 to 3000 tokens, on both default models, when
the whole prompt is cached and when only part of it is (the rest then evaluated in chunks
that a cold run cuts elsewhere). This holds because the default (deterministic) kernels
compute every row the same way whatever else is in its batch."""

from __future__ import annotations

import pytest

from tests.server import DEFAULT_MODEL, run_server
from tests.test_prefix_cache import Client, cached, text

SIZES = {"short": 100, "medium": 1000, "long": 3000}  # first prompt's tokens, roughly


def prompt_of(model: str, size: str, topic: str) -> str:
    """About SIZES[size] tokens of unique text (records of ~19 tokens)."""
    per_fact = 19
    facts = max(3, SIZES[size] // per_fact)
    lines = " ".join(f"Record {i}: the {topic} id {i * 37 % 101} belongs to shelf {i % 17}." for i in range(facts))
    return f"{topic.capitalize()} ledger. {lines} Question: which shelf holds record 7? Answer:"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model_flags(request, gemma_path):
    if request.param == "smollm2":
        return DEFAULT_MODEL, []
    return gemma_path.stem, ["--model", str(gemma_path)]


class ColdReference(Client):
    """Cold answers only: no host or disk cache, and the only slot emptied before each prompt."""

    def cold(self, prompt: str) -> dict:
        self.complete("Zz", max_tokens=1)
        answer = self.complete(prompt)
        assert cached(answer) <= 1  # at most a shared <bos>
        return answer


@pytest.fixture(scope="module")
def reference(model_flags, tmp_path_factory):
    model, flags = model_flags
    with run_server(*flags, "--slots", "1", "--ctx-size", "3600", "--prompt-cache-mib", "0",
                    "--prompt-cache-disk-gib", "0", log_dir=tmp_path_factory.mktemp("logs")) as server:
        yield ColdReference(server.base_url, model=model)


def next_turn(prompt: str, answer: dict, record: int) -> str:
    return f"{prompt}{text(answer)} Question: which shelf holds record {record}? Answer:"


@pytest.mark.parametrize("size", list(SIZES))
def test_hits_from_slot_host_and_disk_answer_like_cold_runs(size, model_flags, reference, tmp_path):
    """Each hit is checked against a cold run of the same prompt. Host and disk hits serve the
    next turn of the conversation (a saved state of a sliding-window model keeps only its last
    window, so on Gemma it serves what continues all of it)."""
    model, flags = model_flags
    prompt = prompt_of(model, size, f"{size} exact")
    # Shares the first ~60% of `prompt`, then goes elsewhere: a later `prompt` reuses that part
    # and evaluates the rest (hundreds of tokens for the long prompts) in chunks a cold run
    # cuts elsewhere.
    detour = prompt[: int(len(prompt) * 0.6)] + " Unrelated: the tide tables for the northern piers."
    server_flags = [*flags, "--slots", "1", "--ctx-size", "3600"]
    env = {"FASTRUN_PROMPT_CACHE_DIR": str(tmp_path / "prompt-cache")}
    with run_server(*server_flags, log_dir=tmp_path, env=env) as server:
        client = Client(server.base_url, model=model)
        client.complete(detour)
        partial = client.complete(prompt)  # part from the slot, the rest evaluated
        assert 0 < cached(partial) < partial["usage"]["prompt_tokens"] - 1
        full = client.complete(prompt)  # all but the last token from the slot
        assert cached(full) == full["usage"]["prompt_tokens"] - 1
        client.complete(prompt_of(model, "short", "unrelated"))  # takes the only slot: what it held
        second_turn = next_turn(prompt, full, 9)                  # moves to host RAM and disk
        from_host = client.complete(second_turn)
        assert cached(from_host) >= full["usage"]["prompt_tokens"]
        assert client.stats()["host_hits"] == 1
    third_turn = next_turn(second_turn, from_host, 11)
    with run_server(*server_flags, log_dir=tmp_path, env=env) as server:  # a restart
        client = Client(server.base_url, model=model)
        from_disk = client.complete(third_turn)
        assert cached(from_disk) >= from_host["usage"]["prompt_tokens"]
        assert client.stats()["disk_hits"] == 1
    cold = reference.cold(prompt)
    assert text(partial) == text(full) == text(cold)
    assert text(from_host) == text(reference.cold(second_turn))
    assert text(from_disk) == text(reference.cold(third_turn))


def test_batching_never_changes_an_answer(reference, model_flags, tmp_path):
    """Eight different prompts decoded together, prefills mixed with other slots' decode steps,
    answer as each does alone."""
    import concurrent.futures

    model, flags = model_flags
    prompts = [prompt_of(model, "short", f"batch {i}") for i in range(8)]
    alone = [text(reference.cold(p)) for p in prompts]
    with run_server(*flags, "--slots", "8", "--ctx-size", "1024", log_dir=tmp_path) as server:
        client = Client(server.base_url, model=model)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: text(client.complete(p)), prompts))
    assert together == alone
