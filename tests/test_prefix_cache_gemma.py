"""Prefix reuse on Gemma 3, whose sliding-window layers can make a stored prefix unusable:
such a prefix must fall back to a miss, never read missing cells.

With the full sliding-window KV (the default) a hit answers exactly like a cold run. With
--no-swa-full the window's KV is a ring buffer: which cell holds which position depends on the
slot's history, and attention sums over cells in cell order, so hits and cold runs round
differently (docs/caching-and-determinism.md); there the tests check the cache's decisions only."""

from __future__ import annotations

import pytest

from tests.server import run_server
from tests.test_prefix_cache import Client, cached, document, text

# Longer than Gemma 3's 512-token sliding window (about 22 tokens a fact).
LONG = 40
# Longer than the window-only SWA cache (window + batch = 1024 cells): its start gets pruned.
VERY_LONG = 62


def assert_exact(mode: str, *answers: str) -> None:
    assert all(answers), answers
    if mode == "swa-full":
        assert len(set(answers)) == 1, answers


@pytest.fixture(scope="module", params=["swa-full", "swa-window-only"])
def gemma(request, gemma_path, tmp_path_factory):
    flags = ["--swa-full"] if request.param == "swa-full" else ["--no-swa-full"]
    with run_server("--model", str(gemma_path), "--slots", "1", "--ctx-size", "2048", *flags,
                    log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield request.param, Client(s.base_url, model=gemma_path.stem)


@pytest.fixture(scope="module")
def gemma_reference(gemma_path, tmp_path_factory):
    """Cold answers: every prompt here is new to this server."""
    with run_server("--model", str(gemma_path), "--slots", "1", "--ctx-size", "2048", "--prompt-cache-mib", "0",
                    log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield Client(s.base_url, model=gemma_path.stem)


def test_identical_long_prompt(gemma, gemma_reference):
    mode, client = gemma
    prompt = document(f"kites {mode}", VERY_LONG)
    reference = gemma_reference.complete(prompt)
    first = client.complete(prompt)
    second = client.complete(prompt)
    assert cached(reference) <= 1  # at most the shared <bos>
    assert_exact(mode, text(first), text(second), text(reference))
    # Reusing all of it needs only the last window, which even a window-only cache keeps.
    assert cached(second) == second["usage"]["prompt_tokens"] - 1


def test_shared_long_prefix_then_a_long_detour(gemma, gemma_reference):
    mode, client = gemma
    prefix = document(f"comets {mode}", LONG)
    detour = prefix + " " + document("unrelated asteroids", 30)
    question = prefix + " Which drawer holds number 3?"
    reference = gemma_reference.complete(question)
    client.complete(detour)
    hit = client.complete(question)
    assert cached(reference) <= 1
    assert_exact(mode, text(hit), text(reference))
    prefix_tokens = hit["usage"]["prompt_tokens"] - 12
    if mode == "swa-full":
        assert cached(hit) > prefix_tokens
    else:
        # The detour pushed the prefix's last window out of the window-only cache: the reuse
        # would read missing cells, so it is detected and recomputed instead.
        assert cached(hit) == 0


def test_short_prefix_within_the_window(gemma, gemma_reference):
    mode, client = gemma
    prompt = document(f"owls {mode}", 8)  # well inside the window: reusable in both modes
    reference = gemma_reference.complete(prompt, max_tokens=8)
    client.complete(prompt, max_tokens=8)
    hit = client.complete(prompt, max_tokens=8)
    assert_exact(mode, text(hit), text(reference))
    assert cached(hit) == hit["usage"]["prompt_tokens"] - 1


def test_host_cache_serves_the_next_turn(gemma, gemma_reference):
    """A saved state keeps sliding-window KV for its last window only: it serves prompts that
    continue the whole saved sequence (the next turn), which is what chats send."""
    mode, client = gemma
    a, b = document(f"canals {mode}", LONG), document(f"deserts {mode}", LONG)
    first = client.complete(a)
    client.complete(b)  # evicts a (and its answer) from the only slot into host RAM
    follow_up = a + text(first) + " Fact 99:"
    reference = gemma_reference.complete(follow_up)
    again = client.complete(follow_up)
    assert cached(reference) <= 1  # at most the shared <bos>
    assert_exact(mode, text(again), text(reference))
    assert cached(again) >= first["usage"]["prompt_tokens"]


def test_host_cache_entry_that_cannot_serve_is_a_clean_miss(gemma, gemma_reference):
    mode, client = gemma
    a, b = document(f"rivers {mode}", LONG), document(f"forests {mode}", LONG)
    reference = gemma_reference.complete(a)
    client.complete(a)
    client.complete(b)
    again = client.complete(a)  # a prefix of the saved a+answer: its window is gone
    assert_exact(mode, text(again), text(reference))
    assert cached(again) <= 1
