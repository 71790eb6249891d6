"""Replica choice (engine.routing), shared by the in-process pool and the Ray Serve router,
with fake replicas: no engine, no Ray."""

from __future__ import annotations

from fastrun_cpp.engine.routing import (
    BLOCK_TOKENS,
    PrefixMemory,
    ReplicaLoad,
    SessionMemory,
    block_hashes,
    cached_tokens,
    held_hashes,
    rank_replicas,
)

SYSTEM_A = list(range(1000, 1000 + 10 * BLOCK_TOKENS))
SYSTEM_B = list(range(5000, 5000 + 10 * BLOCK_TOKENS))


def load(key, cached=0, running=0, waiting=0, slots=4, tenants=0):
    return ReplicaLoad(key, cached, running, waiting, slots, tenants)


def test_block_hashes_name_whole_prefixes():
    a, b = block_hashes(SYSTEM_A + [1, 2, 3]), block_hashes(SYSTEM_A[:5 * BLOCK_TOKENS] + SYSTEM_B)
    assert len(a) == 10 and a[:5] == b[:5] and a[5] != b[5]
    assert block_hashes(SYSTEM_A[:BLOCK_TOKENS - 1]) == []


def test_cached_tokens_counts_leading_blocks_only():
    held = held_hashes([("", SYSTEM_A[:4 * BLOCK_TOKENS])])
    assert cached_tokens(block_hashes(SYSTEM_A), held) == 4 * BLOCK_TOKENS
    assert cached_tokens(block_hashes(SYSTEM_B), held) == 0


def test_a_prefix_held_for_one_tenant_is_nothing_to_another():
    held = held_hashes([("account:a", SYSTEM_A)])
    assert cached_tokens(block_hashes(SYSTEM_A, "account:a"), held) == len(SYSTEM_A) // BLOCK_TOKENS * BLOCK_TOKENS
    assert cached_tokens(block_hashes(SYSTEM_A, "account:b"), held) == 0
    assert cached_tokens(block_hashes(SYSTEM_A), held) == 0


def test_affinity_the_replica_holding_the_prefix_wins():
    assert rank_replicas([load("x"), load("y", cached=640), load("z", cached=64)])[0] == "y"


def test_free_slot_beats_a_cached_prefix_behind_a_queue():
    ranked = rank_replicas([load("busy", cached=640, running=4, waiting=1), load("idle")])
    assert ranked == ["idle", "busy"]


def test_imbalance_falls_back_to_the_least_loaded():
    # Both have free slots, but the one holding the prefix is far busier.
    replicas = [load("hot", cached=640, running=6, slots=16), load("cold", running=1, slots=16)]
    assert rank_replicas(replicas, imbalance=4)[0] == "cold"
    assert rank_replicas(replicas, imbalance=8)[0] == "hot"


def test_a_new_prefix_goes_where_fewest_prefixes_are():
    assert rank_replicas([load("a", tenants=3), load("b", tenants=1)])[0] == "b"


def test_a_dead_replica_is_dropped_from_memory_and_routing():
    memory = PrefixMemory()
    hashes = block_hashes(SYSTEM_A)
    memory.remember(hashes, "r1")
    assert memory.cached(hashes, "r1") == len(hashes) * BLOCK_TOKENS and memory.tenants("r1") == len(hashes)
    memory.forget("r1")
    assert memory.cached(hashes, "r1") == 0 and memory.tenants("r1") == 0
    # Routing only ever ranks the replicas it is given: the living ones.
    assert rank_replicas([load("r2")]) == ["r2"] and rank_replicas([]) == []


def test_memory_is_bounded():
    memory = PrefixMemory(capacity=5)
    memory.remember(block_hashes(SYSTEM_A), "r1")
    assert memory.tenants("r1") == 5


def test_a_conversation_goes_back_to_the_replica_that_served_it():
    """The session hint (prompt_cache_key, Claude Code's session) breaks what the cache cannot:
    no replica holds the prompt yet (a turn still being read elsewhere), both are free."""
    sessions = SessionMemory()
    sessions.remember("ns", "thread-1", "b")
    last = sessions.replica("ns", "thread-1")
    ranked = rank_replicas([ReplicaLoad(key, 0, 0, 0, 4, session=key == last) for key in ("a", "b")])
    assert ranked[0] == "b"
    # A cached prefix still counts first, and a queue is still not worth it.
    assert rank_replicas([ReplicaLoad("a", 640, 0, 0, 4), ReplicaLoad("b", 0, 0, 0, 4, session=True)])[0] == "a"
    assert rank_replicas([ReplicaLoad("a", 0, 1, 0, 4), ReplicaLoad("b", 0, 4, 2, 4, session=True)])[0] == "a"
    assert sessions.replica("other-namespace", "thread-1") is None and sessions.replica("ns", "") is None


def test_sessions_are_bounded_and_forget_dead_replicas():
    sessions = SessionMemory(capacity=3)
    for index in range(5):
        sessions.remember("", f"s{index}", "a" if index % 2 else "b")
    assert sessions.replica("", "s0") is None and sessions.replica("", "s4") == "b"
    sessions.forget("b")
    assert sessions.replica("", "s4") is None and sessions.replica("", "s3") == "a"
